"""Broken checkpoints: each case is detected, named in a warning, and resume falls back to step-2.

Reference: the intact step-2 checkpoint. After the fallback the live parameters must equal it exactly.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from paratrain.errors import UserError
from paratrain.train.recovery import checkpoint as ckpt
from reliability.inproc import make_trainer, one_rank


def shard(step_dir):
    return sorted(step_dir.glob("*.distcp"))[0]


def resume_and_check(root, caplog, broken_name: str, reason: str):
    """Resume --resume auto from root: must land on step-2, warning that `broken_name` was skipped."""
    caplog.set_level(logging.WARNING, logger="paratrain")
    with one_rank() as rt:
        trainer = make_trainer(rt, ckpt_dir=str(root), steps=6)
        trainer.maybe_resume()
        assert trainer.step == 2
        live = {
            k.replace("module.", ""): v.detach()
            for k, v in trainer.step_runner.model_parts[0].state_dict().items()
        }
    expected = ckpt.load_params(root / "step-2")
    assert all(torch.equal(live[k], expected[k]) for k in expected)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"skipping broken checkpoint {root / broken_name}" in warning, warning
    assert reason in warning, warning


@pytest.mark.timeout(60)
def test_truncated_shard(ckpts, caplog):
    f = shard(ckpts / "step-4")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    resume_and_check(ckpts, caplog, "step-4", f"file {f.name} is")


@pytest.mark.timeout(60)
def test_zero_byte_file(ckpts, caplog):
    shard(ckpts / "step-4").write_bytes(b"")
    resume_and_check(ckpts, caplog, "step-4", "is 0 bytes")


@pytest.mark.timeout(60)
def test_missing_metadata(ckpts, caplog):
    (ckpts / "step-4" / ".metadata").unlink()
    resume_and_check(ckpts, caplog, "step-4", "missing .metadata")


@pytest.mark.timeout(60)
def test_missing_manifest(ckpts, caplog):
    (ckpts / "step-4" / "manifest.json").unlink()
    resume_and_check(ckpts, caplog, "step-4", "no manifest.json")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("garbage", [b"\x00\xff not json", b'{"step": "four"}', b"[]"])
def test_garbage_manifest(ckpts, caplog, garbage):
    (ckpts / "step-4" / "manifest.json").write_bytes(garbage)
    resume_and_check(ckpts, caplog, "step-4", "manifest.json")


@pytest.mark.timeout(60)
def test_half_written_step_dir(ckpts, caplog):
    """A crash mid-save leaves step-6.partial (never a candidate) or, copied by hand, a step-6 without manifest."""
    partial = ckpts / "step-6.partial"
    partial.mkdir()
    shard(ckpts / "step-4").rename(partial / "__0_0.distcp")  # step-4 is now broken too: falls back to 2
    assert ckpt.latest_complete(ckpts, warn=False) == ckpts / "step-2"
    half = ckpts / "step-8"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"\x00" * 100)
    resume_and_check(ckpts, caplog, "step-8", "missing .metadata")
    assert "step-6.partial" not in caplog.text


@pytest.mark.timeout(60)
def test_same_size_corruption_is_caught_at_load(ckpts, caplog):
    """Sizes match the manifest but the bytes are wrong: DCP fails to read, and resume falls back."""
    meta = ckpts / "step-4" / ".metadata"
    meta.write_bytes(b"\x00" * meta.stat().st_size)
    resume_and_check(ckpts, caplog, "step-4", "metadata read failed")


@pytest.mark.timeout(60)
def test_different_model_config_is_a_clear_error(good_checkpoints):
    with one_rank() as rt:
        trainer = make_trainer(rt, model="tiny4", ckpt_dir=str(good_checkpoints), steps=6)
        with pytest.raises(UserError, match=r"different model config \(n_layers 2 -> 4\)"):
            trainer.maybe_resume()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_failed_write_keeps_previous_checkpoint(ckpts, monkeypatch, code):
    """A shard write dies half-way inside DCP (disk full / permission denied, simulated because root
    ignores permissions): step-4 stays intact, nothing partial is left, and the error says so."""
    before = {p.name: p.read_bytes() for p in (ckpts / "step-4").iterdir()}
    real_open = Path.open

    def failing_open(self, mode="r", *args, **kwargs):
        if "w" in mode and self.suffix == ".distcp" and self.parent.name == "step-6.partial":
            stream = real_open(self, mode, *args, **kwargs)
            stream.write(b"half a shard")
            stream.close()
            raise OSError(code, os.strerror(code), str(self))
        return real_open(self, mode, *args, **kwargs)

    with one_rank() as rt:
        trainer = make_trainer(rt, ckpt_dir=str(ckpts), steps=6, ckpt_every=2)
        trainer.maybe_resume()
        trainer.step = 6
        monkeypatch.setattr(Path, "open", failing_open)
        with pytest.raises(UserError) as err:
            trainer.save_checkpoint()
        monkeypatch.undo()
    message = str(err.value)
    assert message.startswith("checkpoint save failed: ") and os.strerror(code) in message, message
    assert message.endswith(f"the previous checkpoint {ckpts / 'step-4'} is intact"), message
    assert len(message.splitlines()) == 1
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2", "step-4"]
    assert {p.name: p.read_bytes() for p in (ckpts / "step-4").iterdir()} == before
    assert json.loads((ckpts / "step-4" / "manifest.json").read_text())["step"] == 4
