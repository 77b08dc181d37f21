"""Typed run configuration: defaults < TOML file < CLI overrides. Prints itself as TOML.

Config files are parsed as data (tomllib); nothing in them is ever evaluated.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from paratrain.errors import UserError
from paratrain.parallel.dims import all_dims
from paratrain.parallel.options import AC_MODES, CP_IMPLS, DEFAULT_PP_SCHEDULE, PP_SCHEDULES
from paratrain.parallel.strategies import STRATEGY_TABLE

STRATEGIES = (*STRATEGY_TABLE, "auto")
DEFAULT_CONFIG = "tiny-cpu.toml"
MAX_SEED = 2**32 - 1  # the data hash multiplies the seed in 64-bit arithmetic
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# characters no config string may hold: they would break a path, a shell line or a YAML/TOML line
_FORBIDDEN = {chr(c) for c in range(32)} | {"\x7f", "\x85", "\u2028", "\u2029"}
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """A TOML basic string: escapes as the TOML spec does (controls as \\uXXXX)."""
    out = []
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 32 or ord(ch) == 0x7F or ch in ("\x85", "\u2028", "\u2029"):
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def check_text(label: str, value: str) -> None:
    """UserError if `value` holds a control or line-break character (NUL, newline, U+2028, ...)."""
    bad = next((ch for ch in value if ch in _FORBIDDEN), None)
    if bad is not None:
        raise UserError(f"{label} contains the control character U+{ord(bad):04X}, which is not allowed")


class _RunFields(BaseModel):
    # strict: a TOML `seq_len = "16"` or `compile = "off"` is an error, not silently coerced (ints are still
    # accepted where a float is wanted); no inf/nan anywhere
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    # what to train
    model: str = "tiny"
    # optional overrides of the preset's shape (None: the preset's value), e.g. to try a padded vocabulary
    vocab_size: int | None = Field(None, ge=2)
    dim: int | None = Field(None, ge=2)
    n_layers: int | None = Field(None, ge=1)
    ffn_dim: int | None = Field(None, ge=1)
    # an MoE preset's capacity factor (None: the preset's, dropless): each expert keeps at most factor x S x k / E
    # routed copies of each sequence of S tokens, the rest dropped (docs/moe.md)
    moe_capacity_factor: float | None = Field(None, ge=0, le=64)
    data: str = "synthetic"
    # document data (docs/data.md): a local tokenizer.json, the text column, packing into rows (or one per row)
    tokenizer: str | None = None
    text_field: str = "text"
    pack: bool = True
    data_workers: int = Field(1, ge=0, le=256)  # the loader's worker processes per rank (0: in-process)
    seq_len: int = Field(64, ge=2)
    global_batch: int = Field(16, ge=1)
    micro_batch: int | None = Field(None, ge=1, description="per-rank micro-batch; default: no accumulation")
    steps: int = Field(200, ge=1)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    # validation (docs/data.md): a held-out file or the tail of the training file, every N steps
    val_data: str | None = None
    val_fraction: float = Field(0.0, ge=0, lt=0.5)
    eval_every: int = Field(0, ge=0)
    val_batches: int = Field(4, ge=1)
    init_from: str | None = None  # a Hugging Face directory to start from (docs/checkpoint.md)

    # where and how
    strategy: str = "ddp"
    probe: int = Field(0, ge=0)  # with strategy "auto": run the planner's top K layouts a few steps, keep the fastest
    nproc: int = Field(2, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"  # fp8: torchao float8 linears, GPUs with FP8 cores
    tf32: bool = True  # fp32 on CUDA: matmuls in TF32 (MFU against the TF32 peak); False: true fp32
    cuda_graphs: bool = False  # one GPU: the whole model compiled with CUDA graphs (mode="reduce-overhead")
    loss_chunks: int = Field(1, ge=1)  # cross-entropy over N token chunks, fp32 logits of one chunk at a time
    ac: Literal[AC_MODES] = AC_MODES[0]
    compile: bool = False
    memory_snapshot: bool = False  # CUDA: record allocator history, dump RUNDIR/memory-snapshot-rank*.pickle
    timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    # train's memory check (plan/memory_check.py): GiB one device may use (None: the GPU's memory; on CPU the
    # check runs only when this is given); memory_check = false skips it
    mem_budget_gib: float | None = Field(None, gt=0)
    memory_check: bool = True
    max_restarts: int = Field(0, ge=0)
    # ddp replicas as separate processes: the others train on when one is lost, a restarted one copies a live
    # peer's state (train/recovery/replica_heal.py, docs/reliability.md); needs torchft
    heal_replicas: bool = False


# the degrees, one field per parallel dimension (parallel/dims.py): None means "derived from the strategy"
_WithDegrees = create_model("_WithDegrees", __base__=_RunFields,
                            **{d.name: (int | None, Field(None, ge=1)) for d in all_dims()})


class TrainConfig(_WithDegrees):
    # strategy options
    sp: bool = False
    cp_impl: Literal[CP_IMPLS] = CP_IMPLS[0]
    pp_schedule: Literal[PP_SCHEDULES] = DEFAULT_PP_SCHEDULE
    microbatches: int | None = Field(None, ge=1)
    virtual_stages: int = Field(1, ge=1)
    ddp_comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    local_sgd_period: int = Field(0, ge=0)
    cpu_offload: bool = False
    # uneven splits for mixed clusters (docs/strategies.md): integer weights per data-parallel rank ("3:1"),
    # transformer blocks per pipeline stage ("3:1"); None: even
    dp_batch_split: str | None = None
    pp_layers: str | None = None

    # optimisation
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(5, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0)

    # checkpoints and output
    ckpt_dir: str | None = None
    ckpt_every: int = Field(0, ge=0)
    keep_ckpts: int = Field(3, ge=1)
    resume: str = "auto"
    out: str | None = None
    log_every: int = Field(1, ge=1)
    metrics: bool = True
    # train --monitor (docs/monitoring.md): a breakdown every monitor_every steps, an alert after
    # monitor_windows consecutive windows over a threshold, Prometheus text (and HTTP on 127.0.0.1:monitor_port)
    monitor: bool = False
    monitor_every: int = Field(10, ge=1)
    monitor_windows: int = Field(3, ge=1)
    monitor_port: int | None = Field(None, ge=0, le=65535)
    # each rank's recent collectives and phases, written under RUNDIR/hang/ when it stops; the launcher names
    # the rank that stalled or died from them (train/recovery/flight_recorder.py, docs/reliability.md)
    flight_recorder: bool = True
    # on this signal every rank checkpoints at the next step and the run stops; --resume auto continues it
    # (train/recovery/preemption.py; a Slurm job from `launch slurm` asks for USR1 before its time limit)
    preempt_signal: Literal["USR1", "USR2", "TERM", "INT", "HUP"] | None = None

    @field_validator("*")
    @classmethod
    def _printable(cls, value, info):
        if isinstance(value, str) and any(ch in _FORBIDDEN for ch in value):
            raise ValueError("contains a control or line-break character")
        return value

    @field_validator("text_field")
    @classmethod
    def _text_field_forms(cls, value):
        from paratrain.interop.text_fields import parse_text_field

        parse_text_field(value)  # NAME or SOURCE=NAME,...: its UserError is the one line, from TOML or the CLI
        return value

    def to_toml(self) -> str:
        lines = ["# paratrain train config (paratrain train --config FILE)"]
        for key, value in self.model_dump().items():
            if value is None:
                lines.append(f"# {key} = (unset)")
            elif isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, int | float):
                lines.append(f"{key} = {value!r}")
            else:
                lines.append(f"{key} = {toml_string(str(value))}")
        return "\n".join(lines) + "\n"


def format_validation_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        return f"unknown config key {where!r}"
    return f"invalid value for {where!r}: {first['msg']}"


def read_toml(path: str | Path) -> dict:
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise UserError(f"cannot read config file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    return {k.replace("-", "_"): v for k, v in data.items()}


def default_config_text() -> str:
    return resources.files("paratrain").joinpath("configs", DEFAULT_CONFIG).read_text()


def load_config(path: str | None, overrides: dict) -> TrainConfig:
    """Defaults, then the TOML file (or the embedded default), then CLI overrides that were given."""
    base = read_toml(path) if path else tomllib.loads(default_config_text())
    merged = {**base, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        cfg = TrainConfig(**merged)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc)) from None
    check_names(cfg)
    return cfg


def check_names(cfg: TrainConfig) -> None:
    from paratrain.models.hf_files import hf_location, is_hf_model
    from paratrain.models.presets import get_preset

    if cfg.strategy not in STRATEGIES:
        raise UserError(f"unknown strategy {cfg.strategy!r}; known strategies: {', '.join(STRATEGIES)}")
    if is_hf_model(cfg.model):
        hf_location(cfg.model)
    else:
        get_preset(cfg.model)
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise UserError(f"--resume path not found: {cfg.resume}")
