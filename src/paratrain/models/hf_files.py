"""`--model hf:PATH`: find and read a Hugging Face config.json (plain Python: the planner reads shapes from it
without importing torch or transformers; hf_model.py builds the model), and read a value from a transformers
config object (config_value: one per layer in heterogeneous configs)."""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import UserError, read_json_file

HF_PREFIX = "hf:"


def is_hf_model(name: str | None) -> bool:
    return bool(name) and name.startswith(HF_PREFIX)


def hf_location(spec: str) -> tuple[Path, Path | None]:
    """(config.json path, directory holding weights or None) of `hf:PATH`."""
    path = Path(spec[len(HF_PREFIX):] if is_hf_model(spec) else spec)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise UserError(f"--model {spec}: {path} holds no config.json")
        return config, path
    if path.is_file():
        return path, None
    raise UserError(f"--model {spec}: no such directory or config.json: {path}")


def read_hf_config(spec: str) -> dict:
    config_path, _ = hf_location(spec)
    doc = read_json_file(config_path, "--model hf:")
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise UserError(f"{config_path}: a Hugging Face config.json must be a JSON object naming its model_type")
    if doc.get("auto_map"):
        raise UserError(f"{config_path}: the config asks for remote code (auto_map); paratrain never runs it")
    return doc


def config_value(config, key: str, default=None):
    """A config attribute; where the config varies it per layer (transformers' heterogeneous configs refuse a global
    read), the largest layer's value: what sizes and divisibility checks must hold for."""
    try:
        value = getattr(config, key, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        values = [v for layer in config.per_layer_config if (v := getattr(layer, key, None)) is not None]
        value = max(values) if values else None
    return default if value is None else value
