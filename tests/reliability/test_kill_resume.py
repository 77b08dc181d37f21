"""Kill test: SIGKILL one rank at a random step between checkpoints; torch elastic restarts the group,
--resume auto continues from the newest complete checkpoint, and the final parameters are bit-identical
to an uninterrupted run (reference: the same command without the kill; fp32, CPU, 2 ranks).

Also: the restart is announced in one line naming the dead rank, the summary counts it, and metrics.jsonl reads as
one run (the killed attempt's steps past the checkpoint are not left in it twice); the world-size change 2 -> 1 goes
through DCP resharding, and a single-node run listens only on loopback. Seed the random choices with
PARATRAIN_KILL_SEED to replay a failure.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from helpers import plugin_env
from paratrain.train.recovery import checkpoint as ckpt
from reliability.inproc import make_trainer, one_rank, run_cli_inproc
from reliability.procnet import is_loopback
from reliability.runs import KILL_EVERY, KILL_STEPS, kill_args, run_train

SEED = int(os.environ.get("PARATRAIN_KILL_SEED", random.SystemRandom().randrange(1 << 30)))
TRIALS = [("ddp", 0), ("ddp", 1), ("zero3", 0), ("zero3", 1)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One uninterrupted run per strategy: {strategy: (run dir, Run)}; the ddp one is watched for sockets (a process
    of its own); the zero3 one runs in this process (its ranks fork from the warm forkserver: no interpreter start)."""
    root = tmp_path_factory.mktemp("reference")
    run = run_train(kill_args("ddp", "ddp"), root, watch=True)
    assert run.returncode == 0, run.stderr[-3000:]
    code, _, err = run_cli_inproc(["train", *kill_args("zero3", "zero3")], cwd=root)
    assert code == 0, err[-3000:]
    return {"ddp": (root / "ddp", run), "zero3": (root / "zero3", None)}


def same_params(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in any bit (empty: bit-identical)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,trial", TRIALS)
def test_killed_rank_resumes_bit_identical(cli_here, references, tmp_path, strategy, trial):
    rng = random.Random(SEED * 100 + TRIALS.index((strategy, trial)))
    # a step strictly between two checkpoints, after the first one, so the restart must resume
    step = rng.choice([s for s in range(KILL_EVERY + 1, KILL_STEPS) if s % KILL_EVERY])
    rank = trial  # each strategy loses rank 0 once and rank 1 once
    what = f"{strategy} trial {trial}: SIGKILL rank {rank} after step {step} (PARATRAIN_KILL_SEED={SEED})"
    # in this process: the ranks (the killed one and its replacement too) fork from the warm forkserver
    run = cli_here("train", *kill_args(strategy, "run", metrics=True), "--max-restarts", "1", "--json",
                   env=plugin_env("support.kill_stall:plugin", PARATRAIN_FAULT_KILL=f"{rank}:{step}"), ranks=True)
    assert run.returncode == 0, f"{what}\n{run.stderr[-3000:]}"
    resumed_at = step - step % KILL_EVERY
    assert f"resumed from run/ck/step-{resumed_at} (step {resumed_at})" in run.stderr, what
    restart = [ln for ln in run.stderr.splitlines() if "restart 1 of --max-restarts 1" in ln]
    assert len(restart) == 1 and f"rank {rank} died" in restart[0], f"{what}\n{run.stderr[-3000:]}"
    assert json.loads(run.stdout)["restarts"] == 1, what
    logged = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, KILL_STEPS + 1)), what
    reference = ckpt.load_params(references[strategy][0] / "ck" / f"step-{KILL_STEPS}")
    final = ckpt.load_params(tmp_path / "run" / "ck" / f"step-{KILL_STEPS}")
    assert same_params(reference, final) == [], what


@pytest.mark.timeout(120)
def test_checkpoint_from_two_ranks_reshards_onto_one(references):
    """zero3 on 2 ranks saved DTensor shards; one rank loads them through DCP and trains on.

    Reference: the 2-rank zero3 run. Loaded parameters are exact; 4 more steps on one rank match the
    2-rank run to fp32 tolerance (1e-5 relative), since only the reduction order differs.
    """
    ck = references["zero3"][0] / "ck"
    with one_rank() as rt:
        trainer = make_trainer(
            rt, ckpt_dir=str(ck), resume=str(ck / "step-4"), steps=KILL_STEPS, seq_len=32, global_batch=8
        )
        trainer.maybe_resume()
        assert trainer.step == 4
        model = trainer.step_runner.model_parts[0]
        loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert same_params(ckpt.load_params(ck / "step-4"), loaded) == []
        trainer.cfg.ckpt_every = 0
        trainer.fit()
        final = {k: v.detach() for k, v in model.state_dict().items()}
    reference = ckpt.load_params(ck / f"step-{KILL_STEPS}")
    for name, ref in reference.items():
        torch.testing.assert_close(final[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_single_node_run_listens_only_on_loopback(references):
    """Security: the store and the workers of a 2-rank run bind 127.0.0.1 only (c10d has no auth)."""
    listeners = references["ddp"][1].listeners
    assert listeners, "saw no listening socket at all: the watch missed the run"
    assert all(is_loopback(addr) for addr, _ in listeners), listeners
