"""The live-tensor tracker, and the planner's fake-tensor trace against the same step on real tensors."""

from __future__ import annotations

import contextlib

import torch

from paratrain.models.presets import get_preset
from paratrain.plan.costing import compose
from paratrain.plan.tracing import trace as trace_mod
from paratrain.plan.tracing.tracker import LiveTensorTracker


def test_tracker_counts_storages_once_and_frees_them():
    with LiveTensorTracker() as mem:
        a = torch.empty(1000)  # 4000 bytes
        views = [a[:10], a.view(10, 100)]  # views share the storage: no new bytes
        assert mem.current == 4000
        b = a * 2
        assert mem.current == 8000 and mem.peak == 8000
        del b
        assert mem.current == 4000
        mem.reset_peak()
        c = torch.ones(250)
        assert mem.peak == 5000
        del a, views, c
    assert mem.current == 0


def test_tracker_sees_backward_and_preexisting_tensors():
    w = torch.randn(64, 64, requires_grad=True)
    with LiveTensorTracker() as mem:
        mem.track([w])
        x = torch.randn(8, 64)
        (x @ w).sum().backward()
    assert mem.bytes_of([w.grad]) == 64 * 64 * 4
    assert mem.peak >= 2 * 64 * 64 * 4  # weight and its gradient at once


def test_fake_trace_equals_real_tensors():
    """Reference: the same traced step run on real CPU tensors (FakeTensorMode replaced by a no-op)."""
    key = trace_mod.TraceKey(args=get_preset("tiny"), micro_batch=2, seq_len=32, tp=2, sp=True, ac="selective",
                             accumulate=True)
    fake = trace_mod.trace_once(key, 1)
    import torch._subclasses.fake_tensor as fake_tensor

    saved = fake_tensor.FakeTensorMode
    fake_tensor.FakeTensorMode = lambda **kwargs: contextlib.nullcontext()
    try:
        trace_mod.trace_optimizer.cache_clear()
        real = trace_mod.trace_once(key, 1)
    finally:
        fake_tensor.FakeTensorMode = saved
        trace_mod.trace_optimizer.cache_clear()
    for name in ("first_mb", "next_mb", "optimizer"):
        assert fake.phases[name] == real.phases[name], name
    assert fake.activations == real.activations and fake.comm == real.comm
    assert [op[:4] for op in fake.ops["fwd"]] == [op[:4] for op in real.ops["fwd"]]


def test_trace_extends_linearly_in_layers():
    """Reference: a 4-layer trace; the planner traces 1 and 2 layers and extends."""
    key = trace_mod.TraceKey(args=get_preset("small"), micro_batch=2, seq_len=64)
    extended = compose.trace(key, 4)
    direct = trace_mod.trace_once(key, 4)
    for name in ("first_mb", "optimizer"):
        assert abs(extended.phase(name, 4).total / direct.phases[name].total - 1) < 0.01
    assert abs(extended.scalar("activations", 4) / direct.activations - 1) < 0.01
