"""check_layout(): can this Layout run this model? One check for `train` (before any process starts) and for
the planner's search, so that a layout the planner offers is one the trainer accepts, and vice versa.

Each parallel dimension names its own check in the registry (dims.py: check_tp, check_pp, check_cp here);
check_layout runs those of every degree > 1, then the batch and data-parallel option checks."""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.parallel.dims import all_dims, resolve
from paratrain.parallel.layout import Layout
from paratrain.parallel.options import CP_IMPLS, MULTI_STAGE_SCHEDULES, SINGLE_STAGE_SCHEDULES
from paratrain.parallel.uneven_split import refuse_uneven_dp, stage_layer_counts


def check_layout(layout: Layout, args, seq_len: int, global_batch: int, device_type: str = "cpu") -> None:
    """Raise UserError naming the first problem. `args` is the model's ModelArgs (duck-typed)."""
    for dim in all_dims():
        if dim.check and getattr(layout, dim.name) > 1:
            resolve(dim.check)(args, layout, seq_len)
    if getattr(args, "capacity_factor", 0) > 0 and layout.cp > 1:
        raise UserError("an MoE capacity factor with --cp is not supported: capacity is counted per sequence, and "
                        "each cp rank holds part of one; train dropless (no --moe-capacity-factor) or without --cp")
    if layout.dp_micro_batches:
        check_uneven_dp(layout, global_batch)
    elif global_batch % layout.dp:
        raise UserError(f"global batch {global_batch} is not divisible by the data-parallel degree {layout.dp}")
    elif layout.micro_batch * layout.microbatches * layout.dp != global_batch:
        raise UserError(f"micro-batch {layout.micro_batch} x {layout.microbatches} x dp {layout.dp} does not make "
                        f"the global batch {global_batch}")
    check_dp_options(layout, device_type)


def check_tp(args, layout: Layout, seq_len: int | None = None) -> None:
    """tp > 1: the model splits that many ways, and the data-parallel wrapper takes DTensor parameters."""
    check_tp_divides(args, layout.tp)
    check_tp_with_dp(layout)


def check_pp(args, layout: Layout, seq_len: int | None = None) -> None:
    """pp > 1: enough layers for the stages and a schedule that runs this layout. (A tied embedding is held by
    the first and last stage, its gradients summed between them: parallel/tied_weights.py.)"""
    if args.n_layers < layout.pp * layout.virtual_stages:
        raise UserError(f"pp={layout.pp} x {layout.virtual_stages} stage(s) per rank = "
                        f"{layout.pp * layout.virtual_stages} stages but the model has only {args.n_layers} layers")
    if layout.pp_layers:
        stage_layer_counts(":".join(map(str, layout.pp_layers)), layout.pp * layout.virtual_stages, args.n_layers)
    check_pipeline(layout)


def check_uneven_dp(layout: Layout, global_batch: int) -> None:
    """--dp-batch-split: one micro-batch size per dp rank, adding up to the global batch, in a layout it runs."""
    if len(layout.dp_micro_batches) != layout.dp:
        raise UserError(f"{len(layout.dp_micro_batches)} per-rank micro-batches for {layout.dp} data-parallel ranks")
    if layout.global_batch != global_batch:
        raise UserError(f"per-rank micro-batches {':'.join(map(str, layout.dp_micro_batches))} x "
                        f"{layout.microbatches} do not make the global batch {global_batch}")
    refuse_uneven_dp(layout)


def check_tp_divides(args, tp: int) -> None:
    """The model names the sizes tensor parallelism splits (ModelArgs.check_tp_divides) and checks them."""
    if tp > 1:
        args.check_tp_divides(tp)


def check_tp_with_dp(layout: Layout) -> None:
    """TP composes with FSDP (2-D) but not with DDP: DDP broadcasts and buckets plain tensors, not DTensors."""
    if layout.tp > 1 and layout.ddp:
        other = f"dp_replicate={layout.dp_replicate}" if layout.dp_replicate > 1 else f"cp={layout.cp}"
        raise UserError(f"tp={layout.tp} with {other} would need DDP over tensor-parallel (DTensor) parameters, "
                        "which PyTorch does not support: shard the data-parallel ranks instead (--dp-shard, FSDP)")


def check_cp(args, layout: Layout, seq_len: int | None = None) -> None:
    """The model must be context-parallel as asked: sequence cut into 2*cp chunks, Ulysses splits heads."""
    if layout.cp <= 1:
        return
    if layout.cp_impl not in CP_IMPLS:
        raise UserError(f"unknown --cp-impl {layout.cp_impl!r}; choose one of {', '.join(CP_IMPLS)}")
    if seq_len is not None and seq_len % (2 * layout.cp):
        raise UserError(f"cp={layout.cp} needs the sequence length ({seq_len}) to be a multiple of 2*cp={2 * layout.cp}")
    if layout.cp_impl == "ulysses":
        from paratrain.parallel.ulysses import check_ulysses_heads

        check_ulysses_heads(args.n_heads // layout.tp, layout.cp)


def check_pipeline(layout: Layout) -> None:
    schedule, v, pp, m = layout.pp_schedule, layout.virtual_stages, layout.pp, layout.microbatches
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise UserError(f"--pp-schedule {schedule} runs one stage per rank; --virtual-stages {v} needs "
                        f"interleaved-1f1b or zero-bubble")
    if schedule == "interleaved-1f1b" and v < 2:
        raise UserError("--pp-schedule interleaved-1f1b needs --virtual-stages 2 or more (stages per rank)")
    if layout.cp > 1:
        raise UserError(f"pipeline parallelism (pp={pp}) does not combine with context parallelism (cp={layout.cp}) "
                        "in this build; use tp or dp with pp")
    if layout.dtype == "fp16":
        # GradScaler's skip-step decision is per rank: stages would disagree on whether to step
        raise UserError("--dtype fp16 with pipeline parallelism is not supported (the loss scaler lives on the last "
                        "stage only); use --dtype bf16")
    if schedule == "zero-bubble" and layout.dp > 1:
        # its weight-gradient pass writes .grad directly, so DDP's and FSDP's gradient hooks never fire
        raise UserError(f"--pp-schedule zero-bubble cannot be combined with data parallelism (dp={layout.dp}): its "
                        "deferred weight gradients bypass DDP/FSDP; use 1f1b or interleaved-1f1b")
    if schedule == "1f1b" and m < pp:
        raise UserError(f"--pp-schedule 1f1b needs at least as many micro-batches as stages: {m} < pp={pp}")
    if schedule in MULTI_STAGE_SCHEDULES:
        rounds = max(1, m // pp)
        if m % rounds:
            raise UserError(f"--pp-schedule {schedule} needs the micro-batch count ({m}) to be a multiple of "
                            f"{rounds} (micro-batches // pp); try {rounds * pp}")


def check_dp_options(layout: Layout, device_type: str) -> None:
    """Reject data-parallel option combinations that cannot run, with one line naming the fix."""
    name = layout.strategy
    if layout.cpu_offload and not layout.fsdp:
        raise UserError(f"--cpu-offload needs a sharded strategy (zero2, zero3, fsdp, hsdp); {name!r} does not "
                        "shard parameters with FSDP")
    if layout.cpu_offload and device_type != "cuda":
        raise UserError("--cpu-offload moves FSDP's parameters off the GPU, but this run has no CUDA device "
                        "(torch: 'Cannot access accelerator device when none is available')")
    hook = layout.ddp_comm_hook
    if hook != "none":
        if not layout.ddp:
            raise UserError(f"--ddp-comm-hook {hook} needs DDP with more than one replica (ddp or zero1); "
                            f"{name!r} with {layout.world} process(es) does not run DDP")
        if hook == "bf16" and device_type != "cuda":
            raise UserError("--ddp-comm-hook bf16 needs NCCL on CUDA (torch's bf16 hook refuses gloo); "
                            "use fp16 or powersgd on CPU")
    if layout.local_sgd_period:
        if layout.zero_stage != 0 or layout.dp_replicate < 2 or layout.world != layout.dp_replicate:
            raise UserError(f"--local-sgd-period needs plain ddp over >= 2 replicas (got {name!r} "
                            f"with {layout.world} process(es))")
        if hook != "none":
            raise UserError("--local-sgd-period and --ddp-comm-hook both install a DDP comm hook; pick one")
