"""Per-rank memory of a layout: parameters, gradients, optimizer state, activations and the rest, at the peak.

Activations and temporaries come from tracing the actual model (trace.py), shard for shard; this file adds
what the trace does not run, as each technique's memory term says: the data-parallel wrapper (DDP's gradient
buckets, ZeRO-1's optimizer shard, FSDP2's sharded states and the unsharded parameters it gathers:
parallel/dp/dp_memory.py), and the pipeline (micro-batches in flight per schedule, and
torch.distributed.pipelining's per-micro-batch receive buffers).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from paratrain.models.args import ModelArgs
from paratrain.parallel.dims import techniques
from paratrain.parallel.layout import Layout
from paratrain.plan.costing.compose import trace
from paratrain.plan.tracing.lora_trace import traced_lora
from paratrain.plan.tracing.trace import PhasePeak, TraceKey

GIB = 2**30
TRACED_OPTIMIZER_STATES = 2  # the trace's AdamW: two moments per parameter (training_options.optimizer_states)


def model_state_bytes(n_params: float, dp: int, stage: int, k_optimizer: float = 12, param_bytes: float = 2,
                      grad_bytes: float = 2) -> dict[str, float]:
    """Model states per rank (the ZeRO paper, Rajbhandari et al. 2020, section 5): parameters, gradients and
    K bytes of optimizer state per parameter; stage 1 shards the optimizer state, 2 also the gradients,
    3 also the parameters, each over `dp` ranks. Mixed-precision Adam: 2 + 2 + 12 bytes per parameter."""
    p, g, o = param_bytes * n_params, grad_bytes * n_params, k_optimizer * n_params
    if stage >= 1:
        o /= dp
    if stage >= 2:
        g /= dp
    if stage >= 3:
        p /= dp
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


@dataclass
class MemoryEstimate:
    """Bytes on the busiest rank at its peak. The parts add up to `total`."""

    params: float = 0
    grads: float = 0
    optimizer: float = 0
    activations: float = 0
    other: float = 0
    phase: str = ""  # where the peak falls: forward/backward, or the optimizer step
    per_stage: list[dict] = field(default_factory=list)  # pipeline: every stage rank's total
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def parts(self) -> dict[str, int]:
        """The parts and the total in bytes (gib() rounds to 4 decimals)."""
        parts = {k: round(getattr(self, k)) for k in ("params", "grads", "optimizer", "activations", "other")}
        return {**parts, "total": sum(parts.values())}

    def gib(self) -> dict[str, float]:
        parts = {k: getattr(self, k) / GIB for k in ("params", "grads", "optimizer", "activations", "other")}
        return {**{k: round(v, 4) for k, v in parts.items()}, "total": round(self.total / GIB, 4)}


@dataclass
class ChunkMemory:
    """One model part on one rank, after the data-parallel wrapper: persistent states and step peaks."""

    params: float
    optimizer: float
    grads: float  # gradients alive during forward/backward of a later micro-batch (and at the step)
    act_per_mb: float  # activations one in-flight micro-batch keeps for its backward
    fb: PhasePeak  # the forward/backward peak of one micro-batch, traced and adjusted
    opt_rest: float  # optimizer-step temporaries
    extra: float  # resident buffers: unsharded FSDP params held, DDP buckets
    io_in: int
    io_out: int


def traced_shape(args: ModelArgs) -> ModelArgs:
    """The shape a trace depends on: a model's name is not part of it (one config reached by two paths, a
    preset under another name, share their traces)."""
    return dataclasses.replace(args, name="")


def trace_key(args: ModelArgs, layout: Layout, part: str, seq_len: int, dtype: str, device_type: str) -> TraceKey:
    return TraceKey(args=traced_shape(args), part=part, micro_batch=layout.micro_batch, seq_len=seq_len, tp=layout.tp,
                    sp=layout.sp and layout.splits_within_layers, cp=layout.cp, cp_impl=layout.cp_impl, ac=layout.ac,
                    dtype="bf16" if dtype == "fp8" else dtype, device_type=device_type,  # fp8: bf16 activations
                    ep=layout.ep if args.moe else 1, lora=traced_lora(args, layout))


@dataclass
class RankStates:
    """One model part's states on one rank as the techniques' memory terms change them (Technique.shard_states)."""

    params: float
    optimizer: float
    grads: float
    opt_rest: float  # optimizer-step temporaries
    grads_live: float  # gradients alive at the forward/backward peak
    extra: float  # resident buffers
    fb: PhasePeak  # the traced forward/backward peak of one micro-batch
    acts: float = 0.0  # activations one in-flight micro-batch keeps for its backward
    # the share of each unit's gradients the rank keeps once its backward is done (compose.py walk(); FSDP's
    # reduce-scatter), the walk the peak and marks were read from; None: all, as traced
    kept: tuple | None = None


def chunk_memory(args: ModelArgs, layout: Layout, part: str, layers: int, seq_len: int, dtype: str,
                 device_type: str, notes: list[str], optimizer_states: int = TRACED_OPTIMIZER_STATES) -> ChunkMemory:
    tr = trace(trace_key(args, layout, part, seq_len, dtype, device_type), layers)
    P, OPT, G = (tr.scalar(n, layers) for n in ("params", "optimizer", "grads"))
    OPT *= optimizer_states / TRACED_OPTIMIZER_STATES  # --optimizer: the trace steps AdamW
    kept = None
    for technique in techniques():
        kept = technique.kept_gradients(tr, args, layout) or kept
    fb = tr.phase("next_mb" if layout.microbatches > 1 else "first_mb", layers, kept)
    opt = tr.phase("optimizer", layers)
    s = RankStates(params=P, optimizer=OPT, grads=G, opt_rest=max(0.0, opt.rest), grads_live=float(fb.grads),
                   extra=0.0, fb=fb, acts=tr.scalar("activations", layers, kept), kept=kept)
    for technique in techniques():
        technique.shard_states(s, tr, args, layout, part, layers, dtype, notes)
    P, OPT, G, opt_rest, grads_live, extra = s.params, s.optimizer, s.grads, s.opt_rest, s.grads_live, s.extra
    fb = PhasePeak(total=0, params=P, grads=grads_live, optimizer=OPT, rest=fb.rest)
    return ChunkMemory(params=P, optimizer=OPT, grads=G, act_per_mb=s.acts, fb=fb,
                       opt_rest=opt_rest, extra=extra, io_in=tr.io_bytes if part in ("middle", "last") else 0,
                       io_out=tr.io_bytes if part in ("first", "middle") else 0)


def memory_from_chunks(chunks: list[ChunkMemory], in_flight: list[int], microbatches: int,
                       pipelined: bool) -> dict:
    """The rank's peak from its chunks: forward/backward (with micro-batches in flight) vs the optimizer step."""
    params = sum(c.params for c in chunks)
    opt = sum(c.optimizer for c in chunks)
    extra = sum(c.extra for c in chunks)
    buffers = 0.0
    if pipelined:
        # torch.distributed.pipelining allocates one activation receive buffer (non-first stages) and one
        # gradient receive buffer (non-last stages) per micro-batch; the trace already holds one of each
        buffers = sum((microbatches - 1) * (c.io_in + c.io_out) for c in chunks)
    held_acts = sum((k - 1) * c.act_per_mb for c, k in zip(chunks, in_flight))
    fb_grads = sum(c.fb.grads for c in chunks)
    fb_rest = max(c.fb.rest for c in chunks)
    fb_total = params + opt + fb_grads + held_acts + fb_rest + extra + buffers
    grads = sum(c.grads for c in chunks)
    opt_total = params + opt + grads + sum(c.opt_rest for c in chunks) + buffers
    acts_at_peak = held_acts + min(fb_rest, max(c.act_per_mb for c in chunks))
    if fb_total >= opt_total:
        return {"phase": "forward/backward", "params": params, "grads": fb_grads, "optimizer": opt,
                "activations": acts_at_peak, "other": fb_total - params - fb_grads - opt - acts_at_peak}
    return {"phase": "optimizer step", "params": params, "grads": grads, "optimizer": opt, "activations": 0.0,
            "other": opt_total - params - grads - opt}


def stage_layout(args: ModelArgs, layout: Layout, seq_len: int) -> list[tuple[int, str, int]]:
    """(rank, part, layers) of every pipeline stage, split exactly as the runtime splits them."""
    return _stage_layout(traced_shape(args), layout.pp, layout.virtual_stages, seq_len)


@functools.lru_cache(maxsize=256)
def _stage_layout(args: ModelArgs, pp: int, virtual: int, seq_len: int) -> list[tuple[int, str, int]]:
    from paratrain.plan.tracing.trace_cache import (
        cached,  # a meta model costs seconds of imports: cache the split
    )

    key = {"args": args, "pp": pp, "virtual": virtual, "seq_len": seq_len}
    return cached("stages", key, lambda: _split(args, pp, virtual, seq_len), lambda doc: [tuple(x) for x in doc])


@functools.lru_cache(maxsize=2)
def _meta_model(args: ModelArgs):
    """The whole model on the meta device, built once per shape for every pipeline split the search tries
    (split_into_stages only reads its layers' sizes; at 80 layers a build costs ~35 ms)."""
    from paratrain.models.presets import build_model

    return build_model(args, "meta", seed=None)


def _split(args: ModelArgs, pp: int, virtual: int, seq_len: int) -> list[tuple[int, str, int]]:
    from paratrain.parallel.pp.pipeline_split import split_into_stages, stage_ranks

    specs = split_into_stages(_meta_model(args), pp, virtual, seq_len)
    ranks = stage_ranks(pp, len(specs))
    out = []
    for spec in specs:
        part = "whole" if spec.first and spec.last else "first" if spec.first else "last" if spec.last else "middle"
        out.append((ranks[spec.index], part, len(spec.layers)))
    return out


def estimate_memory(args: ModelArgs, layout: Layout, seq_len: int, dtype: str = "bf16",
                    device_type: str = "cuda", optimizer_states: int = TRACED_OPTIMIZER_STATES) -> MemoryEstimate:
    """Peak bytes on the busiest rank of `layout` (device_type picks the optimizer the trainer uses): every stage
    rank's model parts (one part on one rank without a pipeline) with the micro-batches the pipeline's technique
    says it holds in flight."""
    pipeline = next(t for t in techniques() if t.composes_step)
    pipelined = pipeline.enabled(layout)
    notes: list[str] = []
    per_rank: dict[int, list] = {}
    stages = pipeline.stages(layout, args.n_layers, lambda: stage_layout(args, layout, seq_len))
    for index, (rank, part, layers) in enumerate(stages):
        per_rank.setdefault(rank, []).append((index, part, layers))
    best, per_stage = None, []
    done: dict[tuple[str, int], ChunkMemory] = {}  # stages alike are traced and sized once

    def chunk(part: str, layers: int, rank: int) -> ChunkMemory:
        if (part, layers) not in done:
            done[(part, layers)] = chunk_memory(args, layout, part, layers, seq_len, dtype, device_type,
                                                notes if rank == 0 else [], optimizer_states)
        return done[(part, layers)]

    for rank, items in sorted(per_rank.items()):
        chunks = [chunk(part, layers, rank) for _, part, layers in items]
        flight = [pipeline.in_flight(layout, rank) for _ in items]
        parts = memory_from_chunks(chunks, flight, layout.microbatches, pipelined=pipelined)
        total = sum(parts[k] for k in ("params", "grads", "optimizer", "activations", "other"))
        per_stage.append({"pp_rank": rank, "stages": [i for i, _, _ in items], "in_flight": flight,
                          "total_gib": round(total / GIB, 4)})
        if best is None or total > best[0]:
            best = (total, parts)
    parts = best[1]
    if pipelined:
        notes.append("pipeline: " + ", ".join(f"rank {s['pp_rank']} holds {s['in_flight'][0]} micro-batch(es)"
                                              for s in per_stage))
    return MemoryEstimate(**{k: parts[k] for k in ("params", "grads", "optimizer", "activations", "other")},
                          phase=parts["phase"], per_stage=per_stage if pipelined else [], notes=notes)
