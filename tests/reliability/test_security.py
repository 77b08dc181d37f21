"""Security: nothing is unpickled or evaluated from untrusted input.

Static checks over src/ (every torch.load passes weights_only=True; no pickle.load(s), eval, exec), and
crafted checkpoints whose code must not run: a malicious DCP `.metadata` and a malicious non-tensor entry.
The loopback-only listening check runs inside the kill test (it watches a real 2-rank run).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratrain.train.recovery import checkpoint as ckpt
from paratrain.train.recovery.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from reliability.inproc import make_trainer, one_rank

SRC = Path(__file__).resolve().parents[2] / "src" / "paratrain"


def calls(name_owner: str, attr: str):
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == attr
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == name_owner
            ):
                yield path, node


def test_every_torch_load_is_weights_only():
    found = list(calls("torch", "load"))
    for path, node in found:
        flags = {k.arg: k.value for k in node.keywords}
        assert isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True, (
            f"{path}:{node.lineno} calls torch.load without weights_only=True"
        )


def test_nothing_is_unpickled_or_evaluated():
    for attr in ("load", "loads"):
        hits = [f"{p}:{n.lineno}" for p, n in calls("pickle", attr)]
        assert hits == [], f"pickle.{attr} in {hits}"
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec"), f"{path}:{node.lineno} calls {node.func.id}"


class Payload:
    """Unpickling this creates a marker directory: proof that code from the file ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_malicious_metadata_is_refused_and_resume_falls_back(ckpts, tmp_path, caplog):
    marker = tmp_path / "pwned-by-metadata"
    meta = ckpts / "step-4" / ".metadata"
    meta.write_bytes(pickle.dumps(Payload(str(marker))))
    manifest_path = ckpts / "step-4" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][".metadata"] = meta.stat().st_size  # make it look complete
    manifest_path.write_text(json.dumps(manifest))
    caplog.set_level(logging.WARNING, logger="paratrain")
    with one_rank() as rt:
        trainer = make_trainer(rt, ckpt_dir=str(ckpts), steps=6)
        trainer.maybe_resume()
        assert trainer.step == 2
    assert not marker.exists()
    assert "posix.mkdir, which is not allowed" in caplog.text
    with pytest.raises(ckpt.UnreadableCheckpoint):
        ckpt.load_params(ckpts / "step-4")
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_malicious_non_tensor_entry_is_refused(tmp_path):
    marker = tmp_path / "pwned-by-bytes"
    dcp.save(
        {"w": torch.ones(3), "extra": Payload(str(marker))}, checkpoint_id=str(tmp_path / "ck"), no_dist=True
    )
    assert not marker.exists()
    target = {"w": torch.zeros(3), "extra": None}
    with pytest.raises(BaseException, match="Weights only load failed|Unsupported global"):
        dcp.load(
            target,
            storage_reader=SafeFileSystemReader(tmp_path / "ck"),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert not marker.exists()
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)  # stock DCP: the threat is real
    assert marker.is_dir()


# -- issue 19, defect 1 -----------------------------------------------------------------------------------
def dotted_global_pickle(module: str, dotted: str, arg: str) -> bytes:
    """Protocol-4 pickle calling module.<dotted>(arg): pickle resolves a dotted name attribute by attribute,
    so an allowed module that imports `os` hands out `os.mkdir` (the hole in a module-wide allow-list)."""

    def text(s: str) -> bytes:  # BINUNICODE
        raw = s.encode()
        return b"X" + len(raw).to_bytes(4, "little") + raw

    return b"\x80\x04" + text(module) + text(dotted) + b"\x93" + text(arg) + b"\x85" + b"R" + b"."


def make_it_look_complete(step_dir: Path) -> None:
    """Rewrite the manifest's file list to what the directory now holds."""
    manifest_path = step_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {p.name: p.stat().st_size for p in step_dir.iterdir() if p.name != "manifest.json"}
    manifest_path.write_text(json.dumps(manifest))


def resume_auto(ckpts: Path) -> int:
    with one_rank() as rt:
        trainer = make_trainer(rt, ckpt_dir=str(ckpts), steps=6)
        trainer.maybe_resume()
        return trainer.step


def test_dotted_name_through_an_allowed_module_does_not_run(ckpts, tmp_path, caplog):
    marker = tmp_path / "pwned-by-dotted-name"
    meta = ckpts / "step-4" / ".metadata"
    meta.write_bytes(dotted_global_pickle("torch.distributed.checkpoint.metadata", "os.mkdir", str(marker)))
    make_it_look_complete(ckpts / "step-4")
    caplog.set_level(logging.WARNING, logger="paratrain")
    assert resume_auto(ckpts) == 2  # --resume auto skips it and falls back to step-2
    assert not marker.exists(), "code in a crafted .metadata ran"
    assert "os.mkdir, which is not allowed" in caplog.text


def rewrite_storage(step_dir: Path, new_path) -> None:
    """Point every entry of a real .metadata at new_path (rebuilt with the safe unpickler, dumped again)."""
    from paratrain.train.recovery.safe_dcp import _MetadataUnpickler

    meta = step_dir / ".metadata"
    with open(meta, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    for info in metadata.storage_data.values():
        info.relative_path = new_path(info.relative_path)
    meta.write_bytes(pickle.dumps(metadata))
    make_it_look_complete(step_dir)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_metadata_cannot_point_outside_the_checkpoint(ckpts, tmp_path, caplog, where):
    """The shard is copied outside the checkpoint, so a reader that follows the path would load fine."""
    step = ckpts / "step-4"
    outside = tmp_path / "outside"
    outside.mkdir()
    for shard in step.glob("*.distcp"):
        shutil.copy(shard, outside / shard.name)
        shard.unlink()
    rel = os.path.relpath(outside, step)
    rewrite_storage(step, (lambda name: f"{rel}/{name}") if where == "parent" else (lambda name: str(outside / name)))
    caplog.set_level(logging.WARNING, logger="paratrain")
    assert resume_auto(ckpts) == 2
    assert "points outside the checkpoint" in caplog.text


@pytest.mark.parametrize("files", [{"../outside.bin": 4}, {"/etc/hostname": None}, ["__0_0.distcp"], {"a": "4"}])
def test_manifest_names_are_confined_and_typed(ckpts, tmp_path, files):
    step = ckpts / "step-4"
    (ckpts / "outside.bin").write_bytes(b"1234")
    if isinstance(files, dict) and "/etc/hostname" in files:
        files = {"/etc/hostname": Path("/etc/hostname").stat().st_size}
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"] = files
    (step / "manifest.json").write_text(json.dumps(manifest))
    problem = ckpt.check_complete(step)
    assert problem is not None and "malformed manifest.json" in problem, problem
    assert ckpt.latest_complete(ckpts, warn=False) == ckpts / "step-2"


def test_non_tensor_entries_are_parsed_once_and_only_with_weights_only(good_checkpoints, monkeypatch):
    real_load, calls = torch.load, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    with one_rank() as rt:
        trainer = make_trainer(rt, ckpt_dir=str(good_checkpoints), steps=6)
        trainer.maybe_resume()
    assert trainer.step == 4 and calls, calls
    assert all(flag is True for flag in calls), f"torch.load called with weights_only={set(calls)}"
