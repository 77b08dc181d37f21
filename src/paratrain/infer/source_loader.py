"""A model to run inference with, from a SOURCE, under any layout.

SOURCE is a checkpoint step directory (`.../step-N`), a checkpoint directory (its newest complete step), or
`hf:DIR` (a transformers model directory and its weights). A checkpoint is read into the requested layout through
DCP, whatever layout saved it (train/recovery/checkpoint.py reshards), into a Trainer built for that layout: the
same model, parallelization and loss path as training, so evaluation and generation run the training code.

The interface (eval and generate build on it):

    resolve_source(source, overrides) -> TrainConfig
        In the CLI process, before any rank starts: the checkpoint's model (its manifest's model_source: a preset
        with its shape, or hf:; a LoRA run's adapters, from its manifest's lora record) with the user's flags
        (layout, seq_len, dtype, data). Given no layout flag (no
        --strategy, --nproc or degree, no --config), a checkpoint's layout is the one it was saved under. A
        missing, incomplete or corrupt checkpoint, or a --model (or shape) that contradicts it: UserError, one
        line, exit 2.
    load_for_inference(cfg, runtime, layout=None) -> Loaded
        In each rank: the Trainer for `layout` (default: cfg's for this world), its parameters read from the
        checkpoint (cfg.resume) when there is one, else hf:DIR's own safetensors (cfg.model); the model parts in
        eval mode. The optimizer state is not read.
    run_ranks(cfg, work, *args) -> {rank: work's return value}
        Runs work(loaded, *args) on every rank of cfg's layout (train/launch.py's run_workers: loopback
        rendezvous, cfg.timeout_s for every collective); `work` is a module-level function (it is pickled by
        name); rank 0's value is what a command reports.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path

from paratrain.config import TrainConfig, load_config
from paratrain.errors import UserError, flag_of
from paratrain.models.hf_files import hf_location, is_hf_model
from paratrain.models.presets import get_preset, model_args_for
from paratrain.train.recovery import checkpoint as ckpt

HF_PREFIX = "hf:"
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "ffn_dim")  # a preset's shape overrides (presets.model_args_for)
# what the CLI process fixes for every rank: a source is read, never trained or saved into
FIXED = {"ckpt_every": 0, "ckpt_dir": None, "preempt_signal": None, "monitor": False}
MAX_WORLD = 1 << 16  # a manifest's world size beyond this is not from a real run (it comes from disk)


@dataclass
class Loaded:
    cfg: TrainConfig
    trainer: object  # paratrain.train.trainer.Trainer
    model_parts: list  # trainer.step_runner.model_parts: one module, or this rank's pipeline stages
    layout: object  # paratrain.parallel.layout.Layout (with its mesh when distributed)
    args: object  # paratrain.models.args.ModelArgs, or None
    step: int | None  # the checkpoint's step; None for hf:DIR


def resolve_source(source: str, overrides: dict) -> TrainConfig:
    """The run config for `source` with the user's `overrides` (a command's options by config field name, None where
    not given; "config": a TOML file). Raises UserError for anything wrong with the source or the flags."""
    given = {k: v for k, v in overrides.items() if v is not None and k != "config"}
    for flag in ("resume", "init_from"):
        if flag in given:
            raise UserError(f"--{flag.replace('_', '-')} does not apply here: SOURCE ({source}) is what is read")
    if source.startswith(HF_PREFIX):
        return _hf_source(source, given, overrides.get("config"))
    return _checkpoint_source(source, given, overrides.get("config"))


def _hf_source(source: str, given: dict, config) -> TrainConfig:
    if "model" in given and given["model"] != source:
        raise UserError(f"--model {given['model']} contradicts SOURCE {source}: drop --model")
    directory = Path(source[len(HF_PREFIX):])
    if not directory.is_dir():
        raise UserError(f"SOURCE {source}: {directory} is not a directory (hf:DIR names a transformers model "
                        "directory with its config.json and weights)")
    hf_location(source)  # its config.json
    if not any(directory.glob("*.safetensors")):
        raise UserError(f"SOURCE {source}: {directory} holds no *.safetensors weights (random weights are nothing "
                        "to run)")
    # the Trainer builds hf:DIR with the directory's own weights (models/hf_model.py)
    return _load(given, config, model=source, resume="never")


def _checkpoint_source(source: str, given: dict, config) -> TrainConfig:
    step_dir = ckpt.find_checkpoint(source)
    manifest = ckpt.read_manifest(step_dir)
    model = checkpoint_model(step_dir, manifest)
    if "model" in given and given["model"] != model:
        raise UserError(f"--model {given['model']} contradicts the checkpoint {step_dir}, which holds {model}: "
                        "drop --model")
    saved = manifest.get("model") or {}
    shape = {} if is_hf_model(model) else _preset_shape(model, saved)
    for key, value in shape.items():
        if key in given and given[key] != value:
            raise UserError(f"{key} {given[key]} contradicts the checkpoint {step_dir}, which holds {key} {value}")
    layout = {} if config or any(k in given for k in layout_fields()) else trained_layout(manifest)
    adapters = trained_adapters(step_dir, manifest)
    for key, value in adapters.items():
        if key in given and given[key] != value:
            raise UserError(f"{flag_of(key)} {given[key]} contradicts the checkpoint {step_dir}, trained with "
                            f"{flag_of(key)} {value}: drop {flag_of(key)}")
    cfg = _load({**layout, **given, **shape, **adapters}, config, model=model, resume=str(step_dir))
    _check_same_model(cfg, step_dir, manifest)
    return cfg


def layout_fields() -> set[str]:
    from paratrain.parallel.dims import all_dims

    return {"strategy", "nproc", *(d.name for d in all_dims())}


def trained_layout(manifest: dict) -> dict:
    """The layout a checkpoint was saved under, as config fields: its strategy, its world size, its degrees above 1
    ({} for a manifest that does not say)."""
    strategy, world, dims = manifest.get("strategy"), manifest.get("world_size"), manifest.get("dims")
    if not isinstance(strategy, str) or not isinstance(world, int) or not 0 < world <= MAX_WORLD \
            or not isinstance(dims, dict):
        return {}
    names = layout_fields()
    degrees = {k: v for k, v in dims.items() if k in names and isinstance(v, int) and not isinstance(v, bool) and v > 1}
    return {"strategy": strategy, "nproc": world, **degrees}


def trained_adapters(step_dir: Path, manifest: dict) -> dict:
    """The LoRA adapters a checkpoint was trained with (its manifest's "lora" record), as the config fields that
    attach them again before the checkpoint is read ({} without): the model evaluated is the one trained, base and
    adapters (dropout is off in eval mode)."""
    lora = manifest.get("lora")
    if not lora:
        return {}
    targets = lora.get("targets") if isinstance(lora, dict) else None
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise UserError(f"checkpoint {step_dir}: its manifest's lora record names no target modules")
    return {"lora_r": lora.get("r"), "lora_alpha": lora.get("alpha"), "lora_targets": ",".join(targets),
            "lora_dropout": lora.get("dropout")}


def _load(given: dict, config, **source) -> TrainConfig:
    return load_config(str(config) if config else None, {**given, **FIXED, **source})


def checkpoint_model(step_dir: Path, manifest: dict) -> str:
    """The --model a checkpoint holds: its preset's name or its hf: spec (the manifest's model_source)."""
    source = manifest.get("model_source") or {}
    kind = source.get("kind", "preset")
    if kind == "hf":
        spec = source.get("spec")
        if not isinstance(spec, str) or not is_hf_model(spec):
            raise UserError(f"checkpoint {step_dir} holds a transformers model but names no hf: directory")
        return spec
    if kind == "custom":
        raise UserError(f"checkpoint {step_dir} holds a custom --script model ({source.get('name')}): export it "
                        "(paratrain export) and run it with your own code")
    if kind != "preset":
        raise UserError(f"checkpoint {step_dir} holds a model of kind {kind!r}, which this paratrain cannot load")
    name = source.get("name") or (manifest.get("model") or {}).get("name")
    if not isinstance(name, str):
        raise UserError(f"checkpoint {step_dir} names no model")
    get_preset(name)  # an unknown preset: one line
    return name


def _preset_shape(name: str, saved: dict) -> dict:
    """The config fields that rebuild the saved shape from the preset (only those that differ from it)."""
    preset = get_preset(name)
    shape = {k: saved[k] for k in SHAPE_FIELDS if k in saved and saved[k] != getattr(preset, k)}
    factor = saved.get("capacity_factor")
    if factor is not None and factor != preset.capacity_factor:
        shape["moe_capacity_factor"] = factor
    return shape


def _check_same_model(cfg: TrainConfig, step_dir: Path, manifest: dict) -> None:
    """The model these flags build is the checkpoint's, field for field (its fingerprint), else one line."""
    current = model_args_for(cfg).to_dict()
    if ckpt.model_fingerprint(current) == manifest.get("model_fingerprint"):
        return
    saved = manifest.get("model") or {}
    changed = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k) and k != "name"]
    if changed == ["max_seq_len"]:  # trained past the preset's positions: the table was made that long
        raise UserError(f"checkpoint {step_dir} was trained with --seq-len {saved['max_seq_len']}, past its preset's "
                        f"positions: give --seq-len {saved['max_seq_len']}")
    what = ", ".join(f"{k} {saved.get(k)} (flags give {current.get(k)})" for k in changed[:4]) or "its fingerprint"
    raise UserError(f"checkpoint {step_dir} holds another model than these flags build: {what}")


def load_for_inference(cfg: TrainConfig, runtime, layout=None) -> Loaded:
    """This rank's model under `layout`, read from cfg.resume's checkpoint (resharded by DCP) or, for hf:DIR, the
    directory's weights (the Trainer builds the model from them). A collective: every rank of the layout calls it."""
    from paratrain.train.trainer import Trainer

    trainer = Trainer(cfg, runtime, None, quiet=True, layout=layout)
    parts = trainer.step_runner.model_parts
    step = None
    if cfg.resume not in ("auto", "never"):
        # the model alone: no optimizer state is built or read
        state = ckpt.CheckpointState(parts, [None] * len(parts))
        manifest = ckpt.load(Path(cfg.resume), state, trainer.fingerprint, trainer.model_meta)
        step = trainer.step = manifest["step"]
    for part in parts:
        part.eval()
    return Loaded(cfg, trainer, parts, trainer.layout, trainer.args, step)


def run_ranks(cfg: TrainConfig, work, *args) -> dict:
    """work(loaded, *args) on every rank of cfg's layout; {rank: its return value}. Bad flags fail here, in one line,
    before any process starts (train/validate.py's checks, the ones train runs)."""
    from paratrain.train.launch import run_workers
    from paratrain.train.validate import validate_run, world_size_for

    world = world_size_for(cfg)
    validate_run(cfg, world)
    return run_workers(rank_main, (cfg.model_dump(), work, args), world, 0, cfg.timeout_s)


def rank_main(cfg_dict: dict, work, args: tuple):
    """One rank: join the group, load, work, leave. A UserError is raised again after the group is left, so the
    launcher reports it in one line (exit 2)."""
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    cfg = TrainConfig(**cfg_dict)
    setup_logging(int(os.environ.get("RANK", "0")))
    result, error = None, None
    try:
        loaded = load_for_inference(cfg, init_runtime(cfg.device, cfg.timeout_s))
        result = work(loaded, *args)
    except UserError as exc:
        error = str(exc)
    # the model (and its wrappers' process groups) goes before the groups are destroyed (train/worker.py says why);
    # alone, no peer's gloo thread can deadlock, and a full collection costs seconds in a process with a large heap
    loaded = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        gc.collect()
    shutdown()
    if error is not None:
        raise UserError(error)
    return result
