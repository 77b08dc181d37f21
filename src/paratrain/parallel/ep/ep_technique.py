"""Expert parallelism (--ep) as the registry holds it: its check, its apply (and the balancing loss's wiring,
which every MoE run gets), what the search tries, and its token exchange's step-time term."""

from __future__ import annotations

from paratrain.parallel.ep import ep_cost
from paratrain.parallel.technique import Technique


class ExpertParallel(Technique):
    apply_order = 30
    family, family_rank = "expert-parallel", 60  # its bar is measured on MoE runs alone

    def enabled(self, layout) -> bool:
        return layout.ep > 1

    def check(self, args, layout, seq_len: int | None = None) -> None:
        from paratrain.parallel.ep.expert_parallel import check_ep

        check_ep(args, layout, seq_len)

    def apply(self, model, layout, tp_plan: dict | None = None):
        from paratrain.parallel.ep.expert_parallel import apply_ep, attach_moe, moe_modules
        from paratrain.parallel.loss_weighting import LossWeighting

        weighting = LossWeighting.on_this_rank(layout)
        if moe_modules(model):
            attach_moe(model, layout, weighting)
        if not self.enabled(layout):
            return model
        from paratrain.parallel.dp.data_parallel import mixed_precision_policy

        return apply_ep(model, layout.submesh("ep"), layout.submesh("ep_rest"), weighting,
                        reshard_after_forward=layout.zero_stage != 2, mp_policy=mixed_precision_policy(layout.dtype))

    def breaks_compiled_graph(self, model, layout) -> bool:
        from paratrain.parallel.ep.expert_parallel import moe_modules

        return bool(moe_modules(model))  # an MoE layer's host reads (split sizes) cannot be traced

    def searched_degree(self, args, degree: int) -> bool:
        return degree == 1 or (args.moe and args.n_experts % degree == 0)

    def allows_sp(self, layout_degree: int) -> bool:
        return layout_degree == 1  # --ep runs without SP (expert_parallel.py check_ep)

    def step_cost(self, p, chunks: list, busy: float) -> dict[str, float]:
        layout, args = p.layout, p.args
        # the MoE blocks of the pacing stage rank's model parts (all of them without a pipeline)
        moe_blocks = sum(c.tr.counts(c.layers)["block"] for c in chunks) if args.moe else 0
        seconds = busy * ep_cost.moe_all_to_all(p.profile, args, layout, p.seq_len, p.dtype, moe_blocks, p.est,
                                                p.moe_routing)
        return {"ep_comm_s": seconds} if seconds else {}


EXPERT_PARALLEL = ExpertParallel()
