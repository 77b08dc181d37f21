"""What a run-config field is on the command line, and the rules every group of run-config fields parses by.

A field is a flag of every command that takes the run options (train, verify, doctor, launch), named after it, its
description the --help text (cli_options.py builds them); these markers, as its json_schema_extra, say otherwise.
The groups (config.py, training_options.py, ...) share one pydantic ConfigDict so TOML keys parse alike in each.
"""

from __future__ import annotations

from pydantic import ConfigDict

CONFIG_ONLY = {"cli": "config only"}  # a config-file key, no flag
TRAIN_ONLY = {"cli": "train only"}  # a flag of `train` alone
# strict: a TOML `seq_len = "16"` or `compile = "off"` is an error, not silently coerced (ints are still accepted
# where a float is wanted); no inf/nan anywhere
RUN_FIELDS_CONFIG = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)
