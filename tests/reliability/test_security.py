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
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratrain.train import checkpoint as ckpt
from paratrain.train.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
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
