"""Unit traces: the rank's model traced once with ONE block, cut into segments (pre, block, head) x (forward,
backward) x (first micro-batch, accumulating micro-batch), at micro-batch 1 and 2.

One forward and backward gives both kinds of micro-batch. It runs as an accumulating micro-batch (every
gradient exists before it starts, and autograd adds into it in place). The first micro-batch differs only in
that a parameter's gradient does not exist until autograd makes it: autograd hands the freshly computed
gradient over as `.grad` where the accumulating pass adds it in and frees it, so at any moment its live bytes
are the accumulating pass's minus the gradients of the parameters not yet reached. Both timelines are read at
every op, so each segment's peak, end and gradient bytes are exact for both (one pass instead of two: half
the trace time).

A part of any depth and any micro-batch is then composed from the segments (compose.py): the embedding, L
identical blocks and the head run forward in order and backward in reverse, so a phase's peak is the highest
(live bytes before a segment + that segment's own peak) along the walk. Every quantity a segment records is
linear in the micro-batch, so micro-batches 1 and 2 give any other.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

from paratrain.models.args import ModelArgs

UNITS = ("pre", "block", "head")


@dataclass(frozen=True)
class UnitKey:
    """What one rank's block, embedding and head do: everything but depth, pipeline part and micro-batch."""

    args: ModelArgs
    seq_len: int = 64  # global sequence length
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_impl: str = "ring"
    ac: str = "none"
    dtype: str = "fp32"
    device_type: str = "cpu"
    micro_batch: int = 1  # the traced micro-batch (1 and 2; others are interpolated)
    loss_parallel: bool = False  # TP logits stay vocab-sharded into the loss (no pipeline), as the trainer runs
    ep: int = 1  # --ep: the rank computes its E/ep experts (moe_trace.py)
    lora: tuple = ()  # LoRA adapters on a frozen base (lora_trace.py TracedLora); () without


@dataclass
class Segment:
    peak: float = 0.0  # highest live bytes above the segment's start
    end: float = 0.0  # live bytes at its end minus at its start
    grads_peak: float = 0.0  # gradient bytes at that peak minus at the start
    grads_end: float = 0.0
    mark: float = 0.0  # head backward only: live bytes above the start once the logits' gradient exists


@dataclass
class UnitTrace:
    micro_batch: int
    params: dict = field(default_factory=dict)  # unit -> parameter bytes
    param_count: dict = field(default_factory=dict)
    param_tensors: dict = field(default_factory=dict)  # of those, the ones that train
    trainable: dict = field(default_factory=dict)  # unit -> bytes of the parameters that train (LoRA: adapters)
    segments: dict = field(default_factory=dict)  # "pass/unit/dir" -> Segment
    ops: dict = field(default_factory=dict)  # "unit/phase" -> [(kind, flops, bytes, count, dtensor)]
    comm: dict = field(default_factory=dict)  # "unit/phase" -> [(kind, payload, group)]
    block_out: int = 0  # bytes of a block's output (what a pipeline stage sends)
    exit_freed: dict = field(default_factory=dict)  # unit -> bytes freed when the forward leaves autocast

    def seg(self, pas: str, unit: str, direction: str) -> Segment:
        return self.segments.get(f"{pas}/{unit}/{direction}", Segment())


class MixedPrecisionOps:
    """Tags the ops autocast's mixed precision adds around fp32 parameters, by what they touch: a cast of a
    parameter to the compute dtype ("weight_cast": every use, every micro-batch, again in a recomputation), the
    cast of a low-precision gradient back to the parameter's fp32 ("grad_cast") and its addition into the
    accumulated fp32 gradient ("grad_accumulate"). They are priced as memory-bound ops like the rest; the time
    model leaves them out for a run that holds its weights in the compute dtype (plan --half-weights)."""

    def __init__(self):
        self.params: set[int] = set()
        self.grads: set[int] = set()
        # storage of a cast's fp32 output -> (that storage, weakly; its entry): an id is reused once the storage
        # dies, so an entry counts only for the storage it was made for
        self.casts: dict[int, tuple] = {}

    def watch(self, params) -> None:
        from paratrain.plan.tracing.tracker import storages_of

        self.params = {id(st) for p in params for st in storages_of(p)}
        self.grads = {id(st) for p in params for st in storages_of(p.grad)}

    def tag(self, func, args, out, entries: list) -> None:
        import torch

        from paratrain.plan.tracing.tracker import storages_of

        if not self.params or not args or not isinstance(args[0], torch.Tensor):
            return
        name = func.overloadpacket.__name__
        first = {id(st) for st in storages_of(args[0])}
        if name == "_to_copy" and first & self.params:
            self._retag(entries, len(entries) - 1, "weight_cast")
        elif name == "_to_copy" and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            for st in storages_of(out):
                self.casts[id(st)] = (weakref.ref(st), entries, len(entries) - 1)
        elif name in ("add_", "copy_") and first & self.grads:
            self._retag(entries, len(entries) - 1, "grad_accumulate")
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                for st in storages_of(args[1]):
                    ref, *cast = self.casts.pop(id(st), (None,))
                    if ref is not None and ref() is st:
                        self._retag(*cast, "grad_cast")

    @staticmethod
    def _retag(entries: list, i: int, kind: str) -> None:
        if entries[i][0] == "mem":
            entries[i] = (kind, *entries[i][1:])


def _unit_of_params(model) -> dict[str, list]:
    block = list(model.layers.values())[0]
    block_ids = {id(p) for p in block.parameters()}
    head_mods = [m for m in (model.norm, model.output) if m is not None]
    head_ids = {id(p) for m in head_mods for p in m.parameters()}
    out: dict[str, list] = {u: [] for u in UNITS}
    for p in model.parameters():
        out["block" if id(p) in block_ids else "head" if id(p) in head_ids else "pre"].append(p)
    return out


def trace_units(key: UnitKey) -> UnitTrace:
    """Trace embedding + one block + head, forward and backward, for two micro-batches (the second
    accumulates into existing gradients), cutting the live-bytes timeline at each unit's boundaries."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_leaves

    from paratrain.plan.tracing.local_model import CommLog, build_local_model
    from paratrain.plan.tracing.trace import op_recorder, quiet_logs
    from paratrain.plan.tracing.tracker import LiveTensorTracker, storages_of
    from paratrain.train.step import autocast_context, lm_loss

    result = UnitTrace(micro_batch=key.micro_batch)
    log = CommLog()
    seq_local = key.seq_len // key.cp
    state = {"phase": None, "unit": "pre"}
    flat: dict[str, list] = {"fwd": [], "bwd": [], "opt": []}
    ops: dict[str, list] = {}
    log.dtensor = {} if key.tp > 1 else None
    record = op_recorder(flat, state, log, key.device_type == "cpu")
    precision = MixedPrecisionOps()

    # storage id -> (the storage, weakly; the unit whose op created it). An id is reused once its storage dies,
    # so an entry only counts for the storage it was made for
    born: dict[int, tuple] = {}

    def hook(func, args, kwargs, out):  # route each op to its unit's list
        before = len(flat[state["phase"]]) if state["phase"] else 0
        record(func, args, kwargs, out)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in storages_of(t):
                    seen = born.get(id(st))
                    if seen is None or seen[0]() is not st:
                        born[id(st)] = (weakref.ref(st), state["unit"])
        if state["phase"] and len(flat[state["phase"]]) > before:
            entries = ops.setdefault(f"{state['unit']}/{state['phase']}", [])
            entries.append(flat[state["phase"]].pop())
            precision.tag(func, args, out, entries)
        sample_first()

    with quiet_logs(), FakeTensorMode(allow_non_fake_inputs=True):
        model = build_local_model(key.args, 1, "whole", key.tp, key.sp, key.cp, key.cp_impl, key.ac, log,
                                  loss_parallel=key.loss_parallel, ep=key.ep, lora=key.lora)
        groups = _unit_of_params(model)
        params = [p for p in model.parameters() if p.requires_grad]
        tracker = LiveTensorTracker(op_hook=hook, resync=False)
        cut = {"live": 0, "name": None}
        # the first micro-batch's timeline: bytes of the gradients it would not have made yet, and its peak
        missing = {"bytes": 0, "params": set()}
        first = {"peak": 0, "missing_at_peak": 0}

        def first_live() -> int:
            return tracker.current - missing["bytes"]

        def sample_first() -> None:  # after every op, where the tracker samples its own peak
            if first_live() > first["peak"]:
                first.update(peak=first_live(), missing_at_peak=missing["bytes"])

        def made(p) -> None:  # autograd has accumulated p's gradient: the first micro-batch now holds it too
            if id(p) in missing["params"]:
                missing["params"].discard(id(p))
                missing["bytes"] -= tracker.bytes_of([p.grad])

        def boundary(name: str | None) -> None:
            """Close the open segment (if any) and open `name`."""
            if cut["name"] is not None:
                # the accumulating micro-batch's gradients all exist from the start and grow in place: no
                # gradient bytes appear within its segments (grads_peak = grads_end = 0)
                result.segments[f"next/{cut['name']}"] = Segment(
                    peak=tracker.peak - cut["live"], end=tracker.current - cut["live"], mark=cut["mark"])
                result.segments[f"first/{cut['name']}"] = Segment(
                    peak=first["peak"] - cut["first_live"], end=first_live() - cut["first_live"],
                    grads_peak=cut["missing"] - first["missing_at_peak"], grads_end=cut["missing"] - missing["bytes"],
                    mark=cut["first_mark"])
            tracker.reset_peak()
            first.update(peak=first_live(), missing_at_peak=missing["bytes"])
            cut.update(live=tracker.current, name=name, mark=0.0, first_live=first_live(),
                       missing=missing["bytes"], first_mark=0.0)
            if name is not None:
                unit, direction = name.split("/")
                state["unit"] = unit
                log.unit = unit

        block = list(model.layers.values())[0]

        def block_pre(mod, args):
            boundary("block/fwd")
            x = args[0]
            if key.lora and isinstance(x, torch.Tensor) and not x.requires_grad:
                # a frozen embedding hands the first block an input without a gradient; every later block's
                # input carries one (an earlier block's adapters), so the traced block stands for those
                x = x.detach().requires_grad_()
                x.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))
                args = (x, *args[1:])
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda g: boundary("pre/bwd"))
            return args

        def block_post(mod, args, out):
            result.block_out = out.numel() * out.element_size()
            boundary("head/fwd")
            out.register_hook(lambda g: boundary("block/bwd"))

        def at_logits_grad(g):
            cut.update(mark=tracker.current - cut["live"], first_mark=first_live() - cut["first_live"])

        def logits_post(mod, args, out):
            out.register_hook(at_logits_grad)

        block.register_forward_pre_hook(block_pre)
        block.register_forward_hook(block_post)
        if model.output is not None:
            model.output.register_forward_hook(logits_post)

        with tracker:
            tracker.track(list(model.parameters()) + list(model.buffers()))
            for unit, ps in groups.items():
                result.params[unit] = tracker.bytes_of(ps)
                result.param_count[unit] = sum(p.numel() for p in ps)
                result.param_tensors[unit] = sum(p.requires_grad for p in ps)
                result.trainable[unit] = tracker.bytes_of([p for p in ps if p.requires_grad])
            for p in params:  # the accumulating micro-batch's gradients, there before it starts
                p.grad = torch.zeros_like(p)
                missing["params"].add(id(p))
                missing["bytes"] += tracker.bytes_of([p.grad])
                p.register_post_accumulate_grad_hook(made)
            precision.watch(params)
            log.active = True
            boundary("pre/fwd")
            state["phase"], log.phase = "fwd", "fwd"
            inputs = torch.zeros((key.micro_batch, seq_local), dtype=torch.long)
            positions = torch.arange(seq_local)
            with autocast_context("cpu", key.dtype):
                out = model(inputs, positions=positions)
                inside = tracker.live_sizes()
            # leaving autocast frees its cached low-precision weight copies (those no op saved for the backward):
            # each unit's share, freed once for all blocks at the end of the forward
            after = tracker.live_sizes()
            for k, nbytes in inside.items():
                if k not in after:
                    unit = born.get(k, (None, "pre"))[1]
                    result.exit_freed[unit] = result.exit_freed.get(unit, 0) + nbytes
            targets = torch.zeros((key.micro_batch, seq_local), dtype=torch.long)
            loss = lm_loss(out, targets)
            boundary("head/bwd")
            state["phase"], log.phase = "bwd", "bwd"
            loss.backward()
            del loss, targets, out, inputs
            boundary(None)
            state["phase"] = None
    result.ops = ops
    result.comm = {k: list(v) for k, v in log.by_unit.items()}
    return result


def _decode(doc: dict) -> UnitTrace:
    ut = UnitTrace(**{k: v for k, v in doc.items() if k not in ("segments", "ops", "comm")})
    ut.segments = {k: Segment(**v) for k, v in doc["segments"].items()}
    ut.ops = {k: [tuple(op) for op in v] for k, v in doc["ops"].items()}
    ut.comm = {k: [tuple(c) for c in v] for k, v in doc["comm"].items()}
    return ut


@functools.lru_cache(maxsize=512)
def unit_trace(key: UnitKey) -> UnitTrace:
    """The unit trace for `key`, from memory, the disk cache, or traced now."""
    from paratrain.plan.tracing.trace_cache import cached

    return cached("units", key, lambda: trace_units(key), _decode)
