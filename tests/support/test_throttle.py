"""The test throttle (support/throttle.py): its setting's parser, and that it stretches measured compute when
attached through the around_compute hook."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.train.data.indexed_sets import BatchSource, SyntheticMarkov
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
    """Each micro-batch's measured compute is followed by a pause of (factor - 1) x it; nothing without a throttle.
    The pauses are recorded, not slept, so no speed is asserted."""
    import support.throttle as throttle_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 64))
    micro_batches = BatchSource(SyntheticMarkov(64, 64, seed=0), 8, 0, 1, 4).next_step()
    pauses: list[float] = []
    monkeypatch.setattr(throttle_module.time, "sleep", pauses.append)

    def run(throttle) -> None:
        hooks = Hooks()
        attach(hooks, throttle)
        PlainStep(model, torch.device("cpu"), "fp32", False, hooks=hooks).forward_backward(micro_batches)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the throttle's CPU clock counts this thread: one compute thread, as in rank runs
    try:
        run(None)
        assert pauses == []
        throttle = Throttle(3.0, "cpu")
        run(throttle)
        with pytest.raises(UserError, match="OMP_NUM_THREADS=1"):
            torch.set_num_threads(2)
            Throttle.for_rank(0, "cpu", "0:2")
    finally:
        torch.set_num_threads(threads)
    assert len(pauses) == len(micro_batches) == 2 and all(p > 0 for p in pauses), pauses
    assert sum(pauses) == pytest.approx(throttle.slept_s)
