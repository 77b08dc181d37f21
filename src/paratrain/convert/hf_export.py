"""`paratrain export CKPT -o DIR`: a DCP checkpoint (any strategy, any world size) -> a Hugging Face directory.

Streaming: tensors are grouped into shards of at most `max_shard_bytes`; for each shard DCP reads only that
shard's tensors (in one process, whatever layout saved them), they are converted and written, then freed.
So memory holds one shard's worth of tensors at a time (a single tensor larger than the limit gets a shard
of its own). Nothing is unpickled: `.metadata` goes through the restricted reader of safe_dcp.py.

The manifest's `model_source` says which model the checkpoint holds, and so which writer runs: a paratrain
preset (LlamaForCausalLM / GPT2LMHeadModel, converted by interop/hf_format.py; an MoE preset as
MixtralForCausalLM, convert/moe_preset_export.py), a transformers model trained with
`--model hf:DIR` (written back in its own format: convert/hf_model_export.py), or a user's own nn.Module (a plain
safetensors state dict: convert/state_dict_export.py).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.convert.export_plan import ExportPlan, checkpoint_tensors, write_json
from paratrain.errors import UserError
from paratrain.interop.hf_format import HFTensor, hf_config, hf_tensors
from paratrain.interop.hf_import import INDEX, SINGLE
from paratrain.interop.optional import require
from paratrain.models.llama import ModelArgs
from paratrain.train.recovery.checkpoint import MANIFEST, find_checkpoint, read_manifest
from paratrain.train.recovery.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r}: expected a size like 500MB or 2GB")
    return int(float(m.group(1)) * UNITS[m.group(2) or ""])


def plan_shards(specs: list[HFTensor], itemsize: int, max_bytes: int) -> list[list[HFTensor]]:
    shards: list[list[HFTensor]] = [[]]
    size = 0
    for spec in specs:
        nbytes = itemsize * _numel(spec.shape)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_sources(step_dir: Path, specs: list[HFTensor]) -> dict:
    stored = checkpoint_tensors(step_dir)
    for spec in specs:
        for fqn in spec.sources:
            if fqn not in stored:
                raise UserError(f"{step_dir}: tensor model.{fqn} of the paratrain preset is missing from the checkpoint")
    return stored


def model_kind(step_dir: Path, manifest: dict) -> str:
    """preset | hf | custom, from the manifest's model_source (or, for an older manifest, its model entry)."""
    kind = (manifest.get("model_source") or {}).get("kind")
    if kind is None:
        model = manifest.get("model") or {}
        kind = "custom" if "custom" in model else "hf" if str(model.get("name", "")).startswith("hf:") else "preset"
    if kind not in ("preset", "hf", "custom"):
        raise UserError(f"{step_dir}/{MANIFEST} holds a model of kind {kind!r}, which this paratrain cannot export "
                        "(written by a newer version?)")
    return kind


def preset_plan(step_dir: Path, manifest: dict) -> ExportPlan:
    try:
        args = ModelArgs(**manifest["model"])
    except (KeyError, TypeError):
        raise UserError(f"{step_dir}/{MANIFEST} describes no model paratrain knows (no preset arguments, no hf: "
                        "source, no custom model): nothing says which format to write") from None
    config_of, specs = hf_config, None
    if args.moe:  # written as MixtralForCausalLM, or refused (convert/moe_preset_export.py)
        from paratrain.convert import moe_preset_export as moe

        moe.check_mixtral_exportable(args)
        config_of, specs = moe.mixtral_config, moe.mixtral_tensors(args)
    specs = specs or hf_tensors(args)

    def finish(out: Path, dtype: str) -> list[str]:
        write_json(out / "config.json", config_of(args, dtype))
        return ["config.json"]

    return ExportPlan("preset", config_of(args)["architectures"][0], specs, _check_sources(step_dir, specs), finish)


def plan_of(step_dir: Path, manifest: dict) -> ExportPlan:
    """The writer of the checkpoint's kind of model (its base model's, under LoRA)."""
    kind = model_kind(step_dir, manifest)
    if kind == "hf":
        from paratrain.convert.hf_model_export import hf_model_plan

        return hf_model_plan(step_dir, manifest)
    if kind == "custom":
        from paratrain.convert.state_dict_export import state_dict_plan

        return state_dict_plan(step_dir, manifest)
    return preset_plan(step_dir, manifest)


def read_tensors(step_dir: Path, shapes: dict[str, tuple], fqns: list[str]) -> dict[str, torch.Tensor]:
    """Just these model tensors of the checkpoint, full size, on CPU (DCP reassembles any sharding)."""
    sd = {"model": {fqn: torch.empty(shapes[fqn][0], dtype=shapes[fqn][1]) for fqn in fqns}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp.load(sd, storage_reader=SafeFileSystemReader(step_dir), planner=SafeLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - corrupt bytes or refused content
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            raise UserError(f"checkpoint {step_dir} is unreadable: {(lines or [type(exc).__name__])[-1][:200]}") from None
    return sd["model"]


def export_checkpoint(ckpt: str | Path, out: str | Path, max_shard_bytes: int = 2 * 10**9,
                      dtype: str = "fp32") -> dict:
    safetensors_torch = require("safetensors.torch", "paratrain export")
    step_dir = find_checkpoint(ckpt)
    manifest = read_manifest(step_dir)
    plan = plan_of(step_dir, manifest)
    if manifest.get("lora"):  # a LoRA run: W + (alpha / r) B A written as each adapted weight
        from paratrain.convert.lora_merge import with_merged_adapters

        plan = with_merged_adapters(plan, step_dir, manifest["lora"])
    target = DTYPES[dtype]
    shards = plan_shards(plan.specs, torch.tensor([], dtype=target).element_size(), max_shard_bytes)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in list(out.glob("model*.safetensors")) + [out / INDEX]:
            stale.unlink(missing_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        loaded = read_tensors(step_dir, plan.shapes, [fqn for spec in shard for fqn in spec.sources])
        tensors = {spec.name: _cast(spec.build(*(loaded[f] for f in spec.sources)), target) for spec in shard}
        del loaded
        try:
            safetensors_torch.save_file(tensors, str(out / name), metadata={"format": "pt"})
            os.chmod(out / name, new_file_mode())
        except OSError as exc:
            raise UserError(f"cannot write {out / name}: {exc.strerror or exc}") from None
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if len(shards) > 1:
        write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    files = plan.finish(out, dtype)
    return {"checkpoint": str(step_dir), "step": manifest["step"], "out": str(out), "kind": plan.kind,
            "architecture": plan.architecture, "shards": len(shards), "tensors": len(weight_map),
            "bytes": total, "dtype": dtype, "files": files}


def new_file_mode() -> int:
    """What open() gives a new file under the user's umask: safetensors writes its file 0600 (a private temporary
    file, renamed), unlike every other file of the export."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _cast(tensor: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """--dtype applies to floating-point tensors; integer buffers (a custom model's counters) keep theirs."""
    return (tensor.to(target) if tensor.is_floating_point() else tensor).contiguous()
