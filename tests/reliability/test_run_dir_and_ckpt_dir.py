"""Issue 19, defects 3 and 4: an error found mid-run keeps the run directory and its checkpoints; a reused
--ckpt-dir never loses this run's newest save nor another run's checkpoints. All in-process (one rank)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from paratrain.train.data.counter_hash import uniform_hash
from reliability.inproc import run_cli_inproc

SMALL = ["--strategy", "single", "--seq-len", "8", "--global-batch", "1", "--no-metrics"]


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "failed:"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def tokens_bad_only_in_step_two(path: Path, seq_len: int = 8, n: int = 4000, vocab: int = 256) -> None:
    """A uint16 token file whose only out-of-vocabulary id sits in step 2's window, not step 1's (the
    windows are drawn exactly as TokenFile.samples draws them: global batch 1, seed 0)."""
    span = n - seq_len - 1
    starts = (uniform_hash(0, np.arange(2, dtype=np.int64), 1 << 20) * span).astype(np.int64)
    first = set(range(starts[0], starts[0] + seq_len + 1))
    bad = next(i for i in range(starts[1], starts[1] + seq_len + 1) if i not in first)
    tokens = np.arange(n, dtype=np.uint16) % vocab
    tokens[bad] = vocab
    tokens.tofile(path)


def test_bad_token_at_step_two_keeps_the_run_dir_and_step_one(tmp_path):
    tokens_bad_only_in_step_two(tmp_path / "tokens.bin")
    code, _, err = run_cli_inproc(["train", *SMALL, "--steps", "3", "--ckpt-every", "1", "--data", "tokens.bin",
                                   "--out", "run"], cwd=tmp_path)
    assert code == 2 and "token id 256 >= vocab size 256" in one_line_error(err), err
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "manifest.json").is_file(), "step-1 was deleted"


def test_failed_second_save_keeps_the_first(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    real_save, calls = dcp.save, []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr("paratrain.train.recovery.checkpoint.dcp.save", failing_second)
    code, _, err = run_cli_inproc(["train", *SMALL, "--steps", "3", "--ckpt-every", "1", "--out", "run"],
                                  cwd=tmp_path)
    line = one_line_error(err)
    assert code == 2 and "checkpoint save failed" in line and "step-1 is intact" in line, err
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "manifest.json").is_file(), "the intact step-1 is gone"


def foreign_copy(good: Path, root: Path, step: int, run_id: str = "another-run") -> Path:
    """good's step-4, renamed step-N under root, marked as another run's (the manifest says so)."""
    dest = root / f"step-{step}"
    shutil.copytree(good / "step-4", dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest.update(step=step, run_id=run_id)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def keep_one(tmp_path) -> Path:
    config = tmp_path / "keep1.toml"
    config.write_text('model = "tiny"\nkeep_ckpts = 1\n')
    return config


def test_ckpt_dir_with_another_runs_newer_checkpoint_is_refused(good_checkpoints, tmp_path):
    """Before: the run trained, saved step-1, and pruning (keep 1) deleted step-1 as "older" than step-100."""
    ck = tmp_path / "ck"
    other = foreign_copy(good_checkpoints, ck, 100)
    code, _, err = run_cli_inproc(["train", "--config", keep_one(tmp_path), *SMALL, "--seq-len", "32",
                                   "--global-batch", "4", "--steps", "2", "--ckpt-every", "1", "--ckpt-dir", "ck",
                                   "--resume", "never", "--out", "run"], cwd=tmp_path)
    line = one_line_error(err)
    assert code == 2 and "holds step-100 from another run" in line, err
    assert sorted(p.name for p in ck.iterdir()) == ["step-100"] and (other / "manifest.json").is_file()
    assert not (tmp_path / "run").exists(), "nothing ran: the run dir it created must go"


def test_pruning_spares_another_runs_checkpoints(good_checkpoints, tmp_path):
    """Resumed from step-4 elsewhere into a dir holding another run's older step-2: keep 1 prunes only ours."""
    ck = tmp_path / "ck"
    theirs = foreign_copy(good_checkpoints, ck, 2)
    start = shutil.copytree(good_checkpoints / "step-4", tmp_path / "from" / "step-4")
    code, _, err = run_cli_inproc(["train", "--config", keep_one(tmp_path), *SMALL, "--seq-len", "32",
                                   "--global-batch", "4", "--steps", "8", "--ckpt-every", "2", "--ckpt-dir", "ck",
                                   "--resume", start, "--out", "run"], cwd=tmp_path)
    assert code == 0, err
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-8"], "ours pruned to 1; theirs untouched"
    assert json.loads((theirs / "manifest.json").read_text())["run_id"] == "another-run"
