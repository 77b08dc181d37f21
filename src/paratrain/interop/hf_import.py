"""Read a Hugging Face directory (config.json + safetensors) into a paratrain model: `--init-from DIR`.

Checks come first and read only headers: config.json must describe the same model, and every tensor must
be present with its shape; otherwise one line names the file and the tensor. Loading goes into the full
model on CPU before parallelize() shards it, so it works for every strategy. safetensors memory-maps the
files, so a rank reads only the bytes of the tensors it copies.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.interop.hf_format import hf_tensors, model_shape, model_shape_from_config
from paratrain.interop.optional import require
from paratrain.models.llama import ModelArgs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} not found (--init-from needs a Hugging Face directory)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path} is not readable JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is not a JSON object")
    return doc


def weight_files(directory: Path) -> dict[str, Path]:
    """{tensor name: file} from the index, or from the header of the one model.safetensors."""
    if not directory.is_dir():
        raise UserError(f"--init-from {directory}: not a directory")
    if (directory / INDEX).is_file():
        index = _read_json(directory / INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{directory / INDEX} has no weight_map")
        return {str(k): directory / str(v) for k, v in weight_map.items()}
    if (directory / SINGLE).is_file():
        return dict.fromkeys(_header(directory / SINGLE), directory / SINGLE)
    raise UserError(f"{directory} holds neither {SINGLE} nor {INDEX}")


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a safetensors file, from its header only."""
    safetensors = require("safetensors", "--init-from")
    if not path.is_file():
        raise UserError(f"{path}: file not found (named by {INDEX})")
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: a bad file
        raise UserError(f"{path} is not a readable safetensors file: {str(exc).splitlines()[0][:200]}") from None


def check_hf_dir(directory: str | Path, args: ModelArgs) -> dict[str, Path]:
    """Raise UserError naming the first mismatch between the directory and `args`; return {name: file}."""
    directory = Path(directory)
    files = weight_files(directory)
    config = _read_json(directory / "config.json")
    try:
        theirs = model_shape_from_config(config)
    except KeyError as exc:
        raise UserError(f"{directory / 'config.json'} lacks {exc.args[0]!r}") from None
    except UserError as exc:
        raise UserError(f"{directory / 'config.json'}: {exc}") from None
    ours = model_shape(args)
    for key, value in ours.items():
        if key in theirs and theirs[key] != value:
            raise UserError(f"{directory / 'config.json'} has {key} {theirs[key]}, but model {args.name} has {value}; "
                            f"pick the matching --model (or shape overrides)")
    headers: dict[Path, dict] = {}
    for spec in hf_tensors(args):
        path = files.get(spec.name)
        if path is None:
            where = directory / (INDEX if (directory / INDEX).is_file() else SINGLE)
            raise UserError(f"{where}: tensor {spec.name} is missing")
        if path not in headers:
            headers[path] = _header(path)
        shape = headers[path].get(spec.name)
        if shape is None:
            raise UserError(f"{path}: tensor {spec.name} is missing")
        if shape != spec.shape:
            raise UserError(f"{path}: tensor {spec.name} has shape {list(shape)}, expected {list(spec.shape)} "
                            f"for model {args.name}")
    return files


def load_hf_weights(model: nn.Module, directory: str | Path, args: ModelArgs) -> int:
    """Copy the directory's weights into `model` (a full, unsharded paratrain model); returns tensors read."""
    safetensors = require("safetensors", "--init-from")
    files = check_hf_dir(directory, args)
    params = model.state_dict()
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            for spec in hf_tensors(args):
                path = files[spec.name]
                if path not in handles:
                    handles[path] = safetensors.safe_open(str(path), framework="pt")
                    handles[path].__enter__()
                parts = spec.split(handles[path].get_tensor(spec.name))
                for fqn, value in zip(spec.sources, parts):
                    params[fqn].copy_(value.to(params[fqn].dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return len(hf_tensors(args))
