"""The trainer's hooks (src/paratrain/train/hooks.py): the registry, the collective door, PARATRAIN_PLUGINS, and
a real Trainer calling each per-step point once per step, in order."""

from __future__ import annotations

import contextlib

import pytest
import torch

from paratrain.errors import UserError
from paratrain.parallel.collective_hooks import collective, set_step
from paratrain.train import hooks as hooks_module
from paratrain.train.hooks import PLUGINS_ENV, Hooks, default_hooks, load_plugins
from paratrain.train.step_runner import StepRunner


def test_registry_runs_parent_then_own_and_handles_remove():
    parent, seen = Hooks(), []
    child = Hooks(parent)
    parent.on_phase(lambda phase: seen.append(("parent", phase)))
    handle = child.on_phase(lambda phase: seen.append(("child", phase)))
    child.phase("start")
    assert seen == [("parent", "start"), ("child", "start")]
    handle.remove()
    handle.remove()  # twice is harmless
    parent.phase("optimizer")
    child.phase("loss_sync")
    assert seen[2:] == [("parent", "optimizer"), ("parent", "loss_sync")] and not child.has("wrap_step")
    with pytest.raises(UserError, match="expected a function"):
        child.tp_plan("not callable")


def test_value_hooks_fold_in_registration_order():
    hooks = Hooks()
    hooks.loss_weight(lambda layout, dp_rank, weight: (weight or 1.0) * 2)
    hooks.loss_weight(lambda layout, dp_rank, weight: weight + dp_rank)
    assert hooks.apply_loss_weight(None, 3, None) == 5.0
    hooks.wrap_step(lambda trainer, micro, step: {**step(micro + ["outer"]), "outer": True})
    hooks.wrap_step(lambda trainer, micro, step: step(micro + ["inner"]))
    assert hooks.run_step(None, [], lambda micro: {"seen": micro}) == {"seen": ["outer", "inner"], "outer": True}
    entered = []

    @contextlib.contextmanager
    def around(index):
        entered.append(index)
        yield

    hooks.around_compute(around)
    with hooks.compute(4):
        pass
    assert entered == [4]


def test_collective_interceptor_can_delay_drop_and_alter_one_dimension_at_one_step():
    t = torch.ones(2)
    ran = []
    assert collective("loss", "dp_cp", "all_reduce", None, lambda: ran.append(1) or "done", (t,)) == "done"
    seen = []

    def on_collective(call, proceed):
        seen.append((call.purpose, call.dim, call.op, call.step, call.rank))
        if call.dim == "pp" and call.step == 2:
            return None  # dropped
        if call.purpose == "grad_norm":
            call.tensors[0].mul_(3)  # altered before it runs
        return proceed()

    handle = Hooks().on_collective(on_collective)
    try:
        set_step(2)
        assert collective("loss", "pp", "broadcast", None, lambda: ran.append(2), (t,), src=1) is None
        collective("grad_norm", "dp_cp", "all_reduce", None, lambda: ran.append(3), (t,))
    finally:
        handle.remove()
        set_step(0)
    assert ran == [1, 3] and torch.equal(t, torch.full((2,), 3.0))
    assert seen == [("loss", "pp", "broadcast", 2, 0), ("grad_norm", "dp_cp", "all_reduce", 2, 0)]
    collective("loss", "pp", "broadcast", None, lambda: ran.append(4), (t,))  # removed: nothing intercepts
    assert ran[-1] == 4 and len(seen) == 2


def test_plugins_load_from_the_environment_and_bad_specs_are_one_line(monkeypatch):
    monkeypatch.setenv("PARATRAIN_TEST_LOADER_DELAY_S", "0.01")
    monkeypatch.setenv(PLUGINS_ENV, "support.loader_delay:plugin")
    assert len(default_hooks().callbacks("before_batch")) == 1  # loaded, once
    assert len(default_hooks().callbacks("before_batch")) == 1
    monkeypatch.setenv(PLUGINS_ENV, "")
    assert not default_hooks().callbacks("before_batch")  # the spec changed: what it loaded is gone
    for spec, message in (("no_colon", "is not MODULE:FUNCTION"), ("no_such_module_xyz:f", "cannot import"),
                          ("support.loader_delay:missing", "has no function 'missing'"),
                          ("support.loader_delay:attach", "failed: TypeError")):
        with pytest.raises(UserError, match=message) as info:
            load_plugins(Hooks(), spec)
        assert PLUGINS_ENV in str(info.value) and "\n" not in str(info.value)


def test_bad_plugin_spec_stops_the_cli_with_exit_2_before_any_worker(cli_inproc, monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, "no_such_module_xyz:register")
    monkeypatch.setattr(hooks_module, "_loaded_spec", None)  # as in a fresh process
    res = cli_inproc("verify", "--strategy", "ddp", "--nproc", "2", "--steps", "1")
    assert res.returncode == 2 and "PARATRAIN_PLUGINS: cannot import 'no_such_module_xyz'" in res.stderr, res.stderr
    assert len([line for line in res.stderr.splitlines() if line.strip()]) == 1, res.stderr


@pytest.mark.timeout(120)
def test_trainer_calls_each_step_point_once_per_step_in_order(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded by monkeypatch, so what init_runtime sets is undone after
        monkeypatch.delenv(key)
    from paratrain.config import load_config
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    cfg = load_config(None, {"strategy": "single", "nproc": 1, "steps": 2, "metrics": False, "global_batch": 2,
                             "seq_len": 16})
    hooks, events = Hooks(), []
    hooks.on_phase(lambda phase: events.append(phase))
    hooks.on_gradients(lambda trainer: events.append("gradients"))
    hooks.before_optimizer_step(lambda trainer: events.append("before_optimizer_step"))
    hooks.before_batch(lambda step: events.append(f"batch {step}") if step < 2 else None)
    hooks.after_parallelize(lambda module, layout: events.append(f"parallelized {layout.world}"))
    hooks.after_step(lambda trainer, record: events.append(f"after step {record['step']}"))

    def wrap(trainer, micro, step):
        events.append("wrap in")
        out = step(micro)
        events.append("wrap out")
        return out

    hooks.wrap_step(wrap)
    rt = init_runtime("cpu", 60)
    try:
        trainer = Trainer(cfg, rt, quiet=True, hooks=hooks)
        assert trainer.hooks.parent is hooks and isinstance(trainer.step_runner, StepRunner)
        trainer.fit()
    finally:
        shutdown()
    step = ["wrap in", "start", "forward_backward", "gradients", "before_optimizer_step", "optimizer", "loss_sync",
            "wrap out"]
    assert events[0] == "parallelized 1" and events[1] == "batch 0"
    assert [e for e in events if not e.startswith(("batch", "parallelized"))] == \
        step + ["after step 1"] + step + ["after step 2"], events


def test_context_parallel_all_to_all_passes_the_door(monkeypatch):
    """Ulysses' all-to-all (parallel/cp/cp_comm.py) reaches an interceptor named "cp_ulysses" over "cp", with the
    tensors it moves; a world of one rank, in this process."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    from paratrain.parallel.cp.ulysses import ulysses_attention
    from paratrain.train.runtime import init_runtime, shutdown

    q, k, v = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    seen = []

    def on_collective(call, proceed):
        seen.append((call.purpose, call.dim, call.op, tuple(t.shape for t in call.tensors)))
        return proceed()

    init_runtime("cpu", 60)
    handle = Hooks().on_collective(on_collective)
    try:
        out = ulysses_attention(q, k, v, None)
    finally:
        handle.remove()
        shutdown()
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, reference, atol=1e-5)
    assert seen and {s[:3] for s in seen} == {("cp_ulysses", "cp", "all_to_all")}
    assert all(len(shapes) == 2 and shapes[0] == shapes[1] for *_, shapes in seen)
