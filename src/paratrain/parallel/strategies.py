"""The strategy table and resolve_layout(): the only code that reads strategy names.

A strategy name is shorthand for a Layout: which degree takes the world, which data-parallel dim absorbs
ranks the user's degrees leave over, and the options it implies (ZeRO stage, SP, CP flavour, naive pipeline).
Adding a strategy is one row here (plus an apply_* if it needs a new technique, and a planner cost term).
Code elsewhere that must know something of a strategy asks a function here (runs_on_one_device, ...);
config_fields() and train_args() are the one way back from a Layout to a run config and its command line.
"""

from __future__ import annotations

import functools

from paratrain.errors import UserError, flag_of
from paratrain.parallel.layout import DEGREE_NAMES, DIM_NAMES, Layout
from paratrain.parallel.strategy_table import STRATEGY_TABLE, Strategy

__all__ = ["STRATEGY_TABLE", "Strategy"]


def strategy_named(name: str) -> Strategy:
    if name not in STRATEGY_TABLE:
        raise UserError(f"unknown strategy {name!r}; known: {', '.join(STRATEGY_TABLE)}")
    return STRATEGY_TABLE[name]


def runs_on_one_device(name: str) -> bool:
    return name in STRATEGY_TABLE and STRATEGY_TABLE[name].one_device


def world_size_of(name: str, ranks: int) -> int:
    """The ranks a run of this strategy uses when `ranks` are offered."""
    return 1 if runs_on_one_device(name) else ranks


def holds_whole_parameters(name: str) -> bool:
    """Plain data parallelism that keeps whole parameters on every rank while it computes (single, ddp, zero1,
    zero2): sharding them (fsdp) is the first memory fix."""
    row = STRATEGY_TABLE.get(name)
    return row is not None and row.pins in (None, "dp_replicate", "dp_shard") and row.zero_stage < 3


def given_degrees(cfg) -> dict[str, int | None]:
    """The degrees a run config sets (None: left to the strategy), one per dimension (dims.py)."""
    return {n: getattr(cfg, n) for n in DEGREE_NAMES}


def resolve_degrees(strategy: str, world_size: int, given: dict[str, int | None]) -> dict[str, int]:
    """Degrees for a strategy: explicit degrees win; the strategy's dim takes the rest of the world."""
    row = strategy_named(strategy)
    degrees = {n: given.get(n) for n in DIM_NAMES}
    if row.one_device and world_size != 1:
        raise UserError(f"strategy {strategy!r} runs on one device, but {world_size} processes were requested")
    if strategy == "hsdp" and degrees["dp_replicate"] is None and degrees["dp_shard"] is None:
        if world_size < 4 or world_size % 2:
            raise UserError(f"hsdp needs --dp-replicate and --dp-shard, or an even world size >= 4 (got {world_size})")
        degrees["dp_replicate"] = 2
    for n, v in degrees.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise UserError(f"degree --{n.replace('_', '-')} must be a positive integer, got {v!r}")
    fixed = 1
    for n in DIM_NAMES:
        fixed *= degrees[n] or 1
    target = row.pins if row.pins and degrees[row.pins] is None else row.absorbs
    if degrees[target] is None:
        if world_size % fixed:
            raise UserError(f"parallel degrees multiply to {fixed}, which does not divide the world size {world_size}")
        degrees[target] = world_size // fixed
    out = {n: degrees[n] or 1 for n in DIM_NAMES}
    if strategy == "hsdp" and (out["dp_replicate"] < 2 or out["dp_shard"] < 2):
        raise UserError(f"hsdp needs --dp-replicate >= 2 and --dp-shard >= 2 (got {out['dp_replicate']} x "
                        f"{out['dp_shard']}); use ddp for replication only or zero3 for sharding only")
    product = 1
    for v in out.values():
        product *= v
    if product != world_size:
        shown = " x ".join(f"{n}={v}" for n, v in out.items() if v > 1) or "all 1"
        raise UserError(f"parallel degrees multiply to {product} ({shown}) but the world size is {world_size}")
    subdividing = {n: given.get(n) or 1 for n in DEGREE_NAMES if n not in out}  # dims that add no ranks
    if row.fills and given.get(row.fills) is None:
        subdividing[row.fills] = subdivided_ranks(row.fills, out)
    return {n: out[n] if n in out else subdividing[n] for n in DEGREE_NAMES}


def subdivided_ranks(name: str, degrees: dict[str, int]) -> int:
    from paratrain.parallel.dims import dim_named

    product = 1
    for d in dim_named(name).within:
        product *= degrees[d]
    return product


def resolve_microbatches(naive: bool, microbatches: int | None, micro_batch: int | None, local_batch: int,
                         pp: int) -> int:
    """Pipeline micro-batches per step for one data-parallel rank.

    --microbatches M cuts the rank's batch (global batch / dp) into M pipeline micro-batches. --micro-batch B
    gives the same thing by size: M = local batch / B. Given both, they must agree. Neither: M = pp, the
    fewest that keeps every stage busy in steady state. Naive model parallelism is always one micro-batch.
    """
    if naive:
        if microbatches not in (None, 1):
            raise UserError(f"strategy 'model' (naive model parallel) runs one micro-batch; --microbatches "
                            f"{microbatches} needs --strategy pp")
        if micro_batch is not None and micro_batch != local_batch:
            raise UserError(f"strategy 'model' runs the rank's whole batch ({local_batch}) as one micro-batch; "
                            f"--micro-batch {micro_batch} needs --strategy pp")
        return 1
    if micro_batch is not None:
        if local_batch % micro_batch:
            raise UserError(f"per-rank batch {local_batch} is not divisible by --micro-batch {micro_batch}")
        from_size = local_batch // micro_batch
        if microbatches is not None and microbatches != from_size:
            raise UserError(f"--microbatches {microbatches} and --micro-batch {micro_batch} disagree: the per-rank "
                            f"batch {local_batch} / {micro_batch} = {from_size} micro-batches")
        return from_size
    return microbatches if microbatches is not None else pp


def zero_stage_for(row: Strategy, degrees: dict[str, int]) -> int:
    """What the data-parallel wrapper does, as a ZeRO stage: FSDP2 whenever dp_shard > 1 (ZeRO-2 only when the
    strategy asks for it, else ZeRO-3), ZeRO-1 or plain DDP over replicas, nothing on one data-parallel rank."""
    if degrees["dp_shard"] > 1:
        return 2 if row.zero_stage == 2 else 3
    if degrees["dp_replicate"] > 1:
        return 1 if row.zero_stage == 1 else 0
    return 0


def zero_stages(degrees: dict[str, int]) -> tuple[int, ...]:
    """The ZeRO stages a layout with these degrees can run with (the planner searches each): those zero_stage_for
    gives the strategy that names such a layout (Layout.strategy), so that its command runs it again."""
    return _zero_stages(tuple(degrees.items()))


@functools.lru_cache(maxsize=4096)
def _zero_stages(degrees: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    given = dict(degrees)
    return tuple(stage for stage in range(4)
                 if zero_stage_for(STRATEGY_TABLE[Layout(**given, zero_stage=stage).strategy], given) == stage)


def resolve_layout(cfg, world_size: int) -> Layout:
    """The Layout a run config runs on `world_size` ranks: what train executes and what plan, bench and
    doctor predict for. Raises UserError naming the first thing that cannot be resolved."""
    row = strategy_named(cfg.strategy)
    degrees = resolve_degrees(cfg.strategy, world_size, given_degrees(cfg))
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    uneven = uneven_fields(cfg, degrees)
    pipelined = degrees["pp"] > 1
    if uneven.get("dp_micro_batches"):  # each rank's own micro-batch; micro_batch: the largest
        micro, microbatches = max(uneven["dp_micro_batches"]), cfg.microbatches or 1
    elif cfg.global_batch % dp:
        raise UserError(f"global batch {cfg.global_batch} is not divisible by the data-parallel degree {dp}")
    elif pipelined:
        local = cfg.global_batch // dp
        microbatches = resolve_microbatches(row.naive_pipeline, cfg.microbatches, cfg.micro_batch, local,
                                            degrees["pp"])
        if local % microbatches:
            raise UserError(f"per-rank batch {local} (global batch {cfg.global_batch} / dp {dp}) is not divisible "
                            f"by {microbatches} pipeline micro-batches")
        micro = local // microbatches
    else:
        local = cfg.global_batch // dp
        micro = cfg.micro_batch or local
        if local % micro:
            raise UserError(f"per-rank batch {local} (global batch {cfg.global_batch} / dp {dp}) is not divisible "
                            f"by --micro-batch {micro}")
        microbatches = local // micro
    sp = (row.sp if row.sp is not None else cfg.sp) and degrees["tp"] > 1
    cp_impl = (row.cp_impl or cfg.cp_impl) if degrees["cp"] > 1 else "ring"
    schedule = ("gpipe" if row.naive_pipeline else cfg.pp_schedule) if pipelined else "1f1b"
    virtual = cfg.virtual_stages if pipelined else 1
    hook = cfg.ddp_comm_hook
    # torch suggests compressing after ~10% of the run; DDP rebuilds its buckets after step 1, so >= 2
    powersgd_start = max(2, cfg.warmup_steps, cfg.steps // 10) if hook == "powersgd" else 2
    return Layout(**degrees, zero_stage=zero_stage_for(row, degrees), sp=sp, cp_impl=cp_impl,
                  pp_schedule=schedule, virtual_stages=virtual, micro_batch=micro, microbatches=microbatches,
                  ac=cfg.ac, dtype=cfg.dtype, compile=cfg.compile, ddp_comm_hook=hook,
                  local_sgd_period=cfg.local_sgd_period, semi_sync=getattr(cfg, "semi_sync", None) or "",
                  cpu_offload=cfg.cpu_offload, powersgd_start=powersgd_start, **lora_fields(cfg),
                  **uneven)


def lora_fields(cfg) -> dict:
    """The Layout's LoRA fields (lora_options.py): the rank, the targets as given ((): the family's default), the
    dropout; none without --lora-r."""
    rank = getattr(cfg, "lora_r", 0)
    if not rank:
        return {}
    return {"lora_r": rank, "lora_targets": cfg.lora_target_names or (), "lora_dropout": cfg.lora_dropout}


def uneven_fields(cfg, degrees: dict[str, int]) -> dict:
    """Layout fields for --dp-batch-split (each dp rank's micro-batch) and --pp-layers (blocks per stage)."""
    from paratrain.parallel.uneven_split import dp_micro_batches

    fields: dict = {}
    split = getattr(cfg, "dp_batch_split", None)
    if split:
        if cfg.micro_batch is not None:
            raise UserError("--dp-batch-split sets each rank's micro-batch (its share / --microbatches); "
                            "give --microbatches M instead of --micro-batch")
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        fields["dp_micro_batches"], _ = dp_micro_batches(split, cfg.global_batch, dp, cfg.microbatches)
    layers = getattr(cfg, "pp_layers", None)
    if layers:
        if degrees["pp"] == 1:
            raise UserError("--pp-layers sets blocks per pipeline stage; it needs --pp > 1 (strategy pp or model)")
        from paratrain.parallel.uneven_split import parse_counts

        fields["pp_layers"] = parse_counts(layers, "--pp-layers")
    return fields


def fixed_by_strategy(name: str) -> dict:
    """The layout choices a strategy name pins, for the planner's search (`plan --strategy S`)."""
    row = strategy_named(name)
    fixed: dict = {}
    if row.pins in ("dp_replicate", "dp_shard") or name == "hsdp":
        fixed["zero_stage"] = row.zero_stage
    if row.pins == "dp_replicate":
        fixed["dp_shard"] = 1
    if row.sp is not None:
        fixed["sp"] = row.sp
    if row.cp_impl is not None:
        fixed["cp_impl"] = row.cp_impl
    if row.naive_pipeline:
        fixed.update(pp_schedule="gpipe", virtual_stages=1)
    return fixed


def config_fields(layout: Layout) -> dict:
    """The run-config fields that make resolve_layout() give back `layout` (the inverse of resolve_layout),
    for `train --strategy auto`, for plan candidates handed to train, and (train_args) their command lines.
    A degree's options (SP, CP flavour, schedule) appear only when that degree is > 1; the order of the
    fields is the order of train_args' flags."""
    fields = {"strategy": layout.strategy, "nproc": layout.world, **layout.degrees()}
    if layout.tp > 1:
        fields["sp"] = layout.sp
    if layout.cp > 1:
        fields["cp_impl"] = layout.cp_impl
    if layout.pp > 1:
        fields.update(pp_schedule=layout.pp_schedule, virtual_stages=layout.virtual_stages,
                      microbatches=layout.microbatches)
    if layout.pp_layers:
        fields["pp_layers"] = ":".join(map(str, layout.pp_layers))
    if layout.dp_micro_batches:  # the split in micro-batch units, the count as --microbatches
        fields["dp_batch_split"] = ":".join(map(str, layout.dp_micro_batches))
        fields["microbatches"] = layout.microbatches
    fields.update(micro_batch=None if layout.dp_micro_batches else layout.micro_batch, ac=layout.ac,
                  global_batch=layout.global_batch, dtype=layout.dtype, compile=layout.compile)
    return fields


def train_args(layout: Layout, seq_len: int, global_batch: int) -> list[str]:
    """`paratrain train` arguments (after the model) that run exactly this layout: config_fields() as flags."""
    fields = config_fields(layout)
    tail = {k: fields.pop(k) for k in ("dtype", "compile")}
    del fields["global_batch"]
    fields.update(seq_len=seq_len, global_batch=global_batch, **tail)
    args: list[str] = []
    for key, value in fields.items():
        flag = flag_of(key)
        if isinstance(value, bool):  # --compile only when on; --sp / --no-sp said outright beside a tp degree
            args += [flag] if value else ([f"--no-{flag[2:]}"] if key == "sp" else [])
        elif value is not None:
            args += [flag, str(value)]
    return args
