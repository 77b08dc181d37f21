"""Typed run configuration: defaults < TOML file < CLI overrides. Prints itself as TOML.

Config files are parsed as data (tomllib); nothing in them is ever evaluated.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from paratrain.config_markers import CONFIG_ONLY, TRAIN_ONLY  # re-exported: cli_options.py reads them here
from paratrain.errors import UserError
from paratrain.lora_options import LoraFields
from paratrain.parallel.dims import all_dims
from paratrain.parallel.options import AC_MODES, CP_IMPLS, DEFAULT_PP_SCHEDULE, PP_SCHEDULES, one_of
from paratrain.parallel.semi_sync.semi_sync_options import SemiSyncFields
from paratrain.parallel.strategies import STRATEGY_TABLE
from paratrain.training_options import TrainingOptionFields, upgrade_old_keys

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
    model: str = Field("tiny", description="model preset: tiny, tiny4, small, gpt2-tiny, gpt2-124m, llama-162m, "
                       "llama3-8b, llama2-70b; or hf:PATH, a transformers model directory or config.json")
    # optional overrides of the preset's shape (None: the preset's value), e.g. to try a padded vocabulary
    vocab_size: int | None = Field(None, ge=2, description="override the preset's vocabulary (fit a tokenizer)")
    dim: int | None = Field(None, ge=2, json_schema_extra=CONFIG_ONLY)
    n_layers: int | None = Field(None, ge=1, json_schema_extra=CONFIG_ONLY)
    ffn_dim: int | None = Field(None, ge=1, json_schema_extra=CONFIG_ONLY)
    # None: the preset's (dropless); docs/moe.md
    moe_capacity_factor: float | None = Field(None, ge=0, le=64, description=(
        "MoE presets: each expert keeps at most F x seq x top-k / experts routed copies per sequence, the rest "
        "dropped (0: dropless)"))
    data: str = Field("synthetic", description="synthetic | PATH | 'A:w,B:w': token .bin, or JSON Lines / Parquet / "
                      "Arrow / text files (globs, directories) with --tokenizer (docs/data.md)")
    # document data (docs/data.md): a local tokenizer.json, the text column, packing into rows (or one per row)
    tokenizer: str | None = Field(None, description="a tokenizer.json or its directory, to tokenize documents with")
    text_field: str = Field("text", description=(
        "the records' text column (JSON Lines / Parquet / Arrow): NAME, or per source SOURCE=NAME,SOURCE=NAME "
        "(SOURCE: a file or --data entry as written, or its file name or stem); default text"))
    pack: bool = Field(True, description="pack documents into rows with document masks (default) or one document "
                       "per row")
    data_workers: int = Field(1, ge=0, le=256, description=(
        "the data loader's worker processes per rank (default 1; N > 1 tokenize documents in turn; 0: load in the "
        "training process)"))
    seq_len: int = Field(64, ge=2, description="tokens per sequence")
    global_batch: int = Field(16, ge=1, description="sequences per optimizer step, all ranks")
    # None: the rank's whole batch in one pass, no accumulation
    micro_batch: int | None = Field(None, ge=1, description="sequences per forward pass per rank")
    steps: int = Field(200, ge=1, description="optimizer steps")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed for weights and data")
    # validation (docs/data.md): a held-out file or the tail of the training file, every N steps
    val_data: str | None = Field(None, description="held-out file for validation (docs/data.md)")
    val_fraction: float = Field(0.0, ge=0, lt=0.5, description="hold out this tail fraction of --data")
    eval_every: int = Field(0, ge=0, description="validate every N steps (and after the last)")
    val_batches: int = Field(4, ge=1, description="global batches per validation (default 4)")
    init_from: str | None = Field(None, description="start from a Hugging Face directory's weights "
                                  "(docs/checkpoint.md)")

    # where and how
    strategy: str = Field("ddp", description=", ".join(STRATEGIES))
    probe: int = Field(0, ge=0, json_schema_extra=TRAIN_ONLY, description=(
        "with --strategy auto: run the planner's top K layouts a few steps each, train with the fastest measured "
        "(docs/mixed-clusters.md)"))
    nproc: int = Field(2, ge=1, description="processes (devices) on this machine")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto | cpu | cuda")
    # fp8: torchao float8 linears, GPUs with FP8 cores
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = Field("fp32", description=(
        "fp32 | bf16 | fp16 | fp8 (CUDA, compute capability 8.9+)"))
    # MFU counts against the TF32 peak when on; off: true fp32
    tf32: bool = Field(True, description="fp32 on CUDA: TF32 matmuls (default on)")
    cuda_graphs: bool = Field(False, description="one GPU: compile the whole model with CUDA graphs "
                              "(mode=reduce-overhead)")
    # fp32 logits of one chunk at a time (models/fused_loss.py; train/loss_choice.py says where it runs)
    loss_chunks: int = Field(1, ge=1, description="cross-entropy in N token chunks, fused with the output head as "
                                                  "--fused-loss (1: plain, or --fused-loss's own count)")
    fused_loss: bool = Field(False, description="the output head's linear and the cross-entropy fused over token "
                                                "chunks: no full fp32 logits, their gradient written in the forward; "
                                                "chunks: --loss-chunks N, else so one chunk's fp32 logits stay under "
                                                "256 MiB (not with --tp, --pp, fp16, hf: or --script models)")
    # speed options (models/speed.py): how the model computes, never its parameters or checkpoints
    bf16_residual: bool = Field(False, description="with --dtype bf16: keep the residual stream between blocks in "
                                                   "bf16 (the norms' statistics stay fp32; no effect otherwise)")
    fused_qkv: bool = Field(False, description="Q, K and V as one GEMM over the concatenated weights (the same "
                                               "parameters and checkpoints; not with --tp yet)")
    # parallel/compile.py: Inductor's Triton GEMM templates, autotuned, with the pointwise that follows fused in
    fused_bias_gelu: bool = Field(False, description="with --compile on CUDA: GEMMs from Inductor's autotuned "
                                  "templates write the bias and the GELU (any pointwise after a GEMM) in their "
                                  "epilogue; longer compiles (no effect on CPU or without --compile)")
    # train/optimizer_graph.py, train/param_copies.py
    optimizer_graph: bool = Field(False, description="fold the gradient clip into the fused Adam(W) step; on CUDA "
                                  "capture that step in a CUDA graph (not with fp16, zero1, --cpu-offload or "
                                  "--optimizer sgd)")
    bf16_param_copies: bool = Field(False, description="with --dtype bf16: the forward reads bf16 copies of the "
                                    "linear weights written after each optimizer step (fp32 masters stay; not with "
                                    "FSDP or tp; no effect otherwise)")
    ac: Literal[AC_MODES] = Field(AC_MODES[0], description=f"activation checkpointing: {one_of(AC_MODES)}")
    compile: bool = Field(False, description="torch.compile each block")
    memory_snapshot: bool = Field(False, description="CUDA: record memory history; dump a snapshot for "
                                  "pytorch.org/memory_viz into the run directory")
    timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S, description="collective timeout in seconds")
    # train's memory check (plan/memory_check.py); the doctor judges its run against the same budget
    mem_budget_gib: float | None = Field(None, gt=0, description=(
        "GiB one device may use (default: the GPU's memory): train stops before starting when the planner "
        "predicts more (on CPU only when given); doctor judges the measured peak against it"))
    memory_check: bool = Field(True, description="train: check the predicted peak memory first (default on)")
    max_restarts: int = Field(0, ge=0, description="elastic restarts after a failure")
    # train/recovery/replica_heal.py; needs torchft
    heal_replicas: bool = Field(False, description=(
        "ddp replicas, hsdp's replicate groups or --semi-sync islands: the others train on when one is lost; a "
        "restarted one copies a live one's state (docs/reliability.md)"))


# the degrees, one field per parallel dimension (parallel/dims.py): None means "derived from the strategy"
_WithDegrees = create_model("_WithDegrees", __base__=_RunFields,
                            **{d.name: (int | None, Field(None, ge=1, description=d.help)) for d in all_dims()})


class _WithStrategyOptions(_WithDegrees):
    # strategy options
    sp: bool = Field(False, description="sequence parallel (with tp)")
    cp_impl: Literal[CP_IMPLS] = Field(CP_IMPLS[0], description=one_of(CP_IMPLS))
    pp_schedule: Literal[PP_SCHEDULES] = Field(DEFAULT_PP_SCHEDULE, description=one_of(PP_SCHEDULES))
    microbatches: int | None = Field(None, ge=1, description="pipeline micro-batches per step")
    virtual_stages: int = Field(1, ge=1, description="pipeline stages per rank")
    ddp_comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = Field("none", description=(
        "none | bf16 | fp16 | powersgd"))
    local_sgd_period: int = Field(0, ge=0, description="average models every N steps")
    cpu_offload: bool = Field(False, description="FSDP CPU offload")
    # uneven splits for mixed clusters (docs/strategies.md); None: even
    dp_batch_split: str | None = Field(None, description="uneven data parallel: batch weights per dp rank, e.g. 3:1")
    pp_layers: str | None = Field(None, description="blocks per pipeline stage, e.g. 3:1")


# then the semi-synchronous fields (parallel/semi_sync/), the optimisation fields (training_options.py) and LoRA's
# (lora_options.py)
class TrainConfig(LoraFields, TrainingOptionFields, SemiSyncFields, _WithStrategyOptions):
    # checkpoints and output
    ckpt_dir: str | None = Field(None, description="checkpoint directory (default RUNDIR/checkpoints)")
    ckpt_every: int = Field(0, ge=0, description="save every N steps (0: never)")
    keep_ckpts: int = Field(3, ge=1, json_schema_extra=CONFIG_ONLY)
    resume: str = Field("auto", description="auto | never | PATH")
    out: str | None = Field(None, description="run directory (default runs/TIME-STRATEGY)")
    log_every: int = Field(1, ge=1, json_schema_extra=CONFIG_ONLY)
    metrics: bool = Field(True, description="write RUNDIR/metrics.jsonl")
    # train --monitor (docs/monitoring.md): Prometheus text, and HTTP on 127.0.0.1:monitor_port
    monitor: bool = Field(False, description="breakdown every N steps, alerts, Prometheus text "
                          "(docs/monitoring.md)")
    monitor_every: int = Field(10, ge=1, description="steps per monitor window (default 10)")
    monitor_windows: int = Field(3, ge=1, description="consecutive windows over a threshold before an alert "
                                 "(default 3)")
    monitor_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus text on 127.0.0.1:PORT")
    # each rank's recent collectives and phases, written under RUNDIR/hang/ when it stops; the launcher names
    # the rank that stalled or died from them (train/recovery/flight_recorder.py)
    flight_recorder: bool = Field(True, description="record each rank's recent collectives to name a stalled or "
                                  "dead rank (on by default; docs/reliability.md)")
    # train/recovery/preemption.py; a Slurm job from `launch slurm` asks for USR1 before its time limit
    preempt_signal: Literal["USR1", "USR2", "TERM", "INT", "HUP"] | None = Field(None, description=(
        "USR1 | USR2 | TERM | INT | HUP: on it, checkpoint at the next step and stop; --resume auto continues "
        "(docs/launch.md)"))

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
    """Defaults, then the TOML file (or the embedded default), then a --deepspeed JSON, then CLI overrides that
    were given."""
    # older keys (beta1/beta2) renamed first, so a flag given beside them wins as any flag does
    base = upgrade_old_keys(read_toml(path) if path else tomllib.loads(default_config_text()))
    given = {k: v for k, v in overrides.items() if v is not None}
    merged = {**base, **given}
    if isinstance(merged.get("deepspeed"), str):
        from paratrain.interop.deepspeed_config import with_deepspeed

        merged = with_deepspeed(merged["deepspeed"], base, given)
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
