"""Trace one rank's training step on fake tensors: memory at each phase's peak, every op's FLOPs and bytes,
and the collectives it issues. This is how the planner sees the *actual* model, not a formula.

A trace runs the rank's local model (local_model.py) under FakeTensorMode (shapes only, nothing computed) and a
LiveTensorTracker, recording every op and collective. The planner traces units (units.py: embedding, ONE block,
head, at micro-batch 1 and 2) and composes any depth, pipeline part and micro-batch from them (compose.py);
`trace_once` traces a whole part directly (the reference the composition is tested against). The optimizer
step is traced separately, per pipeline part, at 1 and 2 blocks (linear in the depth).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paratrain.models.args import ModelArgs

# torch and the traced code are imported by the functions that trace: a plan answered from the trace cache
# (compose.py reads the records below) never imports torch
if TYPE_CHECKING:
    import torch

    from paratrain.plan.tracing.local_model import CommLog
    from paratrain.plan.tracing.tracker import LiveTensorTracker

PHASES = ("first_mb", "next_mb", "optimizer")
# view / metadata ops: dispatcher overhead, no kernel and no memory traffic
_VIEW_NAMES = {"device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "slice", "select",
               "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk",
               "_reshape_alias", "unflatten", "view_as_real", "lift_fresh", "empty", "empty_like", "new_empty",
               "empty_strided", "new_empty_strided", "_local_scalar_dense"}
_MATMUL_NAMES = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
_ATTN_FWD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
_ATTN_BWD = {n + "_backward" for n in _ATTN_FWD}
_GATHER_NAMES = {"embedding", "index_select", "gather", "embedding_dense_backward", "index_add", "index_put"}


@dataclass(frozen=True)
class TraceKey:
    args: ModelArgs
    part: str = "whole"  # whole | first | middle | last (pipeline stage contents)
    micro_batch: int = 1
    seq_len: int = 64  # global sequence length
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_impl: str = "ring"
    ac: str = "none"
    dtype: str = "fp32"
    device_type: str = "cpu"  # picks the optimizer flavour the trainer uses (foreach on CPU, fused on CUDA)
    # also trace a second micro-batch accumulating into existing gradients (always on: one key serves layouts
    # with and without accumulation, the first micro-batch's peak is recorded on the way)
    accumulate: bool = True
    ep: int = 1  # --ep: the rank computes its E/ep experts (moe_trace.py)
    lora: tuple = ()  # LoRA adapters on a frozen base (lora_trace.py TracedLora); () without


@dataclass
class PhasePeak:
    """Live bytes at a phase's peak, by kind. rest = activations, temporaries, buffers."""

    total: int = 0
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    rest: int = 0

    def scaled(self, other: PhasePeak, k: float) -> PhasePeak:
        """self + k * (other - self), field by field (linear extension in the layer count)."""
        return PhasePeak(*(round(a + k * (b - a)) for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple:
        return (self.total, self.params, self.grads, self.optimizer, self.rest)


@dataclass
class OneTrace:
    layers: int
    params: int = 0
    optimizer: int = 0
    grads: int = 0
    activations: int = 0  # live bytes one micro-batch's forward leaves behind (saved for backward + output)
    phases: dict[str, PhasePeak] = field(default_factory=dict)
    # phase -> [(kind, flops, bytes, count, dtensor)]: `count` identical ops (a loop traced once); dtensor: the
    # op would run on DTensors (TP), paying DTensor's dispatch
    ops: dict[str, list[tuple[str, float, float, int, bool]]] = field(default_factory=dict)
    comm: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)  # "fwd"/"bwd" -> collectives
    param_count: int = 0
    param_tensors: int = 0
    io_bytes: int = 0  # one micro-batch's stage output (what a pipeline stage sends)
    # live bytes when a parameter group's forward / backward starts (FSDP gathers that group there):
    # the largest over blocks, and at the output head's backward
    block_fwd_mark: int = 0
    block_bwd_mark: int = 0
    head_bwd_mark: int = 0


# -- op accounting -----------------------------------------------------------------------------------------------
def _tensor_bytes(x) -> int:
    import torch

    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _attention_flops(q: torch.Tensor, k: torch.Tensor, causal: bool, backward: bool) -> float:
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    flops = 4.0 * b * h * sq * sk * d  # QK^T and PV
    if backward:
        flops *= 2.5  # FlashAttention's backward: recompute QK^T, then dV, dP, dQ, dK
    return flops * (0.5 if causal else 1.0)


def classify_op(func, args, kwargs, out) -> tuple[str, float, float]:
    """(kind, flops, bytes moved) of one aten op. kind: mm | attn | mem | view."""
    import torch
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    name = func.overloadpacket.__name__
    if name in _VIEW_NAMES or getattr(func, "is_view", False):
        return "view", 0.0, 0.0
    leaves_in = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    leaves_out = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
    if name in _ATTN_FWD or name in _ATTN_BWD:
        backward = name in _ATTN_BWD
        q, k = (args[1], args[2]) if backward else (args[0], args[1])
        causal = bool(kwargs.get("is_causal", args[7] if backward and len(args) > 7 else
                                 (args[4] if not backward and len(args) > 4 else False)))
        nbytes = sum(_tensor_bytes(x) for x in leaves_in + leaves_out)
        return "attn", _attention_flops(q, k, causal, backward), nbytes
    out_bytes = sum(_tensor_bytes(x) for x in leaves_out)
    if name in _GATHER_NAMES:
        # a lookup touches the rows it reads, not the whole table
        small_in = sum(_tensor_bytes(x) for x in leaves_in if _tensor_bytes(x) <= out_bytes)
        return "mem", 0.0, 2.0 * out_bytes + small_in
    nbytes = sum(_tensor_bytes(x) for x in leaves_in) + out_bytes
    if out is None and name.endswith("_") and args:  # an in-place foreach op also writes its first list back
        nbytes += sum(_tensor_bytes(x) for x in tree_leaves(args[0]) if isinstance(x, torch.Tensor))
    if name in _MATMUL_NAMES and func.overloadpacket in flop_registry:
        flops = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        return "mm", float(flops), float(nbytes)
    return "mem", 0.0, float(nbytes)


# -- the tracer --------------------------------------------------------------------------------------------------
def _stage_input(key: TraceKey, seq_local: int, dim: int):
    import torch

    if key.part in ("whole", "first"):
        return torch.zeros((key.micro_batch, seq_local), dtype=torch.long)
    # a later pipeline stage receives the previous stage's hidden states (fp32 residual stream)
    return torch.zeros((key.micro_batch, seq_local, dim), dtype=torch.float32, requires_grad=True)


def op_recorder(ops: dict, state: dict, log: CommLog, foreach_per_tensor: bool = False):
    """An op hook that appends (kind, flops, bytes, count, dtensor) per op to ops[state["phase"]].
    foreach_per_tensor: a `_foreach_*` op runs one kernel per tensor of its list (CPU has no multi-tensor
    kernels), so it is recorded as that many ops, each with its share of the bytes."""
    import torch
    from torch.utils._pytree import tree_leaves

    def record(func, args, kwargs, out):
        phase = state["phase"]
        dtensor = False
        if log.dtensor is not None:
            # an op on any would-be DTensor runs through DTensor dispatch and yields DTensors
            dtensor = log.is_dtensor(x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))
            if dtensor:
                for t in tree_leaves(out):
                    log.tag(t)
        if phase is not None and not log.in_comm:
            kind, flops, nbytes = classify_op(func, args, kwargs, out)
            count = log.op_weight
            if foreach_per_tensor and func.overloadpacket.__name__.startswith("_foreach") and args:
                tensors = max(1, sum(isinstance(x, torch.Tensor) for x in tree_leaves(args[0])))
                flops, nbytes, count = flops / tensors, nbytes / tensors, count * tensors
            ops[phase].append((kind, flops, nbytes, count, dtensor))

    return record


@functools.lru_cache(maxsize=256)
def trace_optimizer(args: ModelArgs, part: str, tp: int, device_type: str, layers: int,
                    lora: tuple = ()) -> OneTrace:
    """The optimizer step of one rank's part: its state bytes, the step's peak and ops. It depends only on the
    parameter shapes (and which of them train: `lora`), so every layout with the same TP split shares it (cached
    on disk too)."""
    from paratrain.plan.tracing.trace_cache import cached

    if layers == 2 and part != "middle":
        # a second block adds the same tensors to every part: this part at 1 block plus a middle part's step
        # from 1 to 2 blocks (the planner's two depths: 4 parts cost 5 traces per TP degree, not 8)
        derived = _plus_one_block(trace_optimizer(args, part, tp, device_type, 1, lora),
                                  trace_optimizer(args, "middle", tp, device_type, 1, lora),
                                  trace_optimizer(args, "middle", tp, device_type, 2, lora))
        if derived is not None:
            return derived
    if layers == 1 and part == "last" and not args.tie_embeddings:
        # the last part holds what the whole model holds minus the embedding: whole + middle - first (a search
        # traces the whole model first). Tied: traced as it is, the last part holding its own copy of the table
        # as the head (as the runtime's pipeline does: parallel/tied_weights.py)
        derived = _plus_one_block(trace_optimizer(args, "whole", tp, device_type, 1, lora),
                                  trace_optimizer(args, "first", tp, device_type, 1, lora),
                                  trace_optimizer(args, "middle", tp, device_type, 1, lora))
        if derived is not None:
            return derived
    key = {"args": args, "part": part, "tp": tp, "device_type": device_type, "layers": layers}
    if lora:  # the key without LoRA stays as it was
        key["lora"] = lora
    return cached("optimizer", key, lambda: _trace_optimizer(args, part, tp, device_type, layers, lora), _decode_one)


def _plus_one_block(base: OneTrace, lo: OneTrace, hi: OneTrace) -> OneTrace | None:
    """base + (hi - lo): bytes, peaks and op totals are sums over the parameter tensors, so what one part has
    beyond another (a block, the head) carries to a third. An op entry (kind, flops, bytes, count, dtensor) holds per-op averages
    (a CPU foreach op is `count` per-tensor kernels), so totals are added and averaged again. None when the op
    lists do not line up (then the part is traced)."""
    a, b, c = base.ops["opt"], lo.ops["opt"], hi.ops["opt"]
    if not (len(a) == len(b) == len(c)) or any(
            x[0] != y[0] or y[0] != z[0] or x[4] != y[4] or y[4] != z[4] for x, y, z in zip(a, b, c)):
        return None
    ops = []
    for (kind, fa, ba, na, dt), (_, fb, bb, nb, _), (_, fc, bc, nc, _) in zip(a, b, c):
        n = na + nc - nb
        if n <= 0:
            return None
        ops.append((kind, (fa * na + fc * nc - fb * nb) / n, (ba * na + bc * nc - bb * nb) / n, n, dt))
    out = OneTrace(layers=base.layers + hi.layers - lo.layers)
    for name in ("params", "optimizer", "grads", "param_count", "param_tensors"):
        setattr(out, name, getattr(base, name) + getattr(hi, name) - getattr(lo, name))
    out.phases = {ph: PhasePeak(*(x + z - y for x, y, z in zip(base.phases[ph].astuple(), lo.phases[ph].astuple(),
                                                                 hi.phases[ph].astuple())))
                  for ph in base.phases}
    out.ops = {**{k: list(v) for k, v in base.ops.items()}, "opt": ops}
    out.comm = {k: list(v) for k, v in base.comm.items()}
    return out


def _decode_one(doc: dict) -> OneTrace:
    one = OneTrace(**{k: v for k, v in doc.items() if k not in ("phases", "ops", "comm")})
    one.phases = {k: PhasePeak(**v) for k, v in doc["phases"].items()}
    one.ops = {k: [tuple(op) for op in v] for k, v in doc["ops"].items()}
    one.comm = {k: [tuple(c) for c in v] for k, v in doc["comm"].items()}
    return one


def _trace_optimizer(args: ModelArgs, part: str, tp: int, device_type: str, layers: int,
                     lora: tuple = ()) -> OneTrace:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from paratrain.plan.tracing.local_model import CommLog, build_local_model
    from paratrain.plan.tracing.tracker import LiveTensorTracker
    from paratrain.train.optim import build_optimizer
    from paratrain.train.step import clip_grad_norm

    result = OneTrace(layers=layers)
    ops: dict[str, list] = {"fwd": [], "bwd": [], "opt": []}
    state = {"phase": None}
    log = CommLog()
    log.dtensor = {} if tp > 1 else None
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_local_model(args, layers, part, tp, False, 1, "ring", "none", log, lora=lora)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # under TP every parameter is a DTensor, and so is its optimizer state
            log.tag(p)
        opt = build_optimizer(params, 1e-3, (0.9, 0.95), 0.0, device_type)

        def snapshot() -> dict:
            states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            return {"grads": tracker.bytes_of([p.grad for p in params]), "optimizer": tracker.bytes_of(states)}

        tracker = LiveTensorTracker(on_peak=snapshot,
                                    op_hook=op_recorder(ops, state, log, device_type == "cpu"),
                                    resync=False)
        with tracker:
            tracker.track(list(model.parameters()) + list(model.buffers()))
            result.params = tracker.current
            for p in params:
                p.grad = torch.zeros_like(p)
                log.tag(p.grad)
            opt.step()  # the first step creates the optimizer state, as step 1 of a run does
            result.optimizer = snapshot()["optimizer"]
            result.grads = tracker.bytes_of([p.grad for p in params])
            tracker.reset_peak()
            state["phase"] = "opt"
            clip_grad_norm(params, 1.0)
            opt.step()
            state["phase"] = None
            _store_phase(result, "optimizer", tracker)
    result.ops = ops
    return result


def trace_once(key: TraceKey, layers: int) -> OneTrace:
    """One micro-batch's forward and backward of the rank's part with `layers` blocks, plus its optimizer step."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from paratrain.plan.tracing.local_model import CommLog, build_local_model
    from paratrain.plan.tracing.tracker import LiveTensorTracker
    from paratrain.train.step import autocast_context, lm_loss

    opt_trace = trace_optimizer(key.args, key.part, key.tp, key.device_type, layers, key.lora)
    result = OneTrace(layers=layers, optimizer=opt_trace.optimizer)
    log = CommLog()
    seq_local = key.seq_len // key.cp
    has_head = key.part in ("whole", "last")
    state = {"phase": None}
    ops: dict[str, list] = {"fwd": [], "bwd": [], "opt": opt_trace.ops["opt"]}

    log.dtensor = {} if key.tp > 1 else None
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_local_model(key.args, layers, key.part, key.tp, key.sp, key.cp, key.cp_impl, key.ac, log,
                                  ep=key.ep, lora=key.lora)
        params = [p for p in model.parameters() if p.requires_grad]

        def snapshot() -> dict:
            return {"grads": tracker.bytes_of([p.grad for p in params if p.grad is not None]), "optimizer": 0}

        tracker = LiveTensorTracker(on_peak=snapshot,
                                    op_hook=op_recorder(ops, state, log, key.device_type == "cpu"),
                                    resync=False)
        marking = _mark_groups(model, tracker, result)
        with tracker:
            tracker.track(list(model.parameters()) + list(model.buffers()))
            result.params = tracker.current
            result.param_count = sum(p.numel() for p in model.parameters())
            result.param_tensors = len(params)
            # gradient accumulation: a second micro-batch runs with every gradient already allocated; new
            # gradients are transients added in place (the peak moves, so it is traced, not derived)
            passes = 2 if key.accumulate else 1
            for i in range(passes):
                last = i == passes - 1
                log.active = last
                tracker.reset_peak()
                inputs = _stage_input(key, seq_local, key.args.dim)
                before = tracker.current
                positions = torch.arange(seq_local)
                state["phase"], log.phase = ("fwd" if last else None), "fwd"
                with autocast_context("cpu", key.dtype):
                    out = model(inputs, positions=positions)
                if has_head:
                    targets = torch.zeros((key.micro_batch, seq_local), dtype=torch.long)
                    loss = lm_loss(out, targets)
                if i == 0:
                    result.activations = tracker.current - before
                    result.io_bytes = out.numel() * out.element_size()
                state["phase"], log.phase = ("bwd" if last else None), "bwd"
                if has_head:
                    loss.backward()
                    del loss, targets
                else:
                    out.backward(torch.ones_like(out))
                del out, inputs
                state["phase"] = None
                _store_phase(result, "first_mb" if i == 0 else "next_mb", tracker)
                marking["on"] = False  # marks describe the first micro-batch
            result.grads = tracker.bytes_of([p.grad for p in params if p.grad is not None])
    # the optimizer state exists throughout (it was not built in this trace): add it to the peaks
    for phase in result.phases.values():
        phase.total += result.optimizer
        phase.optimizer = result.optimizer
    if not key.accumulate:
        result.phases["next_mb"] = result.phases["first_mb"]
    result.phases["optimizer"] = opt_trace.phases["optimizer"]
    result.ops = ops
    result.comm = {"fwd": log.fwd, "bwd": log.bwd}
    return result


def _mark_groups(model, tracker: LiveTensorTracker, result: OneTrace) -> dict:
    """Record live bytes where each FSDP parameter group (block, head) starts its forward and backward,
    while the returned switch is on."""
    import torch

    switch = {"on": True}

    def on_grad(attr: str):
        def hook(grad):
            if switch["on"]:
                setattr(result, attr, max(getattr(result, attr), tracker.current))

        return hook

    def watch(module, fwd_attr: str | None, bwd_attr: str):
        def pre(mod, args):
            if fwd_attr and switch["on"]:
                setattr(result, fwd_attr, max(getattr(result, fwd_attr), tracker.current))

        def post(mod, args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(on_grad(bwd_attr))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    for block in model.layers.values():
        watch(block, "block_fwd_mark", "block_bwd_mark")
    if model.output is not None:
        watch(model.output, None, "head_bwd_mark")
    return switch


def _store_phase(result: OneTrace, name: str, tracker: LiveTensorTracker) -> None:
    info = tracker.peak_info or {"grads": 0, "optimizer": 0}
    rest = tracker.peak - result.params - info["grads"] - info["optimizer"]
    result.phases[name] = PhasePeak(tracker.peak, result.params, info["grads"], info["optimizer"], rest)


@contextlib.contextmanager
def quiet_logs():
    """Strategies log one line each when applied; the planner applies them hundreds of times."""
    logger = logging.getLogger("paratrain")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
