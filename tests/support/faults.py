"""Planted bugs, attached through paratrain's hooks: each makes the parallel run compute something known to be
wrong, so tests can show that `paratrain verify` catches it and names where it is
(tests/bench/test_verify_mutations.py, tests/parallel/test_uneven.py, tests/models/test_hf_verify.py,
tests/parallel/test_tied_embeddings.py).

    with planted("dp-grad-sum"):              # in-process, on this process's default registry
        verify_in_group(cfg, rt)
    PARATRAIN_PLUGINS=support.faults:plugin PARATRAIN_TEST_FAULT=dp-grad-sum paratrain verify ...
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import RowwiseParallel

from paratrain.errors import UserError
from paratrain.train.hooks import Hooks
from support.planting import FaultSet

FAULT_ENV = "PARATRAIN_TEST_FAULT"
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
    "tied-grad-not-summed": "(i) the first and last pipeline stages' copies of a tied embedding keep their own "
                            "gradients: the all-reduce that sums them is dropped",
    "semi-sync-skip-island": "(j) --semi-sync's outer all-reduce leaves island 1's outer gradient out (it sends "
                             "zeros), so the islands' mean is half island 0's",
}




def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if not part.startswith("_") and part != "module")


# (a) DDP comm hook, registered on each DDP module right after parallelize --------------------------------------
def sum_allreduce_hook(process_group, bucket):
    """All-reduce the gradient bucket without dividing by the number of ranks."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _plant_dp_grad_sum(hooks: Hooks) -> list:
    from torch.nn.parallel import DistributedDataParallel

    def after_parallelize(module, layout):
        # where paratrain registers no hook of its own (a DDP module takes one): no --ddp-comm-hook, no local SGD
        if isinstance(module, DistributedDataParallel) and layout.ddp_comm_hook == "none" \
                and not layout.local_sgd_period:
            module.register_comm_hook(module.process_group, sum_allreduce_hook)

    return [hooks.after_parallelize(after_parallelize)]


# (b) after clipping, before the optimizer step -------------------------------------------------------------------
def skip_shard_update(model_parts) -> None:
    """On rank 1, drop one parameter's gradient, so AdamW leaves that rank's shard as it was."""
    if dist.get_rank() != 1:
        return
    for part in model_parts:
        for name, param in part.named_parameters():
            if _plain_name(name) in (FSDP_SKIPPED, FSDP_SKIPPED_HF):
                param.grad = None


def _plant_fsdp_skip_update(hooks: Hooks) -> list:
    def before_optimizer_step(trainer):
        if trainer.layout.fsdp:
            skip_shard_update(trainer.step_runner.model_parts)

    return [hooks.before_optimizer_step(before_optimizer_step)]


# (c) the TP plan -------------------------------------------------------------------------------------------------
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


def _plant_tp_row_no_reduce(hooks: Hooks) -> list:
    return [hooks.tp_plan(row_parallel_without_reduce)]


# (d) context-parallel positions ------------------------------------------------------------------------------------
def local_positions(positions: torch.Tensor) -> torch.Tensor:
    return torch.arange(positions.numel(), device=positions.device)


def _plant_cp_rope_positions(hooks: Hooks) -> list:
    def prepare_batch(inputs, targets, extra, layout):
        if layout.splits_sequences and layout.submesh("cp").get_local_rank() == 1 and "positions" in extra:
            extra = {**extra, "positions": local_positions(extra["positions"])}  # the tokens stay the global ones
        return inputs, targets, extra

    return [hooks.prepare_batch(prepare_batch)]


# (e) pipeline backward ---------------------------------------------------------------------------------------------
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


def _plant_pp_drop_microbatch_grad(hooks: Hooks) -> list:
    def on_pipeline_stage(stage, spec):
        if spec.last:
            drop_microbatch_grad(stage)

    return [hooks.on_pipeline_stage(on_pipeline_stage)]


# (f) ZeRO-1's parameter broadcast, dropped at the collective ---------------------------------------------------------
def _plant_zero1_no_broadcast(hooks: Hooks) -> list:
    def on_collective(call, proceed):
        if call.purpose == "zero1_params" and call.src == 1:
            return None  # rank 1's updated shard stays put
        return proceed()

    return [hooks.on_collective(on_collective)]


# (g) TP gradient layouts -------------------------------------------------------------------------------------------
def keep_partial_grad(param: DTensor):
    """A gradient hook: the incoming Partial gradient labelled Replicate without the all-reduce (each rank keeps
    its own partial sum), where it starts the parameter's accumulation."""
    def relabel(grad):
        if param.grad is None and isinstance(grad, DTensor) and grad.placements != param.placements:
            return DTensor.from_local(grad.to_local(), param.device_mesh, param.placements, run_check=False)
        return grad

    return relabel


def _plant_sp_norm_grad_no_reduce(hooks: Hooks) -> list:
    def after_parallelize(module, layout):
        if layout.fsdp:  # FSDP2 replaces the TP parameters and settles their gradients itself
            return
        for name, param in module.named_parameters():
            if isinstance(param, DTensor) and param.requires_grad and name.endswith("norm.weight"):
                param.register_hook(keep_partial_grad(param))

    return [hooks.after_parallelize(after_parallelize)]


# (h) --dp-batch-split loss weights -----------------------------------------------------------------------------------
def _plant_dp_split_unweighted(hooks: Hooks) -> list:
    def loss_weight(layout, dp_rank, weight):
        return 1.0 / layout.microbatches if layout.dp_micro_batches else weight

    return [hooks.loss_weight(loss_weight)]


# (i) a tied embedding under pp: the end stages' gradient sum, dropped at the collective ----------------------------
def _plant_tied_grad_not_summed(hooks: Hooks) -> list:
    from paratrain.parallel.tied_weights import PURPOSE

    def on_collective(call, proceed):
        if call.purpose == PURPOSE:
            return None  # each copy keeps its own stage's part of the gradient
        return proceed()

    return [hooks.on_collective(on_collective)]


# (j) --semi-sync: one island's outer gradient left out of the outer all-reduce, at the collective ------------------
def _plant_semi_sync_skip_island(hooks: Hooks) -> list:
    def on_collective(call, proceed):
        # the cross-island group's rank is the island; what it sends: fp32's buffer, or the encodings' all-to-all input
        if call.purpose == "outer_sync" and call.op in ("all_reduce", "all_to_all") \
                and dist.get_rank(call.group) == 1:
            call.tensors[0 if call.op == "all_reduce" else 1].zero_()
        return proceed()

    return [hooks.on_collective(on_collective)]


PLANTERS = {
    "dp-grad-sum": _plant_dp_grad_sum,
    "fsdp-skip-update": _plant_fsdp_skip_update,
    "tp-row-no-reduce": _plant_tp_row_no_reduce,
    "cp-rope-positions": _plant_cp_rope_positions,
    "pp-drop-microbatch-grad": _plant_pp_drop_microbatch_grad,
    "zero1-no-broadcast": _plant_zero1_no_broadcast,
    "sp-norm-grad-no-reduce": _plant_sp_norm_grad_no_reduce,
    "dp-split-unweighted": _plant_dp_split_unweighted,
    "tied-grad-not-summed": _plant_tied_grad_not_summed,
    "semi-sync-skip-island": _plant_semi_sync_skip_island,
}

_FAULTS = FaultSet(PLANTERS, FAULT_ENV, "mutation", UserError)
plant, planted, plugin = _FAULTS.plant, _FAULTS.planted, _FAULTS.plugin
