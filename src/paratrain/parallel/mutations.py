"""Test-only fault switch: PARATRAIN_TEST_MUTATION=NAME plants one known bug in the parallel code, so tests can
show that `paratrain verify` catches it and names where it is (tests/bench/test_verify_mutations.py).

Each injection site is a line marked `# TEST-ONLY mutation` that asks mutation(NAME); a bug that needs a body
has it here. With the variable unset (always, outside those tests) every site is a no-op. The variable is read
in one place, mutation(), on every call, so one process group can run several mutations one after another.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import RowwiseParallel

from paratrain.errors import UserError

MUTATION_ENV = "PARATRAIN_TEST_MUTATION"
FSDP_SKIPPED = "layers.0.feed_forward.w1.weight"  # (b): the parameter whose shard rank 1 does not update
FSDP_SKIPPED_HF = "hf.model.layers.0.mlp.gate_proj.weight"  # (b) in a transformers Llama-style model
TP_FAULTY_LAYER = "1"  # (c): the block whose row-parallel w2 skips its all-reduce
MUTATIONS = {
    "dp-grad-sum": "(a) DDP sums gradients over the data-parallel ranks instead of averaging them",
    "fsdp-skip-update": f"(b) FSDP rank 1 skips the optimizer update of its shard of {FSDP_SKIPPED}",
    "tp-row-no-reduce": f"(c) row-parallel layers.{TP_FAULTY_LAYER}.feed_forward.w2 skips its output all-reduce",
    "cp-rope-positions": "(d) context-parallel rank 1 gives RoPE local instead of global positions",
    "pp-drop-microbatch-grad": "(e) the last pipeline stage drops micro-batch 0's parameter gradients",
    "zero1-no-broadcast": "(f) ZeRO-1 never broadcasts rank 1's updated parameter shard back",
    "sp-norm-grad-no-reduce": "(g) sequence-parallel norm weights keep their partial, unreduced gradients",
    "dp-split-unweighted": "(h) under --dp-batch-split every rank's loss is weighted alike, not by its tokens",
}


def mutation(name: str) -> bool:
    """True when the test-only switch names this mutation: the one place PARATRAIN_TEST_MUTATION is read."""
    value = os.environ.get(MUTATION_ENV, "")
    if value and value not in MUTATIONS:
        raise UserError(f"{MUTATION_ENV}={value!r} is not a known mutation; known: {', '.join(MUTATIONS)}")
    return value == name


def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if not part.startswith("_") and part != "module")


# (a) DDP comm hook -------------------------------------------------------------------------------------------
def sum_allreduce_hook(process_group, bucket):
    """All-reduce the gradient bucket without dividing by the number of ranks."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# (b) after clipping, before the optimizer step ----------------------------------------------------------------
def skip_shard_update(model_parts) -> None:
    """On rank 1, drop one parameter's gradient, so AdamW leaves that rank's shard as it was."""
    if dist.get_rank() != 1:
        return
    for part in model_parts:
        for name, param in part.named_parameters():
            if _plain_name(name) in (FSDP_SKIPPED, FSDP_SKIPPED_HF):
                param.grad = None


# (c) the TP plan ------------------------------------------------------------------------------------------------
class RowwiseWithoutReduce(RowwiseParallel):
    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        local = outputs.to_local()  # this rank's partial sum: the Partial -> Replicate all-reduce is missing
        return local if use_local_output else DTensor.from_local(local, device_mesh, output_layouts, run_check=False)


def row_parallel_without_reduce(model, plan: dict) -> dict:
    """Spell out the per-block entries of the plan's last row-parallel block entry (the MLP's down projection:
    "layers.*.feed_forward.w2", or a transformers model's "hf.model.layers.*.mlp.down_proj") and give block
    TP_FAULTY_LAYER the style without the all-reduce."""
    keys = [k for k, style in plan.items() if ".*." in k and isinstance(style, RowwiseParallel)]
    layers = getattr(model, "layers", None) or {}
    names = list(layers) if isinstance(layers, dict | torch.nn.ModuleDict) else [str(i) for i in range(len(layers))]
    if not keys or TP_FAULTY_LAYER not in names:
        return plan
    key = keys[-1]
    plan = dict(plan)
    style = plan.pop(key)
    for name in names:
        entry = copy.copy(style)
        if name == TP_FAULTY_LAYER:
            entry.__class__ = RowwiseWithoutReduce
        plan[key.replace(".*.", f".{name}.", 1)] = entry
    return plan


# (d) context-parallel positions --------------------------------------------------------------------------------
def local_positions(positions: torch.Tensor) -> torch.Tensor:
    return torch.arange(positions.numel(), device=positions.device)


# (e) pipeline backward -----------------------------------------------------------------------------------------
def drop_microbatch_grad(stage, microbatch: int = 0) -> None:
    """Wrap the stage's backward so one micro-batch's contribution to its parameter gradients is discarded
    (the input gradient still flows to the previous stage)."""
    backward = stage.backward_one_chunk

    def run(bwd_chunk_id, *args, **kwargs):
        if bwd_chunk_id != microbatch:
            return backward(bwd_chunk_id, *args, **kwargs)
        params = list(stage.submod.parameters())
        before = [None if p.grad is None else p.grad.detach().clone() for p in params]
        out = backward(bwd_chunk_id, *args, **kwargs)
        for p, grad in zip(params, before):
            p.grad = grad
        return out

    stage.backward_one_chunk = run


# (g) TP gradient layouts -----------------------------------------------------------------------------------------
def keep_partial_grad(param: DTensor) -> None:
    """Label the Partial gradient Replicate without the all-reduce (each rank keeps its own partial sum)."""
    if param.grad is not None and param.grad.placements != param.placements:
        param.grad = DTensor.from_local(param.grad.to_local(), param.device_mesh, param.placements, run_check=False)
