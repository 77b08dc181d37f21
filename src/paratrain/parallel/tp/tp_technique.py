"""Tensor parallelism (--tp) as the registry holds it: its check, its apply and its step-time adjustment."""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.parallel.technique import Technique
from paratrain.parallel.tp.tp_cost import async_tp_exposed


def check_tp_divides(args, tp: int) -> None:
    """The model names the sizes tensor parallelism splits (ModelArgs.check_tp_divides) and checks them."""
    if tp > 1:
        args.check_tp_divides(tp)


def check_tp_with_dp(layout) -> None:
    """TP composes with FSDP (2-D) but not with DDP: DDP broadcasts and buckets plain tensors, not DTensors."""
    if layout.tp > 1 and layout.ddp:
        other = f"dp_replicate={layout.dp_replicate}" if layout.dp_replicate > 1 else f"cp={layout.cp}"
        raise UserError(f"tp={layout.tp} with {other} would need DDP over tensor-parallel (DTensor) parameters, "
                        "which PyTorch does not support: shard the data-parallel ranks instead (--dp-shard, FSDP)")


class TensorParallel(Technique):
    apply_order = 10
    family, family_rank = "tensor-parallel", 30

    def enabled(self, layout) -> bool:
        return layout.tp > 1

    def check(self, args, layout, seq_len: int | None = None) -> None:
        """tp > 1: the model splits that many ways, and the data-parallel wrapper takes DTensor parameters."""
        check_tp_divides(args, layout.tp)
        check_tp_with_dp(layout)

    def apply(self, model, layout, tp_plan: dict | None = None):
        if not self.enabled(layout):
            return model
        from paratrain.parallel.tp.tensor_parallel import apply_tp

        return apply_tp(model, layout.submesh("tp"), sp=layout.sp, plan=tp_plan)

    def adjust_chunk(self, p, chunk) -> None:
        # async TP (torch's micro-pipelined TP) needs compile and SP
        if p.async_tp and p.layout.compile and p.layout.sp and self.enabled(p.layout):
            chunk.tp_exposed = async_tp_exposed(chunk, p.layout, p.profile.overlap)


TENSOR_PARALLEL = TensorParallel()
