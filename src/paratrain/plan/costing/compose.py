"""A pipeline part of any depth and micro-batch, composed from unit traces (units.py).

The part runs its units forward in order (embedding, L identical blocks, head) and backward in reverse; a
phase's peak is the highest (live bytes before a segment + that segment's own peak) on the walk. Parts without
the embedding hold the received activation instead; parts without the head receive their output's gradient.
Every traced quantity is linear in the micro-batch, so traces at micro-batch 1 and 2 give any other.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass

from paratrain.plan.tracing.trace import PhasePeak, TraceKey, quiet_logs, trace_optimizer
from paratrain.plan.tracing.units import Segment, UnitKey, UnitTrace, unit_trace


def unit_key(key: TraceKey, micro_batch: int) -> UnitKey:
    return UnitKey(args=key.args, seq_len=key.seq_len, tp=key.tp, sp=key.sp, cp=key.cp, cp_impl=key.cp_impl,
                   ac=key.ac, dtype=key.dtype, device_type=key.device_type, micro_batch=micro_batch,
                   loss_parallel=key.part == "whole" and key.tp > 1, ep=key.ep)


def _lerp(a: float, b: float, t: float) -> float:
    return a + t * (b - a)


def _aligned(a: list, b: list, sig) -> list[tuple]:
    """Pairs (x, y) of the entries of two traced lists that are the same op; an op only one size records (a
    copy that is a no-op view at micro-batch 1, a tile more) is paired with None."""
    if len(a) == len(b) and all(sig(x) == sig(y) for x, y in zip(a, b)):
        return list(zip(a, b))
    out = []
    matcher = difflib.SequenceMatcher(None, [sig(x) for x in a], [sig(y) for y in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out += zip(a[i1:i2], b[j1:j2])
        else:
            out += [(x, None) for x in a[i1:i2]] + [(None, y) for y in b[j1:j2]]
    return out


def _lerp_entries(pairs: list[tuple], t: float, numeric: tuple[int, ...]) -> list[tuple]:
    """Interpolate the numeric fields of aligned entries; a missing side counts as zero."""
    out = []
    for x, y in pairs:
        ref = x if x is not None else y
        vals = list(ref)
        for i in numeric:
            vals[i] = max(0.0, _lerp(x[i] if x is not None else 0.0, y[i] if y is not None else 0.0, t))
        out.append(tuple(vals))
    return out


def interpolate(u1: UnitTrace, u2: UnitTrace, b: int) -> UnitTrace:
    """Every traced quantity is linear in the micro-batch: the trace at b from those at 1 and 2."""
    if b == u1.micro_batch:
        return u1
    if b == u2.micro_batch:
        return u2
    t = (b - u1.micro_batch) / (u2.micro_batch - u1.micro_batch)
    segs = {k: Segment(*(_lerp(x, y, t) for x, y in zip(dataclasses.astuple(s), dataclasses.astuple(u2.segments[k]))))
            for k, s in u1.segments.items()}
    ops = {k: _lerp_entries(_aligned(lst, u2.ops.get(k, []), lambda o: (o[0], o[3], o[4])), t, (1, 2))
           for k, lst in u1.ops.items()}
    comm = {k: _lerp_entries(_aligned(lst, u2.comm.get(k, []), lambda c: (c[0], c[2])), t, (1,))
            for k, lst in u1.comm.items()}
    freed = {k: _lerp(v, u2.exit_freed.get(k, 0), t) for k, v in u1.exit_freed.items()}
    return UnitTrace(micro_batch=b, params=u1.params, param_count=u1.param_count, param_tensors=u1.param_tensors,
                     segments=segs, ops=ops, comm=comm, block_out=round(_lerp(u1.block_out, u2.block_out, t)),
                     exit_freed=freed)


@dataclass
class Walk:
    total: float
    grads: float
    activations: float = 0.0
    block_fwd_mark: float = 0.0
    block_bwd_mark: float = 0.0
    head_bwd_mark: float = 0.0
    head_peak: float = 0.0  # the highest live bytes in the head's forward (the loss) and backward


def walk(ut: UnitTrace, part: str, layers: int, pas: str) -> Walk:
    """One micro-batch's forward then backward through the part; the highest live bytes on the way."""
    has_pre, has_head = part in ("whole", "first"), part in ("whole", "last")
    io = ut.block_out
    grads_all = sum(ut.seg("first", u, "bwd").grads_end * n for u, n in counts(part, layers).items())
    live = params_of(ut, part, layers) + (grads_all if pas == "next" else 0.0) + (0 if has_pre else io)
    grads = grads_all if pas == "next" else 0.0
    w = Walk(total=live, grads=grads)

    def step(unit: str, direction: str):
        nonlocal live, grads
        s = ut.seg(pas, unit, direction)
        if live + s.peak > w.total:
            w.total, w.grads = live + s.peak, grads + s.grads_peak
        live += s.end
        grads += s.grads_end
        return s

    start = live
    if has_pre:
        step("pre", "fwd")
    for _ in range(layers):
        w.block_fwd_mark = max(w.block_fwd_mark, live)
        step("block", "fwd")
    # the other blocks' autocast weight copies live until the forward leaves autocast (in the head's segment)
    others = (layers - 1) * ut.exit_freed.get("block", 0.0)
    if has_head:
        w.head_peak = live + ut.seg(pas, "head", "fwd").peak
        step("head", "fwd")
        live -= others
    else:
        live -= layers * ut.exit_freed.get("block", 0.0) + (ut.exit_freed.get("pre", 0.0) if has_pre else 0.0)
    w.activations = live - start
    if has_head:
        w.head_bwd_mark = live + ut.seg(pas, "head", "bwd").mark
        w.head_peak = max(w.head_peak, live + ut.seg(pas, "head", "bwd").peak)
        step("head", "bwd")
    else:
        live += io  # the gradient received from the next stage
        w.total = max(w.total, live)
    for _ in range(layers):
        w.block_bwd_mark = max(w.block_bwd_mark, live)
        step("block", "bwd")
    if has_pre:
        step("pre", "bwd")
    return w


def counts(part: str, layers: int) -> dict[str, int]:
    return {"pre": int(part in ("whole", "first")), "block": layers, "head": int(part in ("whole", "last"))}


def params_of(ut: UnitTrace, part: str, layers: int) -> float:
    return sum(ut.params[u] * n for u, n in counts(part, layers).items())


class Composed:
    """The Trace interface memory.py and time.py read, composed from unit traces at any depth."""

    def __init__(self, key: TraceKey):
        self.key = key
        if key.micro_batch in (1, 2):  # a traced size: the other one is not needed (nor traced)
            self.ut = unit_trace(unit_key(key, key.micro_batch))
        else:  # ops that only one traced size records (a copy that is a view at 1) are aligned and interpolated
            self.ut = interpolate(unit_trace(unit_key(key, 1)), unit_trace(unit_key(key, 2)), key.micro_batch)
        self._walks: dict = {}
        self._sums: dict = {}

    def _walk(self, layers: int, pas: str) -> Walk:
        k = (layers, pas)
        if k not in self._walks:
            self._walks[k] = walk(self.ut, self.key.part, layers, pas)
        return self._walks[k]

    @functools.cached_property
    def io_bytes(self) -> int:
        return self.ut.block_out

    def per_block_params(self) -> float:
        return self.ut.params["block"]

    def unit_params(self, unit: str) -> float:
        """Parameter bytes of one unit ("pre", "block" or "head"), 0 where this part has none."""
        return self.ut.params[unit] * counts(self.key.part, 1)[unit]

    def _opt(self, layers: int):
        lo = trace_optimizer(self.key.args, self.key.part, self.key.tp, self.key.device_type, 1)
        hi = trace_optimizer(self.key.args, self.key.part, self.key.tp, self.key.device_type, 2)
        return lo, hi, layers - 1

    def scalar(self, name: str, layers: int) -> float:
        c = counts(self.key.part, layers)
        if name == "params":
            return params_of(self.ut, self.key.part, layers)
        if name == "grads":
            return sum(self.ut.seg("first", u, "bwd").grads_end * n for u, n in c.items())
        if name == "param_tensors":
            return sum(self.ut.param_tensors[u] * n for u, n in c.items())
        if name == "param_count":
            return sum(self.ut.param_count[u] * n for u, n in c.items())
        if name == "optimizer":
            lo, hi, k = self._opt(layers)
            return lo.optimizer + k * (hi.optimizer - lo.optimizer)
        if name in ("activations", "block_fwd_mark", "block_bwd_mark", "head_bwd_mark", "head_peak"):
            return getattr(self._walk(layers, "first"), name)
        raise KeyError(name)

    def phase(self, name: str, layers: int) -> PhasePeak:
        if name == "optimizer":
            lo, hi, k = self._opt(layers)
            return lo.phases["optimizer"].scaled(hi.phases["optimizer"], k)
        w = self._walk(layers, "first" if name == "first_mb" else "next")
        P, OPT = self.scalar("params", layers), self.scalar("optimizer", layers)
        return PhasePeak(total=round(w.total + OPT), params=round(P), grads=round(w.grads), optimizer=round(OPT),
                         rest=round(w.total - P - w.grads))

    def op_sum(self, phase: str, layers: int, cost, cost_id=None) -> float:
        if phase == "opt":
            lo, hi, k = self._opt(layers)
            a = sum(n * cost(kd, f, b, d) for kd, f, b, n, d in lo.ops["opt"])
            b_ = sum(n * cost(kd, f, b, d) for kd, f, b, n, d in hi.ops["opt"])
            return a + k * (b_ - a)
        total = 0.0
        for unit, n in counts(self.key.part, layers).items():
            if not n:
                continue
            ck = (unit, phase, cost_id)
            s = self._sums.get(ck) if cost_id is not None else None
            if s is None:
                s = sum(m * cost(kd, f, b, d) for kd, f, b, m, d in self.ut.ops.get(f"{unit}/{phase}", []))
                if cost_id is not None:
                    self._sums[ck] = s
            total += n * s
        return total

    def comm_at(self, phase: str, layers: int) -> list:
        out = []
        for unit, n in counts(self.key.part, layers).items():
            out += [(k, p, g, n) for k, p, g in self.ut.comm.get(f"{unit}/{phase}", [])] if n else []
        return out


def trace(key: TraceKey, layers: int | None = None):
    """The rank's step for a part of any depth and micro-batch, composed from unit traces (below); the
    accessors take the depth. Traced once per unit key, cached in memory and on disk (trace_cache.py)."""
    return _composed(key)


@functools.lru_cache(maxsize=4096)
def _composed(key: TraceKey):
    with quiet_logs():
        return Composed(key)
