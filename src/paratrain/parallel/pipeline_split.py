"""Pipeline layout: cost-balanced stage split, stage -> rank placement, carving stage modules, and the
checks that reject a bad layout before any process starts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.errors import UserError

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "zero-bubble")  # any number of stages per rank


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: which layers it runs and whether it owns the embedding or norm+head+loss."""

    index: int
    layers: tuple[str, ...]
    first: bool
    last: bool
    cost: float  # training FLOPs per token, the quantity the split balances


def layer_costs(model: nn.Module, seq_len: int) -> tuple[list[float], float, float]:
    """(per-layer cost, embedding cost, norm+head+loss cost) in training FLOPs per token.

    Matmuls cost 6 FLOPs per parameter per token (forward + backward); attention adds 12*dim*seq_len per
    layer. The embedding is a lookup (its backward a scatter-add), so it costs ~dim, not ~vocab*dim.
    """
    dim = model.args.dim
    costs = [6.0 * sum(p.numel() for p in layer.parameters()) + 12.0 * dim * seq_len
             for layer in model.layers.values()]
    embed = 4.0 * dim
    head = 6.0 * sum(p.numel() for m in (model.norm, model.output) for p in m.parameters())
    head += 10.0 * model.args.vocab_size  # softmax + cross-entropy, forward and backward
    return costs, embed, head


def split_into_stages(model: nn.Module, pp: int, virtual_stages: int = 1, seq_len: int | None = None) -> list[StageSpec]:
    """Cut the layers into pp * virtual_stages contiguous stages minimising the most expensive stage.

    The embedding always sits on the first stage and norm + head + loss on the last; their cost counts
    toward those stages, so the ends get fewer layers when the head is heavy. Each stage gets >= 1 layer.
    """
    n_stages = pp * virtual_stages
    names = list(model.layers.keys())
    if n_stages > len(names):
        raise UserError(f"{n_stages} pipeline stages (pp={pp} x {virtual_stages} per rank) but the model has only "
                        f"{len(names)} layers")
    costs, embed, head = layer_costs(model, seq_len or model.args.max_seq_len)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, lo: int, hi: int) -> float:
        extra = (embed if s == 0 else 0.0) + (head if s == n_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    n = len(names)
    inf = float("inf")
    # best[s][i]: the smallest achievable max-stage cost putting layers [0, i) into stages 0..s
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for i in range(1, n + 1):
        best[0][i] = stage_cost(0, 0, i)
    for s in range(1, n_stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                value = max(best[s - 1][j], stage_cost(s, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, hi = [], n
    for s in range(n_stages - 1, 0, -1):
        lo = cut[s][hi]
        bounds.append((lo, hi))
        hi = lo
    bounds.append((0, hi))
    bounds.reverse()
    return [StageSpec(s, tuple(names[lo:hi]), s == 0, s == n_stages - 1, stage_cost(s, lo, hi))
            for s, (lo, hi) in enumerate(bounds)]


def stage_ranks(pp: int, n_stages: int, style: str = "loop") -> list[int]:
    """Pipeline rank of each stage: "loop" puts stage s on rank s % pp (interleaved 1F1B); "v" folds the
    second half back (rank r holds stages r and 2pp-1-r), which the ZBV zero-bubble schedule needs."""
    if style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    return [s % pp for s in range(n_stages)]


def carve_stage(model: nn.Module, spec: StageSpec) -> nn.Module:
    """A Transformer holding only this stage's modules, under their original names ("layers.3", ...).

    The shell is built on the meta device (free), then takes the real modules from `model`, so the
    parameters are shared with `model`, never copied. Absent parts are None, which Transformer skips.
    """
    with torch.device("meta"):
        part = type(model)(model.args)
    part.tok_embeddings = model.tok_embeddings if spec.first else None
    part.layers = nn.ModuleDict({name: model.layers[name] for name in spec.layers})
    part.norm = model.norm if spec.last else None
    part.output = model.output if spec.last else None
    return part


# -- layout checks (run by validate_run before any process starts, and again in every worker) -------------
def resolve_microbatches(strategy: str, microbatches: int | None, micro_batch: int | None, local_batch: int,
                         pp: int) -> int:
    """Pipeline micro-batches per step for one data-parallel rank.

    --microbatches M cuts the rank's batch (global batch / dp) into M pipeline micro-batches. --micro-batch B
    gives the same thing by size: M = local batch / B. Given both, they must agree. Neither: M = pp, the
    fewest that keeps every stage busy in steady state. The "model" strategy is always one micro-batch.
    """
    if strategy == "model":
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


def check_pipeline_layout(strategy: str, schedule: str, pp: int, virtual_stages: int, n_layers: int,
                          global_batch: int, dp: int, microbatches: int | None, micro_batch: int | None,
                          cp: int = 1, dtype: str = "fp32") -> int:
    """Raise UserError naming the first problem with a pipeline layout; return the micro-batch count."""
    n_stages = pp * virtual_stages
    if n_stages > n_layers:
        raise UserError(f"pp={pp} x {virtual_stages} stage(s) per rank = {n_stages} stages but the model has only "
                        f"{n_layers} layers")
    schedule = "gpipe" if strategy == "model" else schedule
    if schedule in SINGLE_STAGE_SCHEDULES and virtual_stages != 1:
        raise UserError(f"--pp-schedule {schedule} runs one stage per rank; --virtual-stages {virtual_stages} needs "
                        f"interleaved-1f1b or zero-bubble")
    if schedule == "interleaved-1f1b" and virtual_stages < 2:
        raise UserError("--pp-schedule interleaved-1f1b needs --virtual-stages 2 or more (stages per rank)")
    if cp > 1:
        raise UserError(f"pipeline parallelism (pp={pp}) does not combine with context parallelism (cp={cp}) in "
                        "this build; use tp or dp with pp")
    if dtype == "fp16":
        # GradScaler's skip-step decision is per rank: stages would disagree on whether to step
        raise UserError("--dtype fp16 with pipeline parallelism is not supported (the loss scaler lives on the last "
                        "stage only); use --dtype bf16")
    if schedule == "zero-bubble" and dp > 1:
        # its weight-gradient pass writes .grad directly, so DDP's and FSDP's gradient hooks never fire
        raise UserError(f"--pp-schedule zero-bubble cannot be combined with data parallelism (dp={dp}): its "
                        "deferred weight gradients bypass DDP/FSDP; use 1f1b or interleaved-1f1b")
    if global_batch % dp:
        raise UserError(f"global batch {global_batch} is not divisible by the data-parallel degree {dp}")
    local = global_batch // dp
    m = resolve_microbatches(strategy, microbatches, micro_batch, local, pp)
    if local % m:
        raise UserError(f"per-rank batch {local} (global batch {global_batch} / dp {dp}) is not divisible by "
                        f"{m} pipeline micro-batches")
    if schedule == "1f1b" and m < pp:
        raise UserError(f"--pp-schedule 1f1b needs at least as many micro-batches as stages: {m} < pp={pp}")
    if schedule in MULTI_STAGE_SCHEDULES:
        rounds = max(1, m // pp)
        if m % rounds:
            raise UserError(f"--pp-schedule {schedule} needs the micro-batch count ({m}) to be a multiple of "
                            f"{rounds} (micro-batches // pp); try {rounds * pp}")
    return m
