"""`plan --hf-config FILE|DIR` and `plan --model hf:PATH`: read a Hugging Face config.json into ModelArgs.

The parsing is the trainer's own (models/hf_shape.py); here only the file is found and read, as data (json),
never code; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import UserError, read_json_file
from paratrain.models.args import ModelArgs
from paratrain.models.hf_shape import LLAMA_TYPES, args_from_hf_config


def load_hf_config(path: str | Path) -> ModelArgs:
    """A config.json file, a directory holding one, or `hf:PATH`."""
    from paratrain.models.hf_files import hf_location, read_hf_config

    config_path, _ = hf_location(str(path))
    doc = read_json_file(config_path, "--hf-config")
    if not isinstance(doc, dict):
        raise UserError(f"--hf-config {path} must hold a JSON object")
    if doc.get("model_type") not in ("gpt2", *LLAMA_TYPES):
        read_hf_config(str(path))  # refuses remote code and configs without a model_type
    return args_from_hf_config(doc, str(path))


def plans_hf_model(model: str | None) -> bool:
    """`plan --model hf:PATH` names a transformers model rather than a preset."""
    from paratrain.models.hf_files import is_hf_model

    return is_hf_model(model)
