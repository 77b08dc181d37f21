"""Unit traces composed into parts of any depth and micro-batch, against the same part traced directly, and the
disk cache that keeps them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from paratrain.models.presets import get_preset
from paratrain.plan.costing.compose import Composed
from paratrain.plan.tracing import trace_cache, units
from paratrain.plan.tracing.trace import TraceKey, trace_once

TINY = dataclasses.replace(get_preset("tiny"), tie_embeddings=False)
# (key fields, depth): every unit path the planner composes - parts, AC, TP+SP, CP, autocast, micro-batch 3 from 1, 2
CASES = [
    (dict(micro_batch=3, ac="full", dtype="fp16", device_type="cuda"), 3),
    (dict(micro_batch=2, tp=2, sp=True, ac="selective"), 3),
    # Ulysses copies a tensor at micro-batch >= 2 that is a view at 1: the op lists are aligned, not re-traced
    (dict(micro_batch=3, cp=2, cp_impl="ulysses", dtype="bf16", device_type="cuda"), 2),
    (dict(micro_batch=2, part="middle", dtype="bf16", device_type="cuda"), 3),
    (dict(micro_batch=2, part="last", tp=2), 2),
    (dict(micro_batch=2, part="first", ac="full"), 2),
]


def _compare(composed: Composed, direct, layers: int) -> dict:
    out = {ph: composed.phase(ph, layers).total / direct.phases[ph].total for ph in ("first_mb", "next_mb")}
    out["activations"] = composed.scalar("activations", layers) / direct.activations
    flops = lambda kind, f, b, d: f + b  # noqa: E731
    for phase in ("fwd", "bwd"):
        want = sum(n * (f + b) for _, f, b, n, _ in direct.ops[phase])
        out[phase] = composed.op_sum(phase, layers, flops) / want
    got = sum(p * n for _, p, _, n in composed.comm_at("fwd", layers) + composed.comm_at("bwd", layers))
    out["comm"] = got - sum(p for _, p, _ in direct.comm["fwd"] + direct.comm["bwd"])
    return out


@pytest.mark.parametrize("fields,layers", CASES)
def test_composed_part_equals_the_part_traced_whole(fields, layers):
    """Reference: trace_once, the part with `layers` blocks at the key's micro-batch traced in one piece."""
    key = TraceKey(args=TINY, seq_len=32, **fields)
    got = _compare(Composed(key), trace_once(key, layers), layers)
    assert got.pop("comm") == 0
    assert all(abs(r - 1) < 0.02 for r in got.values()), got


def test_autocast_copies_are_freed_once_per_forward():
    """Without the autocast-exit accounting the composition over-counts every block's low-precision weight copies
    (full AC saves none of them): the check above must catch that."""
    key = TraceKey(args=TINY, micro_batch=2, seq_len=32, ac="full", dtype="fp16", device_type="cuda")
    composed = Composed(key)
    direct = trace_once(key, 4)
    assert abs(composed.phase("first_mb", 4).total / direct.phases["first_mb"].total - 1) < 0.02
    composed.ut.exit_freed = {}
    composed._walks.clear()
    assert composed.phase("first_mb", 4).total / direct.phases["first_mb"].total > 1.03


def test_disk_cache_round_trip_and_recovery(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    key = units.UnitKey(args=TINY, seq_len=32, micro_batch=1)
    first = trace_cache.cached("units", key, lambda: units.trace_units(key), units._decode)
    files = list((tmp_path / "traces").glob("units-*.json"))
    assert len(files) == 1

    def no_trace():
        raise AssertionError("traced again although the cache holds it")

    again = trace_cache.cached("units", key, no_trace, units._decode)
    assert again.segments == first.segments and again.ops == first.ops and again.exit_freed == first.exit_freed
    files[0].write_text("{not json")  # a damaged file is traced again and rewritten
    rebuilt = trace_cache.cached("units", key, lambda: units.trace_units(key), units._decode)
    assert rebuilt.segments == first.segments and json.loads(files[0].read_text())["format"] == trace_cache.FORMAT
    other = dataclasses.replace(key, ac="full")  # another key is another file
    trace_cache.cached("units", other, lambda: units.trace_units(other), units._decode)
    assert len(list((tmp_path / "traces").glob("units-*.json"))) == 2


def test_cache_stays_out_of_the_repository(monkeypatch, tmp_path):
    monkeypatch.delenv("PARATRAIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert trace_cache.cache_dir() == tmp_path / "paratrain" / "traces"


@pytest.mark.parametrize("ac", ["none", "full"])
def test_ring_middle_steps_traced_once_match_the_whole_ring(monkeypatch, ac):
    """Ring attention at cp=8 on a simulated ring of 3 (its middle step weighted cp - 2 = 6 times) records the
    same memory, op totals and collectives as walking all 8 steps; and the weighting is what makes it so."""
    from paratrain.plan.tracing import local_model

    monkeypatch.setenv("PARATRAIN_TRACE_CACHE", "0")
    key = units.UnitKey(args=TINY, seq_len=128, cp=8, cp_impl="ring", ac=ac)

    def summary(ut):
        ops = {k: (sum(o[3] for o in v), sum(o[1] * o[3] for o in v), sum(o[2] * o[3] for o in v))
               for k, v in ut.ops.items()}
        comm = {k: sorted(v) for k, v in ut.comm.items()}
        return ut.segments, ops, comm, len(ut.ops["block/fwd"])

    once = summary(units.trace_units(key))
    monkeypatch.setattr(local_model._RingSteps, "size", 10**6)  # no ring is that large: every step walked
    walked = summary(units.trace_units(key))
    assert once[:3] == walked[:3]
    assert once[3] < walked[3]  # fewer ops recorded: the middle steps were traced once
    assert sum(1 for k, *_ in walked[2]["block/fwd"] if k == "p2p") == 7  # one K/V hop per step but the last


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_optimizer_at_two_blocks_derived_equals_traced(monkeypatch, device_type):
    """A part's optimizer step at 2 blocks is derived (the part at 1 block + a middle part's 1 -> 2 blocks):
    the same state bytes, peak and op totals as tracing it; a broken derivation (one block too few) differs."""
    from paratrain.plan.tracing import trace as tr

    monkeypatch.setenv("PARATRAIN_TRACE_CACHE", "0")
    cost = lambda kind, f, b, d: 1e-5 + b / 1e12 + f / 1e14  # noqa: E731 - a fixed overhead exposes op counts

    def op_total(one):
        return sum(n * cost(kind, f, b, d) for kind, f, b, n, d in one.ops["opt"])

    for part in ("whole", "first", "last"):
        got = tr.trace_optimizer(TINY, part, 2, device_type, 2)
        want = tr._trace_optimizer(TINY, part, 2, device_type, 2)
        assert (got.params, got.optimizer, got.grads) == (want.params, want.optimizer, want.grads)
        assert got.phases["optimizer"] == want.phases["optimizer"]
        assert op_total(got) == pytest.approx(op_total(want), rel=1e-9)
        one = tr.trace_optimizer(TINY, part, 2, device_type, 1)
        wrong = tr._plus_one_block(one, one, one)  # adds no block: must not pass for two
        assert wrong.optimizer != want.optimizer and wrong.phases["optimizer"] != want.phases["optimizer"]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("tp", [1, 2])
def test_last_part_optimizer_derived_equals_traced(monkeypatch, device_type, tp):
    """The last pipeline part's optimizer step at 1 block is derived (whole + middle - first): the same state
    bytes, peak and op totals as tracing it; swapping first and middle (a part without the head) differs."""
    from paratrain.plan.tracing import trace as tr

    monkeypatch.setenv("PARATRAIN_TRACE_CACHE", "0")
    cost = lambda kind, f, b, d: 1e-5 + b / 1e12 + f / 1e14  # noqa: E731 - a fixed overhead exposes op counts

    def op_total(one):
        return sum(n * cost(kind, f, b, d) for kind, f, b, n, d in one.ops["opt"])

    got = tr.trace_optimizer(TINY, "last", tp, device_type, 1)
    want = tr._trace_optimizer(TINY, "last", tp, device_type, 1)
    assert (got.params, got.optimizer, got.grads, got.param_count, got.param_tensors) == (
        want.params, want.optimizer, want.grads, want.param_count, want.param_tensors)
    assert got.phases["optimizer"] == want.phases["optimizer"]
    assert op_total(got) == pytest.approx(op_total(want), rel=1e-9)
    parts = {p: tr.trace_optimizer(TINY, p, tp, device_type, 1) for p in ("whole", "first", "middle")}
    wrong = tr._plus_one_block(parts["whole"], parts["middle"], parts["first"])
    assert wrong.optimizer != want.optimizer and wrong.phases["optimizer"] != want.phases["optimizer"]


def test_first_micro_batch_is_derived_from_the_accumulating_pass(monkeypatch):
    """One traced pass gives both micro-batch kinds (units.py): the first one's live bytes are the accumulating
    one's minus the gradients autograd has not made yet. Checked against trace_once, which runs both kinds; and
    the fault: if no gradient is ever counted as made, the first micro-batch's peak comes out wrong."""
    import torch

    from paratrain.plan.costing.compose import unit_key

    key = TraceKey(args=TINY, seq_len=32, micro_batch=2, ac="selective")
    direct = trace_once(key, 3)
    ut = units.trace_units(unit_key(key, 2))
    # fp32 parameters: every gradient is made once, as big as its parameter
    assert sum(ut.seg("first", u, "bwd").grads_end for u in units.UNITS) == sum(ut.params.values())
    composed = Composed(key)
    composed.ut = ut
    composed._walks.clear()
    good = composed.phase("first_mb", 3)
    assert abs(good.total / direct.phases["first_mb"].total - 1) < 0.02
    assert good.grads == direct.phases["first_mb"].grads > 0

    monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", lambda self, hook: None)
    composed.ut = units.trace_units(unit_key(key, 2))
    composed._walks.clear()
    bad = composed.phase("first_mb", 3)
    assert bad.grads == 0 and abs(bad.total / direct.phases["first_mb"].total - 1) > 0.02  # outside the tolerance
