"""The run config's optimisation group (optimizer, learning-rate schedule, clipping, fp16 loss scale, --deepspeed):
one group of fields the run config (config.py) inherits, each a flag of train, verify, doctor and launch
(cli_options.py) unless marked a config key. No torch here: the config and the planner read them; train/optim.py
and train/lr_schedules.py apply them; interop/deepspeed_config.py maps a DeepSpeed JSON onto them.

The defaults are the behaviour before these were options: AdamW (0.9, 0.95), eps 1e-8, no weight decay, clipping
at 1.0, a linear warm-up of 5 steps then a cosine down to 0.1 x lr, torch's GradScaler defaults under fp16.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from paratrain.config_markers import CONFIG_ONLY, RUN_FIELDS_CONFIG
from paratrain.errors import UserError

OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCHEDULES = ("cosine", "linear", "constant", "warmup-log", "warmup-decay", "one-cycle")
WARMUP_TYPES = ("log", "linear")
DEFAULT_BETAS = "0.9,0.95"
DEFAULT_EPS = 1e-8
DEFAULT_MIN_LR_RATIO = 0.1


def parse_betas(text: str) -> tuple[float, float]:
    """'B1,B2' -> (B1, B2), each in [0, 1); ValueError otherwise."""
    parts = text.split(",")
    try:
        betas = tuple(float(p) for p in parts)
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"expected B1,B2 with each in [0, 1), e.g. {DEFAULT_BETAS}; got {text!r}")
    return betas


def upgrade_old_keys(data: dict) -> dict:
    """Config keys from before these were flags, still read: beta1 / beta2 become betas (a file that sets both
    forms is refused in one line). min_lr_ratio stays a key of its own (the floor as a fraction of lr)."""
    if "beta1" not in data and "beta2" not in data:
        return data
    if "betas" in data:
        raise UserError("the config sets both betas and the older beta1/beta2 keys: keep betas = \"B1,B2\" only")
    data = dict(data)
    default1, default2 = parse_betas(DEFAULT_BETAS)
    b1, b2 = data.pop("beta1", default1), data.pop("beta2", default2)
    data["betas"] = f"{b1!r},{b2!r}"
    return data


class TrainingOptionFields(BaseModel):
    model_config = RUN_FIELDS_CONFIG

    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    lr_schedule: Literal[LR_SCHEDULES] = Field("cosine", description=(
        "cosine (default) | linear | constant: linear warm-up, then down to --min-lr at --steps (or flat); "
        "warmup-log | warmup-decay | one-cycle: DeepSpeed's WarmupLR, WarmupDecayLR, OneCycle "
        "(docs/training-options.md)"))
    # None: min_lr_ratio x lr, the floor before --min-lr existed (kept as a ratio so its lr is bit-identical)
    min_lr: float | None = Field(None, ge=0, description=(
        "the schedule's low point: where cosine and linear end, where the DeepSpeed schedules start "
        "(default 0.1 x --lr)"))
    min_lr_ratio: float = Field(DEFAULT_MIN_LR_RATIO, ge=0, le=1, json_schema_extra=CONFIG_ONLY)
    warmup_steps: int = Field(5, ge=0, description="steps of learning-rate warm-up (default 5; one-cycle: the "
                                                   "rising half)")
    # DeepSpeed's schedules' own knobs (docs/training-options.md), set by --deepspeed or by hand in a config file
    warmup_type: Literal[WARMUP_TYPES] | None = Field(None, json_schema_extra=CONFIG_ONLY)
    warmup_start_ratio: float | None = Field(None, ge=0, le=1, json_schema_extra=CONFIG_ONLY)
    cooldown_steps: int | None = Field(None, ge=0, json_schema_extra=CONFIG_ONLY)
    decay_lr_rate: float = Field(0.0, ge=0, json_schema_extra=CONFIG_ONLY)
    decay_step_size: int = Field(0, ge=0, json_schema_extra=CONFIG_ONLY)
    optimizer: Literal[OPTIMIZERS] = Field("adamw", description=(
        "adamw (default) | adam (weight decay as L2 added to the gradient) | sgd (docs/training-options.md)"))
    betas: str = Field(DEFAULT_BETAS, description="adam(w): B1,B2 (default 0.9,0.95)")
    eps: float = Field(DEFAULT_EPS, gt=0, description="adam(w): the epsilon added to the denominator (default 1e-8)")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd: momentum (default 0: none)")
    weight_decay: float = Field(0.0, ge=0, description="adamw: decoupled weight decay; adam, sgd: L2 added to the "
                                                       "gradient (default 0)")
    grad_clip: float = Field(1.0, ge=0, description="clip the gradients' global L2 norm to C (default 1.0; 0: off)")
    # None: torch's GradScaler defaults (2**16, 2000)
    loss_scale_init: float | None = Field(None, gt=0, description=(
        "--dtype fp16: the dynamic loss scale to start from (default 65536)"))
    loss_scale_window: int | None = Field(None, ge=1, description=(
        "--dtype fp16: steps without an overflow before the loss scale doubles (default 2000)"))
    deepspeed: str | None = Field(None, description=(
        "a DeepSpeed JSON config: its ZeRO stage, batch sizes, precision, optimizer, scheduler and clipping "
        "become these options; flags given beside it win (docs/training-options.md)"))

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data):
        return upgrade_old_keys(data) if isinstance(data, dict) else data

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_list(cls, value):
        """A TOML list [0.9, 0.95] is the same as "0.9,0.95"."""
        if isinstance(value, list | tuple) and all(isinstance(v, int | float) and not isinstance(v, bool)
                                                   for v in value):
            return ",".join(repr(float(v)) for v in value)
        return value

    @field_validator("betas")
    @classmethod
    def _betas_pair(cls, value: str) -> str:
        parse_betas(value)
        return value

    @property
    def adam_betas(self) -> tuple[float, float]:
        return parse_betas(self.betas)

    @property
    def floor_lr(self) -> float:
        """The schedule's low point, in learning-rate units."""
        return self.min_lr if self.min_lr is not None else self.min_lr_ratio * self.lr


def optimizer_states(optimizer: str, momentum: float) -> int:
    """Tensors of optimizer state per parameter, each the parameter's size: Adam(W) keeps two moments; SGD one
    momentum buffer, or none without momentum (the planner sizes memory by it)."""
    if optimizer == "sgd":
        return 1 if momentum else 0
    return 2
