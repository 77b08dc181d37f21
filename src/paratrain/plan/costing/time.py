"""Step time of a layout: traced ops priced by a roofline, collectives by ring formulas, overlap rules per
strategy, and the pipeline bubble per schedule.

Compute: every op the trace recorded costs max(FLOPs / matmul rate, bytes / memory bandwidth), plus a per-op
overhead (added on CPU; on GPU a launch floor the previous kernel hides). Rates are calibrated, or the
catalog peak times the documented efficiencies (hardware.py). Communication: see collectives.py.
Mixed precision: the trace runs paratrain's autocast over fp32 weights, whose casts of each weight per use and
fp32 gradient accumulation it tags (tracing/units.py MixedPrecisionOps); --half-weights prices Megatron's 16-bit
weights instead (HALF_WEIGHTS_SKIPS cost nothing, one master-to-weight copy per step).
Overlap rules (the fraction `overlap` of the profile is how much of an overlappable transfer hides):
  DDP        gradient all-reduce runs under the last micro-batch's backward; the last bucket is exposed
  ZeRO-1     as DDP, plus the parameter broadcast after the optimizer step (exposed)
  FSDP2      all-gathers are prefetched under the previous block's compute; the first one is exposed;
             reduce-scatters run under the backward, the last one is exposed; HSDP adds an all-reduce
  TP / SP    on the critical path: fully exposed; with async TP (compile-gated, below) each collective is split
             into tp steps that run under the partial matmuls: one step's transfer shows, and what exceeds the
             micro-batch's compute
  dist. opt. ZeRO-1 as a distributed optimizer (Megatron-Core's --use-distributed-optimizer with
             --overlap-grad-reduce --overlap-param-gather): gradients reduce-scattered once per step under the last
             micro-batch's backward, parameters all-gathered once per step under the next forward; the last / first
             bucket is exposed
  CP ring    K/V rotation posted before each block's attention: hides under it
  Ulysses    all-to-alls are exposed
  PP         m slots of the slowest stage rank plus a bubble of (p - 1) slots of the other ranks' work for
             GPipe/1F1B (the textbook (m + p - 1) when stages are equal), interleaving divides the bubble by v,
             zero-bubble leaves about a third of it; activations cross stages by p2p per micro-batch
Each technique's terms live in its own package, beside its apply (parallel/dp/dp_cost.py, tp/tp_cost.py,
pp/pp_cost.py, ep/ep_cost.py; CP's overlap in cp/cp_technique.py); estimate_time() below asks each dimension's
technique in turn and adds what it says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paratrain.costs.collectives import collective_time, wire_bytes
from paratrain.costs.hardware import HardwareProfile
from paratrain.errors import UserError
from paratrain.models.args import ModelArgs
from paratrain.parallel.dims import techniques
from paratrain.parallel.group_nodes import members_per_node
from paratrain.parallel.layout import Layout
from paratrain.plan.costing.compose import Composed, trace
from paratrain.plan.costing.memory import stage_layout, trace_key


@dataclass
class TimeEstimate:
    step_s: float = 0.0
    compute_s: float = 0.0  # forward + backward + optimizer on the critical path
    comm_exposed_s: float = 0.0
    bubble_s: float = 0.0
    comm_bytes: float = 0.0  # payload bytes this rank sends/receives per step (parallel/collective_bytes.py convention)
    comm_wire_bytes: float = 0.0
    comm_by_kind: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)

    def add_comm(self, kind: str, payload: float, n: int, count: float = 1.0) -> None:
        if n <= 1:
            return
        self.comm_bytes += payload * count
        self.comm_wire_bytes += wire_bytes(kind, payload, n) * count
        self.comm_by_kind[kind] = self.comm_by_kind.get(kind, 0.0) + payload * count

    def merge_comm(self, other: TimeEstimate) -> None:
        self.comm_bytes += other.comm_bytes
        self.comm_wire_bytes += other.comm_wire_bytes
        for kind, payload in other.comm_by_kind.items():
            self.comm_by_kind[kind] = self.comm_by_kind.get(kind, 0.0) + payload


# -- compute -----------------------------------------------------------------------------------------------------
def matmul_rate(profile: HardwareProfile, dtype: str, flops: float) -> float:
    """Achievable FLOP/s for a matmul of `flops`: the calibrated curve (log-log interpolation), else the
    profile's large-matmul rate. An unknown dtype is an error: no other dtype's or GPU's figure stands in."""
    curve = profile.matmul_curve.get(dtype)
    if curve:
        pts = sorted(curve)
        if flops <= pts[0][0]:
            return pts[0][1] * 1e12 * flops / pts[0][0] if flops > 0 else pts[0][1] * 1e12
        for (f0, r0), (f1, r1) in zip(pts, pts[1:]):
            if flops <= f1:
                w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0))) * 1e12
        return pts[-1][1] * 1e12
    if dtype not in profile.dtype_tflops:
        raise UserError(f"the hardware profile ({profile.gpu.name}) has no {dtype} matmul rate; known: "
                        f"{', '.join(profile.dtype_tflops)} (calibrate with this --dtype)")
    return profile.dtype_tflops[dtype] * 1e12


# FP8 training (torchao float8 linears, dynamic scaling): matmuls run at the FP8 peak; each one first finds its
# operands' amax and casts them to fp8 (reads the bf16 operand, writes an fp8 copy): about half the matmul's
# bf16 traffic again, as memory-bound work. Attention and everything else stay bf16.
FP8_CAST_TRAFFIC = 0.5
# torch.compile fuses chains of elementwise / norm / cast ops into one kernel that reads its inputs and writes its
# outputs once: the memory-bound ops' traffic is taken as halved (a documented factor; no lent GPU measured it)
COMPILE_MEMORY_BOUND_FACTOR = 0.5
# the ops autocast adds around fp32 weights (tracing/units.py MixedPrecisionOps), which a run holding its weights
# in the compute dtype does not run (--half-weights): Megatron's Float16Module keeps 16-bit weights (no cast per
# use) and its weight-gradient GEMMs accumulate into the fp32 main gradients (--gradient-accumulation-fusion:
# no cast back, no separate addition)
HALF_WEIGHTS_SKIPS = frozenset({"weight_cast", "grad_cast", "grad_accumulate"})


def op_cost(profile: HardwareProfile, dtype: str, phase: str, compiled: bool = False, half_weights: bool = False):
    """cost(kind, flops, bytes) -> seconds, for ops of one phase (fwd / bwd / opt). half_weights: the weights
    are held in the compute dtype (HALF_WEIGHTS_SKIPS cost nothing)."""
    bw = profile.mem_bw_gbs * 1e9
    fp8 = dtype == "fp8" and phase != "opt"
    fused = COMPILE_MEMORY_BOUND_FACTOR if compiled and phase != "opt" else 1.0
    overhead = profile.op_overhead_us.get(phase, 0.0) * 1e-6
    view = profile.op_overhead_us.get("view", 0.0) * 1e-6
    # in autocast, matmuls run in the low-precision dtype; the optimizer works on fp32 state
    mm_dtype = "fp32" if phase == "opt" else dtype
    attn_dtype = "bf16" if fp8 else mm_dtype

    dtensor_op = profile.framework_us.get("dtensor_op", 0.0) * 1e-6
    scale = profile.compute_scale
    overhead_scale = scale if profile.overhead_scale is None else profile.overhead_scale

    def cost(kind: str, flops: float, nbytes: float, dtensor: bool = False) -> float:
        host = dtensor_op if dtensor else 0.0  # DTensor's sharding propagation runs on the host per op
        if kind == "view":
            return host + (0.0 if profile.overhead_overlaps else view)
        if half_weights and kind in HALF_WEIGHTS_SKIPS:
            return 0.0
        memory = nbytes / bw
        if kind == "mm":
            work = max(flops / matmul_rate(profile, mm_dtype, flops), memory)
            if fp8:
                work += fused * FP8_CAST_TRAFFIC * memory
        elif kind == "attn":
            work = max(flops / (matmul_rate(profile, attn_dtype, flops) * profile.attention_tflops_fraction), memory)
        else:
            work = fused * memory
        if profile.overhead_overlaps:
            return scale * max(work, overhead) + host
        return scale * work + overhead_scale * overhead + host

    return cost


def cost_key(profile: HardwareProfile, dtype: str, compiled: bool = False, half_weights: bool = False) -> tuple:
    """Everything op_cost reads, as a key: traces cache their op sums under it (a profile being fitted changes
    in place, and one object's id may be reused by the next)."""
    curve = tuple(tuple(map(tuple, profile.matmul_curve.get(d, ()))) for d in sorted(profile.matmul_curve))
    return (dtype, compiled, half_weights, profile.mem_bw_gbs, tuple(sorted(profile.op_overhead_us.items())),
            profile.compute_scale, profile.overhead_scale,
            profile.framework_us.get("dtensor_op", 0.0), profile.overhead_overlaps, profile.attention_tflops_fraction,
            tuple(sorted(profile.dtype_tflops.items())), curve)


@dataclass
class ChunkTime:
    fwd: float
    bwd: float
    opt: float
    tp_exposed: float  # per micro-batch, forward + backward
    cp_comm: float  # per micro-batch ring p2p / Ulysses all-to-all transfer time
    cp_calls: float  # per micro-batch fixed cost of those calls (never hidden)
    tr: Composed
    layers: int
    cp_exposed: float = 0.0  # per micro-batch, of cp_comm + cp_calls, without a pipeline (cp_technique.py)


def chunk_time(profile: HardwareProfile, args: ModelArgs, layout: Layout, part: str, layers: int, seq_len: int,
               dtype: str, device_type: str, est: TimeEstimate, microbatches: int,
               half_weights: bool = False) -> ChunkTime:
    tr = trace(trace_key(args, layout, part, seq_len, dtype, device_type), layers)
    key = cost_key(profile, dtype, layout.compile, half_weights)  # op_sum caches per (phase, key)
    fwd, bwd, opt = (tr.op_sum(phase, layers, op_cost(profile, dtype, phase, layout.compile, half_weights), key)
                     for phase in ("fwd", "bwd", "opt"))
    gpn = profile.gpu.gpus_per_node
    # context parallelism's own cost per call (its Python and waits around each collective; fitted, fit.py)
    cp_call = {"p2p": profile.framework_us.get("cp_p2p_call", 0.0) * 1e-6,
               "all_to_all": profile.framework_us.get("cp_all_to_all_call", 0.0) * 1e-6}
    # sequence parallelism's DTensor redistributions around each all-gather / reduce-scatter (fitted)
    sp_call = profile.framework_us.get("sp_call", 0.0) * 1e-6
    tp_t = cp_t = cp_fixed = 0.0
    for phase in ("fwd", "bwd"):
        for kind, payload, group, count in tr.comm_at(phase, layers):
            n = layout.group_size(group)
            t = collective_time(profile, kind, payload, n, layout.placement(group, gpn),
                                members_per_node(layout, group, gpn))
            est.add_comm(kind, payload, n, microbatches * count)
            if group == "tp":
                tp_t += count * (t + (sp_call if kind in ("all_gather", "reduce_scatter") else 0.0))
            else:
                cp_t += count * t
                cp_fixed += count * cp_call.get(kind, 0.0)
    return ChunkTime(fwd, bwd, opt, tp_t, cp_t, cp_fixed, tr, layers)


def master_copy(profile: HardwareProfile, c: ChunkTime) -> float:
    """Seconds to write a chunk's fp32 master weights into its 16-bit model weights after the optimizer step (read
    4 bytes, write 2 per parameter; memory-bound), as a half-weights run does once per step."""
    # under LoRA only the adapters have masters: the frozen base is held in the compute dtype as it is
    count = c.tr.scalar("trained_params", c.layers) / 4 if c.tr.key.lora else c.tr.scalar("param_count", c.layers)
    return profile.compute_scale * 6.0 * count / (profile.mem_bw_gbs * 1e9)


# -- the step ------------------------------------------------------------------------------------------------------
@dataclass
class StepPricing:
    """The step being priced, as each technique's cost terms read it (parallel/technique.py)."""

    profile: HardwareProfile
    args: ModelArgs
    layout: Layout
    seq_len: int
    dtype: str
    device_type: str
    est: TimeEstimate
    async_tp: bool = False
    dist_optimizer: bool = False
    moe_routing: str = "random"
    half_weights: bool = False

    def where(self, group: str) -> str:
        return self.layout.placement(group, self.profile.gpu.gpus_per_node)

    def rails(self, group: str) -> int:
        return members_per_node(self.layout, group, self.profile.gpu.gpus_per_node)


def estimate_time(profile: HardwareProfile, args: ModelArgs, layout: Layout, seq_len: int, dtype: str,
                  device_type: str, async_tp: bool = False, dist_optimizer: bool = False,
                  moe_routing: str = "random", half_weights: bool = False) -> TimeEstimate:
    """async_tp: TP collectives overlapped with the matmuls (torch's micro-pipelined TP, which needs compile and
    SP; ignored otherwise). dist_optimizer: a ZeRO-1 layout runs as a distributed optimizer (see the top).
    moe_routing: which experts a token's k choices are, for --ep's exchange (expert_spread.py).
    half_weights: the weights are held in the compute dtype with fp32 masters in the optimizer (Megatron's
    scheme): no per-micro-batch casts or gradient accumulation kernels (HALF_WEIGHTS_SKIPS); once per step the
    optimizer writes the updated masters into the 16-bit weights.

    One path for every layout: each stage rank's model parts are traced and priced (one part on one rank without
    a pipeline), every dimension's technique adjusts them and adds its step terms, and the pipeline's technique
    adds the parts up."""
    half_weights = half_weights and dtype != "fp32"
    p = StepPricing(profile, args, layout, seq_len, dtype, device_type, TimeEstimate(), async_tp, dist_optimizer,
                    moe_routing, half_weights)
    every = techniques()
    pipeline = next(t for t in every if t.composes_step)
    m = layout.microbatches
    ranks: dict[int, list[ChunkTime]] = {}
    io = 0.0
    done: dict[tuple[str, int], tuple[ChunkTime, TimeEstimate]] = {}  # stages alike are priced once
    for rank, part, layers in pipeline.stages(layout, args.n_layers, lambda: stage_layout(args, layout, seq_len)):
        if (part, layers) not in done:
            share = TimeEstimate()
            c = chunk_time(profile, args, layout, part, layers, seq_len, dtype, device_type, share, m, half_weights)
            for technique in every:
                technique.adjust_chunk(p, c)
            done[(part, layers)] = (c, share)
        c, share = done[(part, layers)]
        ranks.setdefault(rank, []).append(c)
        if rank == 0:
            p.est.merge_comm(share)
        io = max(io, c.tr.io_bytes)
    sched = pipeline.schedule(p, ranks, io)
    opt = max(sum(c.opt + (master_copy(profile, c) if half_weights else 0.0) for c in cs) for cs in ranks.values())
    for technique in every:
        opt = technique.optimizer_share(layout, opt)
    terms: dict[str, float] = {}
    for technique in every:
        terms.update(technique.step_cost(p, ranks[sched.slowest], sched.busy))
    pipeline.compose(p, ranks[sched.slowest], sched, opt, terms)
    return p.est
