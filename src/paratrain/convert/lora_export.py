"""`paratrain export --adapter-only` of a LoRA run (--lora-r, models/lora.py; the merged export is lora_merge.py's):
the adapters alone as PEFT saves them: `adapter_model.safetensors` (keys
`base_model.model.<module path>.lora_A.weight`, the exported model's own module paths) and `adapter_config.json`,
which `peft.PeftModel.from_pretrained(base, DIR)` loads onto the base model.

An adapter is written for PEFT only where the exported weight is the checkpoint's with its rows reordered (a
preset's q and k take HF's rotary layout: B's rows are reordered alike, A is unchanged); a weight fused with others
or transposed (GPT-2's c_attn) has no PEFT adapter of the same rank, and export --adapter-only refuses it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paratrain.convert.export_plan import write_json
from paratrain.convert.lora_merge import adapter_pairs
from paratrain.errors import UserError
from paratrain.interop.hf_format import HFTensor
from paratrain.interop.optional import require
from paratrain.train.recovery.checkpoint import find_checkpoint, read_manifest

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def row_order(spec: HFTensor, shape: tuple[int, int]) -> torch.Tensor | None:
    """The row permutation `spec` applies to its one source of `shape`, or None when it is no row permutation."""
    if len(spec.sources) != 1 or tuple(spec.shape) != tuple(shape):
        return None
    rows, cols = shape
    order = spec.build(torch.arange(rows, dtype=torch.float64)[:, None].expand(rows, cols).contiguous())[:, 0]
    order = order.round().long()
    probe = torch.randn(rows, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if sorted(order.tolist()) != list(range(rows)) or not torch.equal(spec.build(probe), probe[order]):
        return None
    return order


def export_adapter(ckpt: str | Path, out: str | Path, dtype: str = "fp32") -> dict:
    """`paratrain export --adapter-only`: the adapters as PEFT's adapter directory."""
    from paratrain.convert.hf_export import DTYPES, new_file_mode, plan_of, read_tensors

    safetensors_torch = require("safetensors.torch", "paratrain export")
    step_dir = find_checkpoint(ckpt)
    manifest = read_manifest(step_dir)
    lora = manifest.get("lora")
    if not lora:
        raise UserError(f"{step_dir} was not trained with --lora-r: it has no adapters to write (export it without "
                        "--adapter-only)")
    plan = plan_of(step_dir, manifest)
    pairs, stored = adapter_pairs(step_dir)
    loaded = read_tensors(step_dir, stored, list(stored))
    tensors, targets = {}, set()
    for spec in plan.specs:
        adapted = [s for s in spec.sources if s in pairs]
        if not adapted:
            continue
        order = row_order(spec, plan.shapes[adapted[0]][0])
        if order is None:
            raise UserError(f"{adapted[0]} is written as {spec.name}, fused with other weights or transposed: PEFT "
                            "has no adapter of the same rank for it; export the merged model (without "
                            "--adapter-only)")
        lora_a, lora_b = (loaded[f] for f in pairs[adapted[0]])
        module = spec.name[:-len(".weight")]
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = lora_a.to(DTYPES[dtype]).contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = lora_b[order].to(DTYPES[dtype]).contiguous()
        targets.add(module.rsplit(".", 1)[-1])
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        safetensors_torch.save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
        os.chmod(out / ADAPTER_FILE, new_file_mode())  # as the other exported files
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    write_json(out / ADAPTER_CONFIG, peft_config(lora, sorted(targets), base_model_of(manifest)))
    return {"checkpoint": str(step_dir), "step": manifest["step"], "out": str(out), "kind": "lora-adapter",
            "architecture": plan.architecture, "shards": 1, "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "dtype": dtype,
            "files": [ADAPTER_FILE, ADAPTER_CONFIG]}


def peft_config(lora: dict, targets: list[str], base: str | None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": int(lora["r"]),
            "lora_alpha": float(lora["alpha"]), "lora_dropout": float(lora["dropout"]), "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False}


def base_model_of(manifest: dict) -> str | None:
    """The base a PEFT user loads: an hf: run's source directory; None for a preset (its base is the run's
    --init-from, or the seed's weights: docs/lora.md)."""
    source = manifest.get("model_source") or {}
    spec = str(source.get("spec") or "")
    return spec[len("hf:"):] if source.get("kind") == "hf" and spec.startswith("hf:") else None
