"""Planning pauses Python's cyclic garbage collector (plan/gc_pause.py) and gives it back as it found it."""

from __future__ import annotations

import gc

import pytest

from paratrain.plan import plan_report
from paratrain.plan.gc_pause import gc_paused


def test_plan_document_searches_with_the_collector_paused_and_restores_it(monkeypatch):
    seen = []

    def fake_search(*args, **kwargs):
        seen.append(gc.isenabled())
        raise RuntimeError("stop after the search")

    monkeypatch.setattr(plan_report, "search_all", fake_search)
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="stop after the search"):
        plan_report.plan_document(None, None, {})
    assert seen == [False]
    assert gc.isenabled()  # re-enabled although the search raised


def test_a_caller_that_had_it_off_keeps_it_off():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
