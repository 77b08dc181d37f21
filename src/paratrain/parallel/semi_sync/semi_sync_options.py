"""The run-config fields of semi-synchronous training, one group the run config (config.py) inherits; each field a
flag of train, verify, doctor and launch (cli_options.py). No torch here: the config and the planner read them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SEMI_SYNC_METHODS = ("diloco", "streaming-diloco")
OUTER_DTYPES = ("fp32", "bf16", "int8", "int4")


class SemiSyncFields(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    semi_sync: Literal[SEMI_SYNC_METHODS] | None = Field(None, description=(
        "diloco | streaming-diloco: islands (the --dp-replicate groups, any inner layout) train on their own and "
        "meet every --sync-every steps for an outer Nesterov step on their averaged parameter change "
        "(docs/strategies.md)"))
    sync_every: int = Field(100, ge=1, description="--semi-sync: inner steps between two syncs of a parameter "
                                                   "(default 100)")
    outer_lr: float = Field(0.7, gt=0, le=10, description="--semi-sync: the outer step's learning rate (default 0.7)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="--semi-sync: the outer step's Nesterov momentum "
                                                               "(default 0.9; 0: plain SGD)")
    fragments: int = Field(1, ge=1, description="--semi-sync streaming-diloco: parameter fragments synced in turn, "
                                                "one every --sync-every / P steps (default 1)")
    fragment_delay: int = Field(0, ge=0, description="--semi-sync streaming-diloco: inner steps a fragment's outer "
                                                     "all-reduce overlaps before it is applied (default 0)")
    outer_dtype: Literal[OUTER_DTYPES] = Field("fp32", description=(
        "--semi-sync: the outer all-reduce's numbers: fp32 | bf16 | int8 | int4 (int: per-row scales)"))
