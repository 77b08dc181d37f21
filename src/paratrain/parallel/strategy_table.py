"""The strategy names and what each one means, one row each: read through strategies.py (resolve_layout and
its small questions), and by layout.py to name the strategies that fill a dim that adds no ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    pins: str | None  # the degree set to the world size (unless given)
    absorbs: str  # the data-parallel dim that takes the ranks left over by given degrees
    zero_stage: int = 0
    sp: bool | None = None  # None: the --sp option decides
    cp_impl: str | None = None  # None: the --cp-impl option decides
    naive_pipeline: bool = False  # one micro-batch through GPipe: plain model parallelism
    one_device: bool = False  # runs on one device whatever --nproc says
    fills: str | None = None  # a dim that adds no ranks, set (unless given) to all the ranks it may subdivide


STRATEGY_TABLE: dict[str, Strategy] = {
    "single": Strategy(None, "dp_replicate", one_device=True),
    "ddp": Strategy("dp_replicate", "dp_replicate"),
    "zero1": Strategy("dp_replicate", "dp_replicate", zero_stage=1),
    "zero2": Strategy("dp_shard", "dp_shard", zero_stage=2),
    "zero3": Strategy("dp_shard", "dp_shard", zero_stage=3),
    "fsdp": Strategy("dp_shard", "dp_shard", zero_stage=3),
    "hsdp": Strategy(None, "dp_shard", zero_stage=3),
    "model": Strategy("pp", "dp_replicate", naive_pipeline=True),
    "tp": Strategy("tp", "dp_shard", sp=False),
    "tp-sp": Strategy("tp", "dp_shard", sp=True),
    "pp": Strategy("pp", "dp_replicate"),
    "cp-ring": Strategy("cp", "dp_shard", cp_impl="ring"),
    "cp-ulysses": Strategy("cp", "dp_shard", cp_impl="ulysses"),
    "ep": Strategy("dp_shard", "dp_shard", zero_stage=3, fills="ep"),
}
