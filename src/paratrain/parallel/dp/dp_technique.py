"""Data parallelism (--dp-replicate, --dp-shard: DDP, ZeRO, FSDP2, HSDP) as the registry holds it: its apply
(last: it wraps the already-split model) and its step-time terms."""

from __future__ import annotations

from paratrain.parallel.dp import dp_cost
from paratrain.parallel.technique import Technique


class DataParallel(Technique):
    apply_order = 60
    family_rank = 10

    def family_of(self, layout) -> str:
        return "FSDP" if layout.fsdp else "DDP/ZeRO-1" if layout.dp > 1 else ""

    def enabled(self, layout) -> bool:
        return layout.dp > 1

    def apply(self, model, layout, tp_plan: dict | None = None):
        # FSDP2 (ZeRO-2/3, HSDP) when dp_shard > 1, else DDP (+ comm hook / local SGD) over dp_cp; one device: as is
        from paratrain.parallel.dp.data_parallel import apply_data_parallel

        return apply_data_parallel(model, layout)

    def optimizer_share(self, layout, seconds: float) -> float:
        return dp_cost.optimizer_share(layout, seconds)

    def step_cost(self, p, chunks: list, busy: float) -> dict[str, float]:
        from paratrain.parallel.ep.ep_cost import expert_param_share

        return {"dp_comm_exposed_s": dp_cost.data_parallel_comm(
            p.profile, p.layout, chunks, p.dtype, p.est, p.rails, p.dist_optimizer, expert_param_share(p.args))}


DATA_PARALLEL = DataParallel()
