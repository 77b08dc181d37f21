"""The run config's LoRA group (--lora-r, --lora-alpha, --lora-targets, --lora-dropout): one group of fields the
run config (config.py) inherits, each a flag of train, verify, doctor, plan and launch (cli_options.py). No torch
here: the config and the planner read them; models/lora.py attaches the adapters (docs/lora.md).

The defaults are no adapters: --lora-r 0 trains every parameter as before.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from paratrain.config_markers import RUN_FIELDS_CONFIG


def parse_targets(text: str) -> tuple[str, ...]:
    """'M1,M2' -> ("M1", "M2"): module names, each a plain identifier; ValueError otherwise."""
    names = tuple(part.strip() for part in text.split(","))
    if not names or not all(name.isidentifier() for name in names):
        raise ValueError(f"expected module names like wq,wv or q_proj,v_proj (comma-separated); got {text!r}")
    return names


class LoraFields(BaseModel):
    model_config = RUN_FIELDS_CONFIG

    lora_r: int = Field(0, ge=0, le=4096, description=(
        "LoRA: train rank-R adapters on the --lora-targets linears with the base frozen (default 0: no adapters, "
        "every parameter trains; docs/lora.md)"))
    # None: alpha = r, a scale of 1
    lora_alpha: float | None = Field(None, gt=0, description="LoRA: the adapters' output is scaled by A / R "
                                                             "(default R: a scale of 1)")
    # None: the model family's default (attention q and v, as PEFT's for llama)
    lora_targets: str | None = Field(None, description=(
        "LoRA: the linears to adapt, by the model's own module names, e.g. wq,wv (presets) or q_proj,v_proj "
        "(hf: models); default: attention q and v"))
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA: dropout on the adapters' input (default 0)")

    @field_validator("lora_targets")
    @classmethod
    def _target_names(cls, value):
        if value is not None:
            parse_targets(value)
        return value

    @property
    def lora_target_names(self) -> tuple[str, ...] | None:
        """--lora-targets as names, or None: the model family's default."""
        return parse_targets(self.lora_targets) if self.lora_targets else None


LORA_FIELDS = tuple(LoraFields.model_fields)  # their names, in the flags' order (plan takes them too)
