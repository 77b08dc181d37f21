"""`plan --hf-config FILE|DIR` and `plan --model hf:PATH`: read a Hugging Face config.json into ModelArgs, and count
the model transformers builds from it (inputs/hf_count.py).

The parsing is the trainer's own (models/hf_shape.py); here only the file is found and read, as data (json),
never code; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import UserError, read_json_file
from paratrain.models.args import ModelArgs
from paratrain.models.hf_shape import LLAMA_TYPES, args_from_hf_config
from paratrain.plan.inputs.hf_count import ModelCounts, transformers_counts


def read_config_doc(path: str | Path) -> dict:
    """The config document of a config.json file, a directory holding one, or `hf:PATH`."""
    from paratrain.models.hf_files import hf_location, read_hf_config

    config_path, _ = hf_location(str(path))
    doc = read_json_file(config_path, "--hf-config")
    if not isinstance(doc, dict):
        raise UserError(f"--hf-config {path} must hold a JSON object")
    if doc.get("model_type") not in ("gpt2", *LLAMA_TYPES):
        read_hf_config(str(path))  # refuses remote code and configs without a model_type
    return doc


def load_hf_config(path: str | Path) -> ModelArgs:
    """A config.json file, a directory holding one, or `hf:PATH`."""
    return args_from_hf_config(read_config_doc(path), str(path))


def load_hf_model(path: str | Path) -> tuple[ModelArgs, ModelCounts]:
    """The shape the cost model traces and the parameter counts of the model transformers builds from the config
    (inputs/hf_count.py)."""
    doc = read_config_doc(path)
    return args_from_hf_config(doc, str(path)), transformers_counts(doc, str(path))


def plans_hf_model(model: str | None) -> bool:
    """`plan --model hf:PATH` names a transformers model rather than a preset."""
    from paratrain.models.hf_files import is_hf_model

    return is_hf_model(model)
