"""Checkpoints through torch.distributed.checkpoint (DCP).

Layout: CKPT_DIR/step-N/ holds DCP's shards and `.metadata`, one `rng-rank-R.json` per rank, and
`manifest.json`, written last by rank 0. A save goes to `step-N.partial/` and is renamed only after the
manifest exists, so a crash mid-save never leaves something that looks complete. Nothing here unpickles:
non-tensor state is JSON, and DCP only reads tensors back into tensors we allocated.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from paratrain.errors import UserError
from paratrain.parallel.collective_device import collective_device
from paratrain.parallel.collective_hooks import collective

log = logging.getLogger("paratrain")
STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
MAX_STEP = 2**40  # a step or data position beyond this is not from a real run (and would overflow the sampler)


def model_fingerprint(model_args: dict) -> str:
    return hashlib.sha256(json.dumps(model_args, sort_keys=True).encode()).hexdigest()[:16]


def model_source(model: str | None, custom=None, tokenizer: str | None = None) -> dict:
    """What kind of model a checkpoint holds, so `export` picks its writer without guessing: a paratrain preset
    (its args are the manifest's "model"), a transformers model (`hf:`: the config.json's path and its content,
    so export still has the config if the directory is gone), or a user's own nn.Module (`custom`). A transformers
    model trained on documents also records the run's --tokenizer, which export ships with it."""
    from paratrain.models.hf_files import hf_location, is_hf_model, read_hf_config

    if custom is not None:
        return {"kind": "custom", "name": custom.name}
    if not is_hf_model(model):
        return {"kind": "preset", "name": model}
    source = {"kind": "hf", "spec": model}
    if tokenizer:
        source["tokenizer"] = str(Path(tokenizer).resolve())
    try:
        config_path, _ = hf_location(model)
        source.update(config_path=str(config_path.resolve()), config=read_hf_config(model))
    except UserError:  # the source moved while training: the save goes on, export says what is missing
        pass
    return source


def _rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _restore_rng(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()))
    if "cuda" in state and torch.cuda.is_available():
        raw = np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy()
        torch.cuda.set_rng_state(torch.from_numpy(raw))


class CheckpointState:
    """What a checkpoint holds: model parts and their optimizers (DCP), plus JSON-able extras."""

    def __init__(self, model_parts: list, optimizers: list, islands=None):
        """`islands`: a --semi-sync run's view of its outer loop (parallel/semi_sync/checkpoint_state.py), which
        decides what its checkpoints hold."""
        self.model_parts, self.optimizers, self.islands = model_parts, optimizers, islands

    def tensors(self, manifest: dict | None = None) -> dict:
        """The state dict DCP saves, or (given the manifest of the checkpoint being read) loads into."""
        from paratrain.parallel.semi_sync.checkpoint_state import plain_view

        model_sd, optim_sd = self._part_tensors()
        if self.islands is not None:
            return self.islands.tensors(model_sd, optim_sd, manifest)
        return plain_view(model_sd, optim_sd, manifest)

    def _part_tensors(self) -> tuple[dict, dict]:
        # Optimizer state flattened to per-parameter keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"):
        # the dicts of several model parts on one rank (pipeline stages) merge by update(), and each rank's
        # param groups are saved under its own FQNs (a nested "param_groups" list would be one value that
        # DCP writes once, from one rank, wrong for the pipeline ranks holding other parameters).
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model_sd, optim_sd = {}, {}
        for part, opt in zip(self.model_parts, self.optimizers):
            model_sd.update(get_model_state_dict(part, options=opts))
            if opt is not None:
                optim_sd.update(get_optimizer_state_dict(part, opt, options=opts))
        return model_sd, optim_sd

    def load_tensors(self, sd: dict) -> None:
        from paratrain.parallel.semi_sync.checkpoint_state import plain_parts

        model_sd, optim_sd = self.islands.load(sd) if self.islands is not None else plain_parts(sd)
        optim_sd = nest_optimizer_state(optim_sd)
        for part, opt in zip(self.model_parts, self.optimizers):
            set_model_state_dict(part, model_sd, options=StateDictOptions(strict=False))
            # no state at all (SGD without momentum) is nothing to load, and torch would take the empty state for an
            # id-keyed one and refuse the per-parameter groups; the hyperparameters come from the run's config
            if opt is not None and optim_sd["state"]:
                set_optimizer_state_dict(part, opt, optim_sd)


def nest_optimizer_state(flat: dict) -> dict:
    """The flattened optimizer keys back to torch's nested layout keyed by FQN (a superset: every part's).

    torch's own unflattening takes the state names from the live optimizer's `.state`, which a sharded
    optimizer (ZeRO-1) leaves empty; the names are in the keys, so read them from there.
    """
    state: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if kind == "state":
            state.setdefault(fqn, {})[name] = value
        elif kind == "param_groups":
            groups.setdefault(fqn, {"params": [fqn]})[name] = value
    return {"state": state, "param_groups": list(groups.values())}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        collective("checkpoint_barrier", "world", "barrier", None, dist.barrier)


def _all_ok(ok: bool) -> bool:
    """True only if every rank says ok (so no rank goes on while another failed)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=collective_device())
    collective("checkpoint_ok", "world", "all_reduce", None, lambda: dist.all_reduce(flag), (flag,))
    return int(flag.item()) == 0


def _file_sizes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_STEP * 1_000_000


def is_stream_state(state) -> bool:
    """The document stream's position (train/data/doc_stream.py StreamState) as JSON: integers only, nothing else."""
    if not isinstance(state, dict) or set(state) != {"draws", "positions", "carry", "tokens_drawn"}:
        return False
    positions, carry, drawn = state["positions"], state["carry"], state["tokens_drawn"]
    return (_count(state["draws"]) and isinstance(positions, list) and isinstance(carry, list)
            and isinstance(drawn, list) and len(drawn) == len(positions)
            and all(isinstance(p, list) and len(p) == 2 and all(map(_count, p)) for p in positions)
            and all(map(_count, carry)) and all(map(_count, drawn)))


def save(ckpt_dir: str | Path, step: int, state: CheckpointState, extra: dict, meta: dict, keep: int) -> Path:
    """Save step N collectively. On failure the previous checkpoints are untouched and UserError is raised.

    `meta["run_id"]` marks the save as this run's: pruning only ever removes this run's checkpoints."""
    root = Path(ckpt_dir)
    final, partial = root / f"step-{step}", root / f"step-{step}.partial"
    rank = _rank()
    error = None
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
    except OSError as exc:
        error = exc
    _all_ok(error is None) or _raise_save(root, error)
    try:
        dcp.save(state.tensors(), checkpoint_id=str(partial))
        (partial / f"rng-rank-{rank}.json").write_text(json.dumps(_rng_state()))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - disk full, permissions, ...: "not saved"
        error = exc  # (DCP wraps a rank's write error in CheckpointException, a BaseException)
    if not _all_ok(error is None):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        _raise_save(root, error)
    try:
        if rank == 0:
            manifest = {"format": FORMAT_VERSION, "step": step, "time": time.time(), **meta, "extra": extra,
                        "files": _file_sizes(partial)}
            tmp = partial / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, partial / MANIFEST)
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
    except OSError as exc:
        error = exc
    if not _all_ok(error is None):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        _raise_save(root, error)
    if rank == 0:
        prune(root, keep, meta.get("run_id"))
    _barrier()
    return final


def _raise_save(root: Path, error: BaseException | None) -> None:
    last = latest_complete(root, warn=False)
    kept = f"; the previous checkpoint {last} is intact" if last else ""
    reason = f": {_first_line(error)}" if error else " on another rank"
    raise UserError(f"checkpoint save failed{reason}{kept}")


def prune(root: Path, keep: int, run_id: str | None = None) -> None:
    """Keep this run's newest `keep` complete checkpoints; never touch another run's (another run_id)."""
    ours = [p for p, _ in _step_dirs(root) if check_complete(p) is None and _run_id_of(p) == run_id]
    for old in ours[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _run_id_of(path: Path) -> str | None:
    try:
        return read_manifest(path).get("run_id")
    except UserError:
        return None


def new_run_id() -> str:
    """An id for this run that every rank agrees on: torch elastic's run id (the same across ranks and
    restarts), else Slurm's job id, else a random one drawn on rank 0 and broadcast."""
    import secrets

    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var)
        if value and value != "none":
            return f"{var.split('_')[0].lower()}-{value}"
    draw = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=collective_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        collective("run_id", "world", "broadcast", None, lambda: dist.broadcast(draw, src=0), (draw,), src=0)
    return f"local-{int(draw.item()):016x}"


def refuse_foreign_newer(ckpt_dir: str | None, start_step: int, run_id: str) -> None:
    """A --ckpt-dir whose newest complete checkpoint is another run's (newer than where this run starts)
    would have this run's saves pruned, overwritten or resumed over: refuse it before training."""
    if not ckpt_dir:
        return
    for path, step in reversed(_step_dirs(Path(ckpt_dir))):
        if step <= start_step:
            return
        if check_complete(path) is None and _run_id_of(path) != run_id:
            raise UserError(f"--ckpt-dir {ckpt_dir} holds {path.name} from another run, newer than this run's "
                            f"start (step {start_step}); use a fresh --ckpt-dir, or --resume auto to continue it")


def _step_dirs(root: Path) -> list[tuple[Path, int]]:
    if not root.is_dir():
        return []
    found = [(p, int(m.group(1))) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, key=lambda item: item[1])


def read_manifest(path: Path) -> dict:
    """The manifest, checked field by field (it comes from disk: a crafted one must not get further)."""
    from paratrain.train.recovery.safe_dcp import confined_name

    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise BadManifest(f"checkpoint {path} has no {MANIFEST} (incomplete save)", f"no {MANIFEST}") from None
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        raise BadManifest(f"checkpoint {path} has an unreadable {MANIFEST}", f"unreadable {MANIFEST}") from None
    problem = _manifest_problem(manifest, confined_name)
    if problem:
        raise BadManifest(f"checkpoint {path} has a malformed {MANIFEST}: {problem}", f"malformed {MANIFEST}: {problem}")
    return manifest


class BadManifest(UserError):
    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _manifest_problem(manifest, confined_name) -> str | None:
    if not isinstance(manifest, dict):
        return "not a JSON object"
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        return "'step' is not an integer in 0..2**40"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "'files' is not a mapping of file names to sizes"
    for name, size in files.items():
        if not confined_name(name):
            return f"file name {name[:80]!r} is not a plain name inside the checkpoint"
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"size of {name!r} is not a non-negative integer"
    extra = manifest.get("extra")
    data = extra.get("data") if isinstance(extra, dict) else None
    position = data.get("step") if isinstance(data, dict) else None
    if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position <= MAX_STEP:
        return "'extra.data.step' is not a data position (an integer in 0..2**40)"
    if data.get("stream") is not None and not is_stream_state(data["stream"]):
        return "'extra.data.stream' is not a document-stream position (draws, positions, carry, tokens_drawn)"
    if extra.get("semi_sync") is not None:  # a --semi-sync run's outer loop (parallel/semi_sync/checkpoint_state.py)
        from paratrain.parallel.semi_sync.checkpoint_state import record_problem

        problem = record_problem(extra["semi_sync"])
        if problem:
            return problem
    if not isinstance(manifest.get("model", {}), dict):
        return "'model' is not a mapping"
    source = manifest.get("model_source", {})
    if not isinstance(source, dict) or not isinstance(source.get("kind", ""), str) or \
            not isinstance(source.get("config", {}), dict) or not isinstance(source.get("config_path", ""), str) or \
            not isinstance(source.get("tokenizer", ""), str):
        return "'model_source' is not a mapping with a kind, a config path, a config and a tokenizer path"
    if not isinstance(manifest.get("run_id", ""), str | None):
        return "'run_id' is not a string"
    return None


def check_complete(path: Path) -> str | None:
    """None if `path` is a complete checkpoint, else why not."""
    if not (path / ".metadata").is_file():
        return "missing .metadata"
    try:
        manifest = read_manifest(path)
    except BadManifest as exc:
        return exc.reason
    for name, size in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size != size:
            return f"file {name} is {f.stat().st_size} bytes, expected {size}"
    return None


def latest_complete(root: str | Path, warn: bool = True) -> Path | None:
    """Newest complete checkpoint under root; broken newer ones are named in a warning and skipped."""
    for path, _ in reversed(_step_dirs(Path(root))):
        problem = check_complete(path)
        if problem is None:
            return path
        if warn:
            _warn_skip(path, problem)
    return None


def find_checkpoint(path: str | Path) -> Path:
    """A complete step directory: `path` itself, or the newest complete step-N/ under it."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory")
    if (path / MANIFEST).exists() or (path / ".metadata").exists():
        problem = check_complete(path)
        if problem:
            raise UserError(f"{path} is not a complete paratrain checkpoint: {problem}")
        return path
    newest = latest_complete(path)
    if newest is None:
        raise UserError(f"{path} is not a paratrain checkpoint (no {MANIFEST} and .metadata, "
                        "and no complete step-N/ inside)")
    return newest


def _warn_skip(path: Path, problem: str) -> None:
    if _rank() == 0:
        log.warning("skipping broken checkpoint %s: %s", path, problem)


def resolve_resume(resume: str, ckpt_dir: str | None) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return latest_complete(ckpt_dir) if ckpt_dir else None
    path = Path(resume)
    problem = check_complete(path)
    if problem:
        raise UserError(f"cannot resume from {path}: {problem}")
    return path


class UnreadableCheckpoint(UserError):
    """The checkpoint looked complete but DCP could not read it back (corrupt bytes, refused content)."""


def _model_changes(saved: dict, current: dict) -> str:
    keys = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k) and k != "name"]
    return ", ".join(f"{k} {saved.get(k)} -> {current.get(k)}" for k in keys[:4]) or "fingerprint differs"


def load(path: Path, state: CheckpointState, fingerprint: str, model: dict | None = None) -> dict:
    """Load into the live (already parallelized) state; DCP reshards if the layout changed.

    `model` (the current model args) only makes the error for a different model config name the changes.
    """
    from paratrain.train.recovery.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    manifest = read_manifest(path)
    if manifest.get("model_fingerprint") != fingerprint:
        changes = _model_changes(manifest.get("model") or {}, model) if model else "fingerprint differs"
        raise UserError(f"checkpoint {path} was saved for a different model config ({changes}); "
                        "use another --ckpt-dir or --resume never")
    sd = state.tensors(manifest)
    try:
        dcp.load(sd, checkpoint_id=str(path), storage_reader=SafeFileSystemReader(path),
                 planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any rank's read failure, on every rank
        raise UnreadableCheckpoint(f"checkpoint {path} is unreadable: {_first_line(exc)}") from None
    state.load_tensors(sd)
    rng_file = path / f"rng-rank-{_rank()}.json"
    if rng_file.is_file():
        try:
            _restore_rng(json.loads(rng_file.read_text()))
        except (ValueError, KeyError):
            log.warning("RNG state in %s is unreadable; continuing with the current RNG", rng_file)
    return manifest


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1][:200] if lines else type(exc).__name__


def resume_from(resume: str, ckpt_dir: str | None, state: CheckpointState, fingerprint: str,
                model: dict | None = None) -> tuple[Path, dict] | None:
    """Load what --resume asks for; returns (path, manifest) or None for a fresh start.

    With "auto", a checkpoint that looks complete but fails to load is skipped too (with a warning naming
    it) and the next older one is tried; every rank sees the same files and DCP fails on all ranks
    together, so they all fall back alike.
    """
    if resume != "auto":
        path = resolve_resume(resume, ckpt_dir)
        return (path, load(path, state, fingerprint, model)) if path else None
    for path, _ in reversed(_step_dirs(Path(ckpt_dir)) if ckpt_dir else []):
        problem = check_complete(path)
        if problem is None:
            try:
                return path, load(path, state, fingerprint, model)
            except UnreadableCheckpoint as exc:
                problem = str(exc).split(" is unreadable: ", 1)[-1]
        _warn_skip(path, problem)
    return None


def load_params(path: str | Path) -> dict[str, torch.Tensor]:
    """Full model parameters of a checkpoint, on CPU, in one process: {fqn: tensor}.

    Built for comparing runs bit for bit (the kill test, benchmarks/kill_soak.py) and for inspecting a
    checkpoint: DCP gathers whatever layout it was saved with into plain tensors of a fresh model.
    """
    from paratrain.models.llama import ModelArgs
    from paratrain.models.presets import build_model

    path = Path(path)
    problem = check_complete(path)
    if problem:
        raise UserError(f"cannot read checkpoint {path}: {problem}")
    from paratrain.train.recovery.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    try:
        args = ModelArgs(**read_manifest(path)["model"])
    except (TypeError, ValueError) as exc:
        raise UserError(f"checkpoint {path} names a model this version cannot build: {_first_line(exc)}") from None
    model = build_model(args, "cpu", seed=None)
    sd = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - corrupt bytes or refused content
            raise UnreadableCheckpoint(f"checkpoint {path} is unreadable: {_first_line(exc)}") from None
    return sd["model"]
