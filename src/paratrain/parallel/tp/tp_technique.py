"""Tensor parallelism (--tp) as the registry holds it: its check, its apply and its step-time adjustment."""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.parallel.technique import Technique
from paratrain.parallel.tp.tp_cost import async_tp_exposed


def check_tp_divides(args, tp: int) -> None:
    """The model names the sizes tensor parallelism splits (ModelArgs.check_tp_divides) and checks them."""
    if tp > 1:
        args.check_tp_divides(tp)


def check_tp_speed(speed, tp: int) -> None:
    """The model's speed options (models/speed.py) that tensor parallelism cannot split yet."""
    if tp > 1:
        speed.refuse_head_split(tp)


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

    search_order = 1

    def search_options(self, degrees: dict[str, int], fixed: dict, dims: tuple) -> list[dict]:
        # SP moves the same bytes as TP's all-reduces (all-gather + reduce-scatter) and shards the activations
        # between blocks, so it is searched on; --no-sp / --strategy tp asks for plain TP. A technique that runs
        # without SP (--ep: parallel/ep/expert_parallel.py check_ep) makes the layout's TP plain
        if degrees["tp"] == 1:
            return [{"sp": False}]
        if fixed.get("sp") is not None:
            return [{"sp": fixed["sp"]}]
        return [{"sp": all(d.technique.allows_sp(degrees.get(d.name, 1)) for d in dims)}]

    def frugal_options(self, degrees: dict[str, int]) -> dict:
        return {"sp": degrees["tp"] > 1}

    def reasons(self, r) -> list[str]:
        lay, gpu = r.layout, r.gpu
        if not self.enabled(lay):
            return []
        where = lay.placement("tp", gpu.gpus_per_node)
        out = [f"TP={lay.tp} kept inside a node: intra-node {gpu.intra_node_gbs:g} GB/s vs inter-node "
               f"{gpu.inter_node_gbs:g} GB/s" if where == "intra" else
               f"TP={lay.tp} crosses nodes at {gpu.inter_node_gbs:g} GB/s"]
        if lay.sp:
            out.append("sequence parallel keeps norms and the residual stream sharded between blocks")
        if lay.sp and lay.compile and r.async_tp:
            out.append("priced with async TP (--async-tp: each collective split under the partial matmuls); "
                       "paratrain's runtime does not run async TP")
        return out

    inference_role = "heads"

    def inference_problem(self, args, degree: int) -> str | None:
        try:
            check_tp_divides(args, degree)
        except UserError as exc:
            return str(exc)
        return None

    def inference_comm_s(self, args, degree: int, rows: int, act_bytes: int, link: tuple[float, float]) -> float:
        """Two ring all-reduces per layer (the attention's and the MLP's outputs) and the vocab shards' gather of
        the fp32 logits."""
        bw, hop = link
        reduce = 2 * (degree - 1) / degree * rows * args.dim * act_bytes / bw + 2 * (degree - 1) * hop
        gather = (degree - 1) / degree * rows * args.vocab_size * 4 / bw + (degree - 1) * hop
        return 2 * args.n_layers * reduce + gather

    def adjust_chunk(self, p, chunk) -> None:
        # async TP (torch's micro-pipelined TP) needs compile and SP
        if p.async_tp and p.layout.compile and p.layout.sp and self.enabled(p.layout):
            chunk.tp_exposed = async_tp_exposed(chunk, p.layout, p.profile.overlap)


TENSOR_PARALLEL = TensorParallel()
