"""`paratrain export` of a LoRA run (--lora-r, models/lora.py): each adapted weight merged, W + (alpha / r) B A
(in fp32), into the ordinary model its writer produces (hf_export.py). lora_export.py writes the adapters alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from paratrain.convert.export_plan import ExportPlan, checkpoint_tensors
from paratrain.errors import UserError
from paratrain.interop.hf_format import HFTensor
from paratrain.models.lora import merged_weight


def adapter_pairs(step_dir: Path) -> tuple[dict[str, tuple[str, str]], dict]:
    """({adapted weight FQN: (its A's FQN, its B's FQN)}, {adapter FQN: (shape, dtype)}) of the checkpoint."""
    stored = checkpoint_tensors(step_dir, adapters=True)
    pairs = {}
    for fqn in stored:
        if fqn.endswith(".lora_A.weight"):
            module = fqn[:-len(".lora_A.weight")]
            pairs[f"{module}.weight"] = (fqn, f"{module}.lora_B.weight")
    if not pairs or any(b not in stored for _, b in pairs.values()):
        raise UserError(f"{step_dir}: its manifest says LoRA, but the checkpoint holds no complete adapters "
                        "(lora_A and lora_B of each adapted linear)")
    return pairs, stored


def with_merged_adapters(plan: ExportPlan, step_dir: Path, lora: dict) -> ExportPlan:
    """`plan` whose tensors built from an adapted weight read that weight merged with its adapters."""
    pairs, stored = adapter_pairs(step_dir)
    scale = float(lora["alpha"]) / int(lora["r"])
    merged_specs, used = [], set()
    for spec in plan.specs:
        adapted = [s for s in spec.sources if s in pairs]
        if not adapted:
            merged_specs.append(spec)
            continue
        used.update(adapted)
        extra = tuple(f for s in adapted for f in pairs[s])
        merged_specs.append(replace(spec, sources=spec.sources + extra,
                                    build=_merging(spec, adapted, scale)))
    unused = sorted(set(pairs) - used)
    if unused:
        raise UserError(f"{step_dir}: the adapters of {unused[0]} belong to no tensor of the exported model")
    return replace(plan, specs=merged_specs, shapes={**plan.shapes, **stored})


def _merging(spec: HFTensor, adapted: list[str], scale: float):
    count = len(spec.sources)

    def build(*tensors):
        own, adapters = list(tensors[:count]), tensors[count:]
        for i, source in enumerate(adapted):
            at = spec.sources.index(source)
            own[at] = merged_weight(own[at], adapters[2 * i], adapters[2 * i + 1], scale)
        return spec.build(*own)

    return build
