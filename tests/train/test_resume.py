"""Resume: 20 steps with a checkpoint at 10, then a new process group resumes from step 10.

Reference: the uninterrupted run. Steps 11-20 must have bit-identical losses (fp32, CPU).
"""

import json

import pytest

from helpers import CLIResult
from reliability.inproc import run_cli_inproc


def losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,nproc", [("single", "1"), ("ddp", "2")])
def test_resume_reproduces_the_uninterrupted_run(cli_here, tmp_path, strategy, nproc):
    cli = cli_here  # in this process: no interpreter start
    common = ["train", "--strategy", strategy, "--nproc", nproc, "--steps", "20", "--ckpt-dir", "ck"]
    full = cli(*common, "--ckpt-every", "10", "--out", "full", "--resume", "never")
    assert full.returncode == 0, full.stderr[-2000:]
    assert (tmp_path / "ck" / "step-10" / "manifest.json").is_file()
    resumed = cli(*common, "--resume", "ck/step-10", "--out", "resumed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = losses(tmp_path / "full" / "metrics.jsonl"), losses(tmp_path / "resumed" / "metrics.jsonl")
    assert len(b) == 10
    assert a[10:] == b


@pytest.mark.timeout(120)
def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path):
    def cli(*args: str) -> CLIResult:  # in this process: one rank, no interpreter start
        return CLIResult(*run_cli_inproc(list(args), cwd=tmp_path))

    run = cli("train", "--strategy", "single", "--steps", "6", "--ckpt-every", "2", "--ckpt-dir", "ck", "--out", "a")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-2", "step-4", "step-6"]
    (tmp_path / "ck" / "step-6" / "manifest.json").unlink()
    again = cli("train", "--strategy", "single", "--steps", "8", "--ckpt-dir", "ck", "--out", "b", "--json")
    assert again.returncode == 0, again.stderr
    assert "skipping broken checkpoint" in again.stderr and "step-6" in again.stderr
    assert len(losses(tmp_path / "b" / "metrics.jsonl")) == 4  # steps 5..8 after resuming at 4
    # a checkpoint already at --steps: nothing left to train, and no loss to report (null, never NaN)
    done = cli("train", "--strategy", "single", "--steps", "4", "--ckpt-dir", "ck", "--resume", "ck/step-4",
               "--out", "c", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout, parse_constant=lambda name: pytest.fail(f"{name} in the JSON summary"))
    assert summary["steps"] == 4 and summary["final_loss"] is None and summary["restarts"] == 0
    assert "nothing left to train: the checkpoint is at step 4 of --steps 4" in done.stderr
    assert "done: 4 steps, loss n/a (no step trained)" in done.stderr
