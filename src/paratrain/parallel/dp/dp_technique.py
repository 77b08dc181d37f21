"""Data parallelism (--dp-replicate, --dp-shard: DDP, ZeRO, FSDP2, HSDP) as the registry holds it: its apply
(last: it wraps the already-split model) and its step-time terms."""

from __future__ import annotations

from paratrain.parallel.dp import dp_cost
from paratrain.parallel.technique import Technique


class DataParallel(Technique):
    apply_order = 60
    family_rank = 10
    inference_role = "replicas"

    def family_of(self, layout) -> str:
        return "FSDP" if layout.fsdp else "DDP/ZeRO-1" if layout.dp > 1 else ""

    def enabled(self, layout) -> bool:
        return layout.dp > 1

    def apply(self, model, layout, tp_plan: dict | None = None):
        # FSDP2 (ZeRO-2/3, HSDP) when dp_shard > 1, else DDP (+ comm hook / local SGD) over dp_cp; one device: as is
        from paratrain.parallel.dp.data_parallel import apply_data_parallel

        return apply_data_parallel(model, layout)

    def search_options(self, degrees: dict[str, int], fixed: dict, dims: tuple) -> list[dict]:
        # every stage (the search keeps those the strategy of the layout runs again: strategies.zero_stages)
        return [{"zero_stage": s} for s in range(4) if fixed.get("zero_stage") is None or s == fixed["zero_stage"]]

    def frugal_options(self, degrees: dict[str, int]) -> dict:
        sharded = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1) > 1
        return {"zero_stage": 3 if sharded else 0}  # ZeRO-3 (FSDP) over every data-parallel rank

    def reasons(self, r) -> list[str]:
        lay = r.layout
        if lay.fsdp:
            replicated, sharded = self._states_replicated(r), r.states(lay)
            stage = "ZeRO-3" if lay.zero_stage == 3 else "ZeRO-2"
            if replicated > r.usable:
                return [f"{stage} needed: model states {r.gib(replicated)} > {r.gib(r.usable)} per GPU unsharded; "
                        f"sharded {lay.shard_degree} ways they take {r.gib(sharded)}"]
            return [f"{stage} shards parameters, gradients and optimizer state {lay.shard_degree} ways "
                    f"({r.gib(replicated)} -> {r.gib(sharded)} of model states)"]
        if lay.dp_replicate > 1:
            kind = "ZeRO-1 (optimizer state sharded)" if lay.zero_stage == 1 else "DDP"
            out = [f"{kind}: every GPU holds {r.gib(r.states(lay))} of model states"]
            if lay.zero_stage == 1 and r.dist_optimizer:
                out.append("priced as a distributed optimizer (--dist-optimizer: gradients reduce-scattered and "
                           "parameters all-gathered once per step, overlapped); paratrain's runtime runs ZeRO-1 as "
                           "ZeroRedundancyOptimizer")
            return out
        return []

    @staticmethod
    def _states_replicated(r) -> float:
        """A rank's model states with every data-parallel rank a replica (nothing sharded)."""
        lay = r.layout
        return r.states(type(lay)(tp=lay.tp, pp=lay.pp, dp_replicate=lay.world // lay.tp // lay.pp))

    def step_reasons(self, r) -> list[str]:
        lay = r.layout
        if not (lay.dp > 1 or lay.cp > 1):
            return []
        # the group gradients are reduced over (context-parallel ranks hold replicas of the weights too)
        group = "dp_shard_cp" if (lay.fsdp and lay.cp > 1) else ("dp" if lay.fsdp or lay.zero_stage else "dp_cp")
        if lay.placement(group, r.gpu.gpus_per_node) == "inter":
            return [f"data-parallel collectives cross nodes ({r.gpu.inter_node_gbs:g} GB/s per GPU)"]
        return []

    def kept_gradients(self, tr, args, layout) -> tuple | None:
        from paratrain.parallel.dp.dp_memory import kept_gradients

        return kept_gradients(tr, args, layout)

    def shard_states(self, s, tr, args, layout, part: str, layers: int, dtype: str, notes: list[str]) -> None:
        from paratrain.parallel.dp.dp_memory import shard_states

        shard_states(s, tr, args, layout, part, layers, dtype, notes)

    def optimizer_share(self, layout, seconds: float) -> float:
        return dp_cost.optimizer_share(layout, seconds)

    def step_cost(self, p, chunks: list, busy: float) -> dict[str, float]:
        from paratrain.parallel.ep.ep_cost import expert_param_share

        return {"dp_comm_exposed_s": dp_cost.data_parallel_comm(
            p.profile, p.layout, chunks, p.dtype, p.est, p.rails, p.dist_optimizer, expert_param_share(p.args))}


DATA_PARALLEL = DataParallel()
