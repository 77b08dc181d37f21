"""Preemption without a scheduler (train/recovery/preemption.py): the signal reaches one rank of two, at step 3; both
ranks agree on that step (the per-step all-reduce of the flag), checkpoint together and stop with the
preempted status. The real Slurm signal, the requeue, and a resume to an uninterrupted run's losses:
test_real_slurm.py. The runs are in this process (cli_here): the signal goes to a rank, which forks from the warm
forkserver."""

from __future__ import annotations

import json

import pytest

from helpers import plugin_env

TRAIN = ["train", "--model", "tiny", "--nproc", "2", "--steps", "6", "--timeout-s", "60", "--json"]


@pytest.mark.timeout(240)
def test_one_rank_signalled_both_checkpoint_at_its_step(cli_here, tmp_path):
    from paratrain.train.recovery.preemption import EXIT_PREEMPTED

    run_dir = tmp_path / "run"
    env = plugin_env("support.preempt_signal:plugin", PARATRAIN_TEST_PREEMPT_AT="1:3")
    stopped = cli_here(*TRAIN, "--out", str(run_dir), "--preempt-signal", "USR1", env=env)
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr
    summary = json.loads(stopped.stdout)
    assert summary["stopped"] == "preempted" and summary["steps"] == 3, summary
    assert json.loads((run_dir / "preempted.json").read_text())["step"] == 3
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-3"]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step-3").glob("rng-rank-*")) == \
        ["rng-rank-0.json", "rng-rank-1.json"]  # both ranks saved at that step


@pytest.mark.timeout(120)
def test_a_signal_while_the_trainer_is_built_stops_at_the_first_step(cli_here, tmp_path):
    """Before the trainer installs its handler (here: while the model is parallelized) the signal is not lost:
    the worker watches for it from its start, and the run checkpoints at step 1 and stops as preempted."""
    from paratrain.train.recovery.preemption import EXIT_PREEMPTED

    run_dir = tmp_path / "run"
    env = plugin_env("support.preempt_signal:plugin", PARATRAIN_TEST_PREEMPT_AT="0:0")
    stopped = cli_here("train", "--model", "tiny", "--steps", "4", "--json", "--out", str(run_dir),
                       "--preempt-signal", "USR1", env=env)
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr
    assert json.loads(stopped.stdout)["steps"] == 1
    assert json.loads((run_dir / "preempted.json").read_text())["step"] == 1


def test_bad_preempt_signal_is_one_line(cli_inproc):  # refused before any worker starts: in this process
    result = cli_inproc("train", "--model", "tiny", "--steps", "1", "--preempt-signal", "KILL")
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "preempt_signal" in result.stderr, result
