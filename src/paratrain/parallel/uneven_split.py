"""Uneven splits for mixed clusters: --dp-batch-split (a batch share per data-parallel rank) and --pp-layers
(transformer blocks per pipeline stage). Parsing, the arithmetic that turns weights into per-rank batch sizes,
and the one-line refusals; the Layout carries the result, the trainer and the pipeline split act on it.

Data parallel: rank r reads global_batch * w_r / sum(w) sequences per step in M micro-batches (M is the same on
every rank, because FSDP's per-forward all-gathers must pair up). Its loss is scaled by dp * b_r / global_batch
per micro-batch (b_r its micro-batch) instead of 1 / M (parallel/loss_weighting.py's dense weight), so that after
DDP's / FSDP's average over dp ranks the gradient is the token-weighted mean over the global batch: the
single-device step.
"""

from __future__ import annotations

import math

from paratrain.errors import UserError


def parse_counts(text: str, flag: str) -> tuple[int, ...]:
    """"3:1" -> (3, 1): positive integers separated by ':'; UserError (one line) otherwise."""
    parts = str(text).strip().split(":")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise UserError(f"{flag} {text!r}: give positive integers separated by ':' (e.g. 3:1)") from None
    if any(v < 1 for v in values):
        raise UserError(f"{flag} {text!r}: every entry must be a positive integer (>= 1)")
    return values


def dp_micro_batches(split: str, global_batch: int, dp: int, microbatches: int | None) -> tuple[tuple[int, ...], int]:
    """(micro-batch size of each data-parallel rank, micro-batches per step) for --dp-batch-split.

    Raises UserError naming which --global-batch / --microbatches values would work."""
    weights = parse_counts(split, "--dp-batch-split")
    if len(weights) != dp:
        raise UserError(f"--dp-batch-split {split} has {len(weights)} entries but there are {dp} data-parallel "
                        f"ranks (dp_replicate x dp_shard); give one weight per rank")
    total = sum(weights)
    unit = total // math.gcd(*weights)  # the smallest global batch every weight divides into whole sequences
    if global_batch % unit:
        lo = global_batch // unit * unit
        near = ", ".join(str(v) for v in (lo, lo + unit) if v > 0)
        raise UserError(f"--global-batch {global_batch} does not split {split} exactly; global batches that do are "
                        f"multiples of {unit} (e.g. {near})")
    shares = tuple(global_batch * w // total for w in weights)
    count = microbatches or 1
    if any(s % count for s in shares):
        common = math.gcd(*shares)
        ok = ", ".join(str(m) for m in range(1, common + 1) if common % m == 0)
        raise UserError(f"--microbatches {count} does not divide every rank's share {':'.join(map(str, shares))} "
                        f"of the global batch; values that do: {ok}")
    return tuple(s // count for s in shares), count


def stage_layer_counts(text: str, n_stages: int, n_layers: int) -> tuple[int, ...]:
    """--pp-layers: one block count per pipeline stage (pp x virtual stages), summing to the model's layers."""
    counts = parse_counts(text, "--pp-layers")
    if len(counts) != n_stages:
        raise UserError(f"--pp-layers {text} has {len(counts)} entries but the pipeline has {n_stages} stages "
                        f"(pp x virtual stages); give one block count per stage")
    if sum(counts) != n_layers:
        raise UserError(f"--pp-layers {text} adds up to {sum(counts)} blocks but the model has {n_layers}")
    return counts


def dp_shares(layout) -> tuple[int, ...]:
    """Sequences per step of each data-parallel rank under --dp-batch-split; () when even."""
    return tuple(m * layout.microbatches for m in layout.dp_micro_batches)


def refuse_uneven_dp(layout) -> None:
    """The combinations --dp-batch-split does not run, refused in one line each."""
    if layout.pp > 1:
        raise UserError("--dp-batch-split with pp > 1 is not supported (the pipeline schedule scales each rank's "
                        "loss by its micro-batch count alone); use even data-parallel batches with a pipeline")
    if layout.tp > 1 or layout.cp > 1:
        raise UserError("--dp-batch-split runs with data parallelism alone (ddp, zero1, zero2, zero3, hsdp); "
                        f"not with tp={layout.tp} / cp={layout.cp}")
    if layout.ddp_comm_hook != "none":
        raise UserError(f"--dp-batch-split with --ddp-comm-hook {layout.ddp_comm_hook} is not supported: "
                        "the hook's compression is tested against even batches only")
    if layout.local_sgd_period:
        raise UserError("--dp-batch-split with --local-sgd-period is not supported: after its warm-up each rank "
                        "steps on its own (unevenly sized) batch, and plain parameter averaging would not weight them")
