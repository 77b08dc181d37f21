"""fit() completes step N's record after launching step N+1 when nothing needs it at once
(train/step_record.py): the records equal a synchronous run's, a NaN loss still fails naming its step and leaves
no checkpoint of it, and a stop at step N still ends the run at N steps."""

from __future__ import annotations

import json

import pytest

from paratrain.config import TrainConfig
from paratrain.train import hooks as hooks_module
from paratrain.train.hooks import Hooks
from paratrain.train.recovery.run_failures import RunFailed
from paratrain.train.runtime import init_runtime
from paratrain.train.trainer import Trainer
from support.step_faults import FAULT_ENV, StepFault

FIELDS = ["step", "loss", "lr", "grad_norm", "step_time_s", "data_wait_s", "tokens_per_s", "mfu", "mem_peak_gib",
          "wall_s", "cpu_s"]


@pytest.fixture
def single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded by monkeypatch, so what init_runtime sets is undone after
        monkeypatch.delenv(key)
    return init_runtime("cpu", 60.0)


def config(**overrides) -> TrainConfig:
    base = {"model": "tiny", "strategy": "single", "nproc": 1, "device": "cpu", "steps": 7, "seq_len": 16,
            "global_batch": 2, "resume": "never", "warmup_steps": 2}
    return TrainConfig(**{**base, **overrides})


def plant(monkeypatch, fault: str) -> None:
    """support.step_faults through PARATRAIN_PLUGINS, loaded afresh by this process's default registry."""
    monkeypatch.setenv(hooks_module.PLUGINS_ENV, "support.step_faults:plugin")
    monkeypatch.setenv(FAULT_ENV, fault)
    # a fresh registry, as in a fresh process; monkeypatch puts the old registry and its spec back together, so
    # later in-process runs do not keep this plugin (restoring the spec alone left it loaded under "")
    monkeypatch.setattr(hooks_module, "_default", None)
    monkeypatch.setattr(hooks_module, "_loaded_spec", None)


def records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train(rt, run_dir, hooks: Hooks | None = None, on_step=None, **overrides) -> tuple[dict, list]:
    """fit() on `run_dir`; also, at each step's start, (the step about to run, records written so far)."""
    hooks = hooks if hooks is not None else Hooks()
    run_dir.mkdir()
    trainer = Trainer(config(**overrides), rt, run_dir, quiet=True, hooks=hooks)
    written: list[tuple[int, int]] = []
    hooks.on_phase(lambda phase: written.append((trainer.step + 1, len(records(run_dir))))
                   if phase == "start" else None)
    return trainer.fit(on_step=on_step), written


def test_deferred_records_equal_a_synchronous_runs(single_process, tmp_path):
    seen = []
    deferred, written = train(single_process, tmp_path / "deferred", ckpt_every=4)
    synced, written_synced = train(single_process, tmp_path / "synced", ckpt_every=4,
                                   on_step=lambda trainer, record: seen.append(record["step"]))
    # deferred: step N's record is written after step N+1 has started, except before the next step of a
    # checkpoint step (4), whose record must be read before it saves; synchronous: before the next step starts
    assert written == [(1, 0), (2, 0), (3, 1), (4, 2), (5, 4), (6, 4), (7, 5)], written
    assert written_synced == [(step, step - 1) for step in range(1, 8)] and seen == list(range(1, 8))
    a, b = records(tmp_path / "deferred"), records(tmp_path / "synced")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 8))
    for ra, rb in zip(a, b):
        assert list(ra) == list(rb) == FIELDS
        assert (ra["loss"], ra["lr"], ra["grad_norm"]) == (rb["loss"], rb["lr"], rb["grad_norm"])  # bit for bit
        assert ra["step_time_s"] > 0 and ra["tokens_per_s"] > 0 and ra["data_wait_s"] >= 0
    assert ra["loss"] < a[0]["loss"]  # it trained
    assert deferred["losses"] == synced["losses"] == [r["loss"] for r in a]
    assert deferred["steps"] == synced["steps"] == 7 and deferred["final_loss"] == a[-1]["loss"]
    assert sorted(p.name for p in (tmp_path / "deferred" / "checkpoints").iterdir()) == ["step-4"]


def test_validation_step_is_read_before_the_next_launch(single_process, tmp_path):
    deferred, written = train(single_process, tmp_path / "deferred", steps=5, eval_every=2,
                              val_batches=1)
    synced, _ = train(single_process, tmp_path / "synced", steps=5, eval_every=2, val_batches=1,
                      on_step=lambda trainer, record: None)
    assert written == [(1, 0), (2, 0), (3, 2), (4, 2), (5, 4)], written
    a, b = records(tmp_path / "deferred"), records(tmp_path / "synced")
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    assert [r["step"] for r in a if "val_loss" in r] == [2, 4, 5] and deferred["val_loss"] == synced["val_loss"]


def test_nan_loss_fails_naming_its_step_and_saves_no_checkpoint_of_it(single_process, tmp_path, monkeypatch):
    # step 5's NaN is read one step late, when step 6 (a checkpoint step) is launched, before its save;
    # step 6's own NaN is read before the save that step would make
    for diverged in (5, 6):
        plant(monkeypatch, f"nan:{diverged}")
        run_dir = tmp_path / str(diverged)
        run_dir.mkdir()
        trainer = Trainer(config(steps=8, ckpt_every=3), single_process, run_dir, quiet=True)
        with pytest.raises(RunFailed, match=rf"loss became nan at step {diverged}: training diverged"):
            trainer.fit()
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-3"]
        assert trainer.step == 6
        assert [r["step"] for r in records(run_dir)] == list(range(1, diverged))


def test_a_failed_step_still_writes_the_record_before_it(single_process, tmp_path, monkeypatch):
    plant(monkeypatch, "raise:4")
    trainer = Trainer(config(), single_process, tmp_path, quiet=True)
    with pytest.raises(StepFault):
        trainer.fit()
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]


def test_stop_at_step_n_ends_with_n_steps(single_process, tmp_path, monkeypatch):
    hooks, seen = Hooks(), []

    def after_step(trainer, record):
        seen.append(record["step"])
        if record["step"] == 3:
            trainer.stop_reason = "asked"

    hooks.after_step(after_step)
    summary, _ = train(single_process, tmp_path / "hook", hooks=hooks)
    assert summary["steps"] == 3 and summary["stopped"] == "asked" and seen == [1, 2, 3]
    assert [r["step"] for r in records(tmp_path / "hook")] == [1, 2, 3]
    # a stop asked during a step's launch, while records are deferred (a wrap_step hook)
    plant(monkeypatch, "stop:3")
    (tmp_path / "launch").mkdir()
    trainer = Trainer(config(), single_process, tmp_path / "launch", quiet=True)
    summary = trainer.fit()
    assert summary["steps"] == 3 and summary["stopped"] == "planted"
    assert [r["step"] for r in records(tmp_path / "launch")] == [1, 2, 3]
