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

from paratrain.plan.costing.block_kinds import (
    dense_block_args,
    dense_blocks,
    mixed,
    moe_block_args,
    with_dense_unit,
)
from paratrain.plan.tracing.trace import PhasePeak, TraceKey, quiet_logs, trace_optimizer
from paratrain.plan.tracing.units import Segment, UnitKey, UnitTrace, unit_trace


def unit_key(key: TraceKey, micro_batch: int, args=None) -> UnitKey:
    """The unit trace of `key` at `micro_batch`; `args`: the shape whose one block is traced (block_kinds.py),
    the model's MoE block by default."""
    args = args or moe_block_args(key.args)
    return UnitKey(args=args, seq_len=key.seq_len, tp=key.tp, sp=key.sp, cp=key.cp, cp_impl=key.cp_impl,
                   ac=key.ac, dtype=key.dtype, device_type=key.device_type, micro_batch=micro_batch,
                   loss_parallel=key.part == "whole" and key.tp > 1, ep=key.ep if args.moe else 1, lora=key.lora)


def units_at(key: TraceKey, micro_batch: int) -> UnitTrace:
    """The traced units at a traced micro-batch (1 or 2): the embedding, the block and the head, and a model with
    dense blocks among its MoE ones also its dense block (unit "dense")."""
    ut = unit_trace(unit_key(key, micro_batch))
    if mixed(key.args):
        ut = with_dense_unit(ut, unit_trace(unit_key(key, micro_batch, dense_block_args(key.args))))
    return ut


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
                     trainable=u1.trainable, segments=segs, ops=ops, comm=comm,
                     block_out=round(_lerp(u1.block_out, u2.block_out, t)), exit_freed=freed)


@dataclass
class Walk:
    total: float
    grads: float
    activations: float = 0.0
    block_fwd_mark: float = 0.0
    block_bwd_mark: float = 0.0
    head_bwd_mark: float = 0.0
    head_peak: float = 0.0  # the highest live bytes in the head's forward (the loss) and backward


def walk(ut: UnitTrace, part: str, layers: int, pas: str, kept: GradShares = None, dense: int = 0) -> Walk:
    """One micro-batch's forward then backward through the part; the highest live bytes on the way. `kept`:
    ((unit, share), ...) of a unit's gradients that stay once its backward is done (FSDP reduce-scatters each
    group's gradients after its backward and keeps its shard); None: all of them (as traced). `dense`: of the
    `layers` blocks, how many are the model's dense ones (block_kinds.py; they run first)."""
    has_pre, has_head = part in ("whole", "first"), part in ("whole", "last")
    io = ut.block_out
    share = dict(kept or ())
    blocks = ["dense"] * dense + ["block"] * (layers - dense)
    grads_all = sum(ut.seg("first", u, "bwd").grads_end * n for u, n in counts(part, layers, dense).items())
    live = params_of(ut, part, layers, dense) + (grads_all if pas == "next" else 0.0) + (0 if has_pre else io)
    grads = grads_all if pas == "next" else 0.0
    w = Walk(total=live, grads=grads)
    # FSDP2 keeps a unit's reduce-scatter input (its unsharded gradients, copied in) until the next unit's
    # reduce-scatter is issued, so the unsharded gradients of the unit before stay while one runs
    lag = 0.0

    def step(unit: str, direction: str):
        nonlocal live, grads, lag
        s = ut.seg(pas, unit, direction)
        if live + lag + s.peak > w.total:  # a unit's own gradients are whole while its backward runs
            w.total, w.grads = live + lag + s.peak, grads + lag + s.grads_peak
        dropped = (1.0 - share.get(unit, 1.0)) * s.grads_end
        live += s.end - dropped
        grads += s.grads_end - dropped
        lag = dropped if direction == "bwd" else lag
        return s

    start = live
    if has_pre:
        step("pre", "fwd")
    for unit in blocks:
        w.block_fwd_mark = max(w.block_fwd_mark, live)
        step(unit, "fwd")
    # the blocks' autocast weight copies live until the forward leaves autocast: in the head's segment, which
    # holds the traced block's own
    freed = sum(ut.exit_freed.get(unit, 0.0) for unit in blocks)
    if has_head:
        w.head_peak = live + ut.seg(pas, "head", "fwd").peak
        step("head", "fwd")
        live -= freed - ut.exit_freed.get("block", 0.0)
    else:
        live -= freed + (ut.exit_freed.get("pre", 0.0) if has_pre else 0.0)
    w.activations = live - start
    if has_head:
        w.head_bwd_mark = live + ut.seg(pas, "head", "bwd").mark
        w.head_peak = max(w.head_peak, live + ut.seg(pas, "head", "bwd").peak)
        step("head", "bwd")
    else:
        live += io  # the gradient received from the next stage
        w.total = max(w.total, live)
    for unit in reversed(blocks):
        w.block_bwd_mark = max(w.block_bwd_mark, live + lag)
        step(unit, "bwd")
    if has_pre:
        step("pre", "bwd")
    return w


GradShares = tuple[tuple[str, float], ...] | None  # (unit, share of its gradients a rank keeps), hashable


def counts(part: str, layers: int, dense: int = 0) -> dict[str, int]:
    """How many of each unit a part of `layers` blocks (`dense` of them the model's dense kind) runs."""
    return {"pre": int(part in ("whole", "first")), "dense": dense, "block": layers - dense,
            "head": int(part in ("whole", "last"))}


def params_of(ut: UnitTrace, part: str, layers: int, dense: int = 0) -> float:
    return sum(ut.params.get(u, 0.0) * n for u, n in counts(part, layers, dense).items())


class Composed:
    """The Trace interface memory.py and time.py read, composed from unit traces at any depth."""

    def __init__(self, key: TraceKey):
        self.key = key
        if key.micro_batch in (1, 2):  # a traced size: the other one is not needed (nor traced)
            self.ut = units_at(key, key.micro_batch)
        else:  # ops that only one traced size records (a copy that is a view at 1) are aligned and interpolated
            self.ut = interpolate(units_at(key, 1), units_at(key, 2), key.micro_batch)
        self._walks: dict = {}
        self._sums: dict = {}

    def dense(self, layers: int) -> int:
        """Of this part's `layers` blocks, the model's dense ones (the rest are its MoE, or only, kind)."""
        return dense_blocks(self.key.args, self.key.part, layers)

    def counts(self, layers: int) -> dict[str, int]:
        return counts(self.key.part, layers, self.dense(layers))

    def _walk(self, layers: int, pas: str, kept: GradShares = None) -> Walk:
        k = (layers, pas, kept)
        if k not in self._walks:
            self._walks[k] = walk(self.ut, self.key.part, layers, pas, kept, self.dense(layers))
        return self._walks[k]

    @functools.cached_property
    def io_bytes(self) -> int:
        return self.ut.block_out

    def unit_params(self, unit: str) -> float:
        """Parameter bytes of one unit: "pre" and "head" (0 where this part has none), or one block of a kind
        ("block", "dense": 0 where the model has no such kind)."""
        if unit in ("pre", "head"):
            return self.ut.params[unit] * counts(self.key.part, 1)[unit]
        return self.ut.params.get(unit, 0.0)

    def _opt(self, layers: int, value) -> float:
        """`value` (of a traced optimizer step, trace.py OneTrace) over the part's step: linear in the blocks, the
        MoE (or only) kind's traced at 1 and 2 blocks, each dense block adding the dense kind's share."""
        k = self.key
        lo, hi = (trace_optimizer(moe_block_args(k.args), k.part, k.tp, k.device_type, n, k.lora) for n in (1, 2))
        dense = self.dense(layers)
        total = value(lo) + (layers - dense - 1) * (value(hi) - value(lo))
        if dense:
            one, two = (trace_optimizer(dense_block_args(k.args), "middle", k.tp, k.device_type, n, k.lora)
                        for n in (1, 2))
            total += dense * (value(two) - value(one))
        return total

    def scalar(self, name: str, layers: int, kept: GradShares = None) -> float:
        """A traced quantity of the part at `layers` blocks; `kept` (walk()): the gradients a rank keeps of each
        unit once its backward is done (the marks and gradient bytes under FSDP's reduce-scatter)."""
        c = self.counts(layers)
        share = dict(kept or ())
        if name == "params":
            return params_of(self.ut, self.key.part, layers, self.dense(layers))
        if name == "grads":
            return sum(self.ut.seg("first", u, "bwd").grads_end * n * share.get(u, 1.0) for u, n in c.items())
        if name == "trained_params":  # bytes of the parameters the optimizer steps: all of them, or LoRA's adapters
            if not self.key.lora:
                return params_of(self.ut, self.key.part, layers, self.dense(layers))
            return sum(self.ut.trainable.get(u, 0) * n for u, n in c.items())
        if name == "param_tensors":
            return sum(self.ut.param_tensors.get(u, 0) * n for u, n in c.items())
        if name == "param_count":
            return sum(self.ut.param_count.get(u, 0) * n for u, n in c.items())
        if name == "autocast_freed":  # bytes freed when the forward leaves autocast (copies no op saved)
            return sum(self.ut.exit_freed.get(u, 0.0) * n for u, n in c.items())
        if name == "optimizer":
            return self._opt(layers, lambda t: t.optimizer)
        if name in ("activations", "block_fwd_mark", "block_bwd_mark", "head_bwd_mark", "head_peak"):
            return getattr(self._walk(layers, "first", kept), name)
        raise KeyError(name)

    def phase(self, name: str, layers: int, kept: GradShares = None) -> PhasePeak:
        if name == "optimizer":
            return PhasePeak(*(round(self._opt(layers, lambda t, i=i: t.phases["optimizer"].astuple()[i]))
                               for i in range(5)))
        w = self._walk(layers, "first" if name == "first_mb" else "next", kept)
        P, OPT = self.scalar("params", layers), self.scalar("optimizer", layers)
        return PhasePeak(total=round(w.total + OPT), params=round(P), grads=round(w.grads), optimizer=round(OPT),
                         rest=round(w.total - P - w.grads))

    def op_sum(self, phase: str, layers: int, cost, cost_id=None) -> float:
        if phase == "opt":
            return self._opt(layers, lambda t: sum(n * cost(kd, f, b, d) for kd, f, b, n, d in t.ops["opt"]))
        total = 0.0
        for unit, n in self.counts(layers).items():
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
        for unit, n in self.counts(layers).items():
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
