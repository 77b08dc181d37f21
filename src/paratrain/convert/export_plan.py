"""What every export writer shares: the plan one kind of model writes, the checkpoint's tensor list, an atomic
JSON write. hf_export.py streams a plan's shards; hf_model_export.py and state_dict_export.py make plans."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paratrain.errors import UserError
from paratrain.interop.hf_format import HFTensor
from paratrain.train.recovery.safe_dcp import SafeFileSystemReader


@dataclass
class ExportPlan:
    """What one kind of model writes: its tensors (HF name <- checkpoint FQNs) and the files beside them."""

    kind: str  # preset | hf | custom
    architecture: str
    specs: list[HFTensor]
    shapes: dict[str, tuple]  # checkpoint FQN -> (shape, dtype)
    finish: Callable[[Path, str], list[str]] = field(default=lambda out, dtype: [])  # -> files written besides


def checkpoint_tensors(step_dir: Path, adapters: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{model FQN: (shape, dtype)} of every model tensor the checkpoint holds (the "model." prefix dropped): the
    model's own, or (adapters=True) only LoRA's adapters (`...lora_A.weight`, `...lora_B.weight`: models/lora.py),
    which the writers merge or write apart (convert/lora_export.py)."""
    md = SafeFileSystemReader(step_dir).read_metadata().state_dict_metadata
    return {key[len("model."):]: (tuple(entry.size), entry.properties.dtype) for key, entry in md.items()
            if key.startswith("model.") and hasattr(entry, "size") and is_adapter(key) == adapters}


def is_adapter(fqn: str) -> bool:
    return fqn.endswith((".lora_A.weight", ".lora_B.weight"))


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
