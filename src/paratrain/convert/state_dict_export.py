"""`paratrain export` of a user's own nn.Module (train --script / paratrain.api): a plain safetensors state dict.

The names are the module's own `state_dict()` names (every strategy saves them unwrapped: no FSDP, DDP or
compile prefixes), so `model.load_state_dict(safetensors.torch.load_file(...))` fills a fresh model built by the
same factory, strictly. No config.json: paratrain does not know how to build the model; its factory does.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.convert.export_plan import ExportPlan, checkpoint_tensors
from paratrain.errors import UserError
from paratrain.interop.hf_format import renamed


def state_dict_plan(step_dir: Path, manifest: dict) -> ExportPlan:
    shapes = checkpoint_tensors(step_dir)
    if not shapes:
        raise UserError(f"{step_dir}: the checkpoint holds no model tensors to export")
    name = (manifest.get("model_source") or {}).get("name") or (manifest.get("model") or {}).get("custom") or "custom"
    specs = [renamed(fqn, fqn, shape) for fqn, (shape, _) in shapes.items()]
    return ExportPlan("custom", str(name), specs, shapes)
