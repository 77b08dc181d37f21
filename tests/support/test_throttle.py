"""The test throttle (support/throttle.py): its setting's parser, and that it stretches measured compute when
attached through the around_compute hook."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.train.data import BatchSource, SyntheticMarkov
from paratrain.train.hooks import Hooks
from paratrain.train.step import PlainStep
from support.throttle import SLOWDOWN_ENV, Throttle, attach, plugin, rank_slowdown


def test_slowdown_setting_names_ranks_and_refuses_bad_entries(monkeypatch):
    monkeypatch.setenv(SLOWDOWN_ENV, "1:3, 2:1.5")
    assert (rank_slowdown(0), rank_slowdown(1), rank_slowdown(2)) == (1.0, 3.0, 1.5)
    for bad in ("1", "x:2", "1:0.5"):
        monkeypatch.setenv(SLOWDOWN_ENV, bad)
        with pytest.raises(UserError, match=SLOWDOWN_ENV):
            rank_slowdown(1)
        with pytest.raises(UserError, match=SLOWDOWN_ENV):  # the plugin refuses it when it loads
            plugin(Hooks())


def test_throttle_stretches_measured_compute(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 64))
    batch = BatchSource(SyntheticMarkov(64, 64, seed=0), 8, 0, 1, 8).next_step()

    def fastest(throttle) -> float:
        hooks = Hooks()
        attach(hooks, throttle)
        runner = PlainStep(model, torch.device("cpu"), "fp32", False, hooks=hooks)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            runner.forward_backward(batch)
            times.append(time.perf_counter() - t0)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the throttle's CPU clock counts this thread: one compute thread, as in rank runs
    try:
        throttle = Throttle(3.0, "cpu")
        plain, slowed = fastest(None), fastest(throttle)
        with pytest.raises(UserError, match="OMP_NUM_THREADS=1"):
            torch.set_num_threads(2)
            Throttle.for_rank(0, "cpu", "0:2")
    finally:
        torch.set_num_threads(threads)
    assert slowed >= 1.5 * plain and throttle.slept_s > 0, (plain, slowed)
