"""Step time of a layout: traced ops priced by a roofline, collectives by ring formulas, overlap rules per
strategy, and the pipeline bubble per schedule.

Compute: every op the trace recorded costs max(FLOPs / matmul rate, bytes / memory bandwidth), plus a per-op
overhead (added on CPU; on GPU a launch floor the previous kernel hides). Rates are calibrated, or the
catalog peak times the documented efficiencies (hardware.py). Communication: see collectives.py.
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paratrain.errors import UserError
from paratrain.models.args import ModelArgs
from paratrain.parallel.layout import Layout
from paratrain.plan.costing.collectives import collective_time, members_per_node, wire_bytes
from paratrain.plan.costing.compose import Composed, trace
from paratrain.plan.costing.expert_spread import ranks_per_token
from paratrain.plan.costing.memory import stage_layout, trace_key
from paratrain.plan.inputs.hardware import HardwareProfile

DDP_BUCKET_BYTES = 25 * 2**20


@dataclass
class TimeEstimate:
    step_s: float = 0.0
    compute_s: float = 0.0  # forward + backward + optimizer on the critical path
    comm_exposed_s: float = 0.0
    bubble_s: float = 0.0
    comm_bytes: float = 0.0  # payload bytes this rank sends/receives per step (parallel/comm.py convention)
    comm_wire_bytes: float = 0.0
    comm_by_kind: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)

    def add_comm(self, kind: str, payload: float, n: int, count: float = 1.0) -> None:
        if n <= 1:
            return
        self.comm_bytes += payload * count
        self.comm_wire_bytes += wire_bytes(kind, payload, n) * count
        self.comm_by_kind[kind] = self.comm_by_kind.get(kind, 0.0) + payload * count


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


def op_cost(profile: HardwareProfile, dtype: str, phase: str, compiled: bool = False):
    """cost(kind, flops, bytes) -> seconds, for ops of one phase (fwd / bwd / opt)."""
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


def cost_key(profile: HardwareProfile, dtype: str, compiled: bool = False) -> tuple:
    """Everything op_cost reads, as a key: traces cache their op sums under it (a profile being fitted changes
    in place, and one object's id may be reused by the next)."""
    curve = tuple(tuple(map(tuple, profile.matmul_curve.get(d, ()))) for d in sorted(profile.matmul_curve))
    return (dtype, compiled, profile.mem_bw_gbs, tuple(sorted(profile.op_overhead_us.items())), profile.compute_scale,
            profile.overhead_scale,
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


def chunk_time(profile: HardwareProfile, args: ModelArgs, layout: Layout, part: str, layers: int, seq_len: int,
               dtype: str, device_type: str, est: TimeEstimate, microbatches: int) -> ChunkTime:
    tr = trace(trace_key(args, layout, part, seq_len, dtype, device_type), layers)
    key = cost_key(profile, dtype, layout.compile)  # op_sum caches per (phase, key)
    fwd, bwd, opt = (tr.op_sum(phase, layers, op_cost(profile, dtype, phase, layout.compile), key)
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


# -- data-parallel communication -----------------------------------------------------------------------------------
def fsdp_group_costs(profile: HardwareProfile, n: int, where: str):
    """(gather, backward re-gather, reduce-scatter) seconds per FSDP group as functions of its bytes, measured
    end to end by `plan --calibrate` (host_bench.bench_fsdp); None where they do not apply. They are used on a
    host-synchronous device only (CPU: nothing runs ahead of the host, so FSDP's work adds up as measured) and
    for the group size and placement they were measured at."""
    fw = profile.framework_us
    if profile.overhead_overlaps or "fsdp_gather_us" not in fw or where != "intra":
        return None
    # measured at fsdp_world ranks: the per-byte part scales with the ring's (n - 1) / n share on the wire
    world = fw.get("fsdp_world", n)
    wire = ((n - 1) / n) / ((world - 1) / world) if world > 1 else 1.0

    def per_group(name: str, scale: float):  # scale: fitted on a reference model (fit.py)
        return lambda nbytes: scale * (fw[f"{name}_us"] + wire * fw[f"{name}_us_per_mib"] * nbytes / 2**20) * 1e-6

    scale = fw.get("fsdp_scale", 1.0)
    return (per_group("fsdp_gather", scale), per_group("fsdp_bwd_gather", fw.get("fsdp_bwd_scale", 1.0)),
            per_group("fsdp_reduce_scatter", scale))


def hsdp_all_reduce(profile: HardwareProfile, layout: Layout, shard_bytes: float, est: TimeEstimate) -> float:
    """HSDP: the reduce-scattered gradient shard is then all-reduced across the replicas (exposed)."""
    nr = layout.dp_replicate
    if nr <= 1:
        return 0.0
    est.add_comm("all_reduce", shard_bytes, nr)
    gpn = profile.gpu.gpus_per_node
    where = layout.placement("dp_replicate", gpn)
    return collective_time(profile, "all_reduce", shard_bytes, nr, where, members_per_node(layout, "dp_replicate", gpn))


def distributed_optimizer_comm(profile: HardwareProfile, layout: Layout, grads: float, params: float, fwd: float,
                               bwd: float, est: TimeEstimate) -> float:
    """ZeRO-1 run as a distributed optimizer: one bucketed reduce-scatter of the gradients under the last
    micro-batch's backward, one bucketed all-gather of the updated parameters under the next step's forward."""
    gpn = profile.gpu.gpus_per_node
    n, where, rails = layout.group_size("dp_cp"), layout.placement("dp_cp", gpn), members_per_node(layout, "dp_cp", gpn)
    est.add_comm("reduce_scatter", grads, n)
    est.add_comm("all_gather", params, n)
    exposed = 0.0
    for kind, nbytes, under in (("reduce_scatter", grads, bwd), ("all_gather", params, fwd)):
        whole = collective_time(profile, kind, nbytes, n, where, rails)
        bucket = collective_time(profile, kind, min(nbytes, DDP_BUCKET_BYTES), n, where, rails)
        exposed += bucket + max(0.0, whole - bucket - profile.overlap * under)
    return exposed


def fsdp_meshes(layout: Layout, params: float, grads: float, expert_share: float, gpn: int) -> list[tuple]:
    """(group size, placement, rails, parameter bytes, gradient bytes) of each FSDP mesh one rank takes part in.
    Under --ep a rank holds 1/ep of the experts (`expert_share` of the parameters), sharded over the other data
    ranks of its ep group's stride (dp_shard x cp / ep; not at all when that is 1: parallel/expert_parallel.py);
    the rest of the model over all of dp_shard x cp."""
    group = "dp_shard_cp" if layout.cp > 1 else "dp_shard"
    n, where, rails = layout.group_size(group), layout.placement(group, gpn), members_per_node(layout, group, gpn)
    if layout.ep <= 1 or expert_share <= 0:
        return [(n, where, rails, params, grads)]
    experts = params * expert_share  # the trace holds every expert's bytes, fp32 (moe_trace.split_experts)
    meshes = [(n, where, rails, params - experts, params - experts)]
    if n // layout.ep > 1:
        mine = experts / layout.ep
        meshes.append((n // layout.ep, where, max(1, rails // layout.ep), mine, mine))
    return meshes


def data_parallel_comm(profile: HardwareProfile, layout: Layout, chunks: list[ChunkTime], dtype: str,
                       est: TimeEstimate, dist_optimizer: bool = False, expert_share: float = 0.0) -> float:
    """Exposed seconds of the data-parallel collectives of one step on one rank (`expert_share`: the experts'
    fraction of the parameters, for --ep)."""
    gpn, m = profile.gpu.gpus_per_node, layout.microbatches
    grads = sum(c.tr.scalar("grads", c.layers) for c in chunks)  # local fp32 gradient bytes (unsharded)
    params = sum(c.tr.scalar("params", c.layers) for c in chunks)
    fwd = sum(c.fwd for c in chunks)
    bwd = sum(c.bwd for c in chunks)
    overlap = profile.overlap
    if layout.fsdp:
        half = 2 if dtype in ("bf16", "fp8") else 1  # the mixed-precision parameter dtype: bytes gathered
        meshes = [(size, where, rails, p / half, g)
                  for size, where, rails, p, g in fsdp_meshes(layout, params, grads, expert_share, gpn)]
        n = meshes[0][0]
        blocks = max(sum(c.layers for c in chunks), 1)
        groups = blocks + sum((c.tr.key.part in ("whole", "first")) + (c.tr.key.part in ("whole", "last"))
                              for c in chunks)  # each block, the embedding and the head are gathered alone
        # one collective per group: the total bytes, and a latency per call
        gathers = m * (2 if layout.zero_stage == 3 else 1)  # ZeRO-3 gathers again for the backward
        for size, _, _, p, g in meshes:
            est.add_comm("all_gather", p, size, gathers)
            est.add_comm("reduce_scatter", g, size)
        gathered = sum(p for *_, p, _ in meshes)
        grads = sum(g for *_, g in meshes)
        measured = [fsdp_group_costs(profile, size, where) for size, where, *_ in meshes]
        if all(c is not None for c in measured):
            exposed = 0.0
            for (gather, bwd_gather, reduce_scatter), (*_, p, g) in zip(measured, meshes):
                exposed += m * groups * gather(p / groups) + groups * reduce_scatter(g / groups)
                if layout.zero_stage == 3:
                    exposed += m * groups * bwd_gather(p / groups)
            return exposed + hsdp_all_reduce(profile, layout, grads / n, est)
        ag_first = sum(collective_time(profile, "all_gather", p / groups, size, where, rails)
                       for size, where, rails, p, _ in meshes)
        ag = ag_first * groups
        rs = sum(collective_time(profile, "reduce_scatter", g / groups, size, where, rails)
                 for size, where, rails, _, g in meshes) * groups
        exposed = m * (ag_first + max(0.0, ag - ag_first - overlap * fwd))
        if layout.zero_stage == 3:
            exposed += m * max(0.0, ag - overlap * bwd)
        rs_last = rs / groups
        exposed += rs_last + max(0.0, rs - rs_last - overlap * bwd)
        # FSDP's own work on the host and in memory: per group, per gather and reduce-scatter, bookkeeping and
        # copies (all-gather output + copy-out; reduce-scatter copy-in + the sharded gradient)
        tensors = sum(c.tr.scalar("param_tensors", c.layers) for c in chunks)
        exposed += (gathers + 1) * tensors * profile.framework_us.get("fsdp_param", 0.0) * 1e-6
        exposed += (gathers * 2 * gathered + 2 * grads) / (profile.mem_bw_gbs * 1e9)
        return exposed + hsdp_all_reduce(profile, layout, grads / n, est)
    if layout.ddp and layout.zero_stage == 1 and dist_optimizer:
        gathered = params / 2 if dtype in ("bf16", "fp8") else params  # the model's low-precision copy
        return distributed_optimizer_comm(profile, layout, grads, gathered, fwd, bwd, est)
    if layout.ddp:
        group = "dp_cp"
        n, where, rails = layout.group_size(group), layout.placement(group, gpn), members_per_node(layout, group, gpn)
        ar = collective_time(profile, "all_reduce", grads, n, where, rails)
        est.add_comm("all_reduce", grads, n)
        last = collective_time(profile, "all_reduce", min(grads, DDP_BUCKET_BYTES), n, where, rails)
        exposed = last + max(0.0, ar - last - overlap * bwd)
        # bucket copies and contention with the backward, per MiB of gradients (fitted, fit.py)
        exposed += profile.framework_us.get("ddp_us_per_mib", 0.0) * 1e-6 * grads / 2**20
        if layout.zero_stage == 1:
            # ZeroRedundancyOptimizer broadcasts every parameter from its owner after the step: one call each
            nd, where_d = layout.group_size("dp"), layout.placement("dp", gpn)
            count = max(1, round(sum(c.tr.scalar("param_tensors", c.layers) for c in chunks)))
            rails_d = members_per_node(layout, "dp", gpn)
            exposed += collective_time(profile, "broadcast", params / count, nd, where_d, rails_d) * count
            est.add_comm("broadcast", params, nd)
        return exposed
    return 0.0


# -- the step ------------------------------------------------------------------------------------------------------
def pipeline_factor(schedule: str, pp: int, m: int, v: int) -> tuple[float, float]:
    """(busy slots, bubble slots) in units of one micro-batch's forward+backward on one stage rank."""
    if pp == 1:
        return float(m), 0.0
    bubble = (pp - 1) / v
    if schedule == "zero-bubble":
        bubble /= 3.0  # ZB-H1: backward split into input and weight gradients fills about 2/3 of the bubble
    return float(m), bubble


def async_tp_exposed(c: ChunkTime, layout: Layout, overlap: float) -> float:
    """TP time left exposed per micro-batch when each all-gather / reduce-scatter is split into tp steps that
    run under the partial matmuls (async TP): the first step's transfer, and what exceeds the compute."""
    first = c.tp_exposed / layout.tp
    return first + max(0.0, c.tp_exposed - first - overlap * (c.fwd + c.bwd))


def stage_rank_slot(profile: HardwareProfile, chunks: list[ChunkTime], transfer: float) -> float:
    """One micro-batch's forward + backward on a pipeline stage rank (its chunks), with its hand-offs."""
    per_mb = profile.framework_us.get("pp_microbatch", 0.0) * 1e-6  # the schedule's own cost (fitted, fit.py)

    def exposed_transfer(c: ChunkTime) -> float:
        # on an asynchronous device a stage's send / receive of one micro-batch runs while it computes another
        # (1F1B's steady state), so only what does not fit under that compute shows; a host-synchronous device
        # (CPU) waits for each hand-off
        if not profile.overhead_overlaps:
            return transfer
        return max(0.0, transfer - profile.overlap * min(c.fwd, c.bwd))

    return sum(c.fwd + c.bwd + c.tp_exposed + c.cp_comm + c.cp_calls + 2 * exposed_transfer(c) + per_mb
               for c in chunks)


def slowest_and_others(per_rank: dict[int, float]) -> tuple[int, float]:
    """The stage rank with the longest slot, which sets the pace, and the mean slot of the others: the ramp-up
    and drain are their work on the first and last micro-batches (equal stages: (p - 1) slots, as the
    textbook bubble)."""
    slowest = max(per_rank, key=per_rank.get)
    others = sum(t for r, t in per_rank.items() if r != slowest) / max(len(per_rank) - 1, 1)
    return slowest, others


ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


def ep_placement(layout: Layout, gpus_per_node: int) -> tuple[str, int]:
    """Where an expert-parallel group sits: its ranks are ep neighbours of dp_shard x cp, tp ranks apart."""
    span = layout.ep * layout.tp
    members = max(1, min(layout.ep, gpus_per_node // layout.tp))
    return ("intra" if span <= gpus_per_node else "inter"), members


def moe_all_to_all(profile: HardwareProfile, args: ModelArgs, layout: Layout, seq_len: int, dtype: str,
                   layers: int, est: TimeEstimate | None = None, routing: str = "random") -> float:
    """Seconds per micro-batch of --ep's token exchange on `layers` MoE blocks, balanced routing
    (parallel/ep_exchange.py): each layer sends each token once to every rank holding any of its k experts
    (r ranks per token: expert_spread.py, by `routing`) and gets one gated sum per (token, rank) back, forward
    and backward (4 all-to-alls of T*r rows of dim values); each copy's row number and gate go along (T*k x 2
    fp64, their gradients back in backward), after the split counts. Activation checkpointing (full or
    selective) replays the block's forward in the backward, exchanges included (they are autograd functions
    around all_to_all_single, which no AC policy saves): the forward's exchanges again. Not overlapped with
    compute (as torchtitan runs it)."""
    if layout.ep <= 1 or not args.moe or layers <= 0:
        return 0.0
    tokens = layout.micro_batch * seq_len // layout.cp
    rows = tokens * ranks_per_token(args.n_experts, args.top_k, layout.ep, routing)
    payload = rows * args.dim * ACTIVATION_BYTES.get(dtype, 4)
    where, rails = ep_placement(layout, profile.gpu.gpus_per_node)
    one = collective_time(profile, "all_to_all", payload, layout.ep, where, rails)
    copies = tokens * args.top_k
    forwards = 2 if layout.ac != "none" else 1
    exchanges = 2 * forwards + 2
    # (bytes, calls per micro-batch and layer): the split counts each forward, the routing also in backward
    small = [((args.n_experts + layout.ep) * 8, forwards), (copies * 16, forwards + 1)]
    if est is not None:
        est.add_comm("all_to_all", payload, layout.ep, exchanges * layers * layout.microbatches)
        for nbytes, calls in small:
            est.add_comm("all_to_all", nbytes, layout.ep, calls * layers * layout.microbatches)
    metadata = sum(calls * collective_time(profile, "all_to_all", nbytes, layout.ep, where, rails)
                   for nbytes, calls in small)
    return layers * (exchanges * one + metadata)


def moe_layers_on(args: ModelArgs, layers: int) -> int:
    """MoE blocks among `layers` blocks of one part (the dense first blocks counted on the first part)."""
    return max(0, layers - args.n_dense_layers) if args.moe else 0


def expert_param_share(args: ModelArgs) -> float:
    """The experts' fraction of the model's parameters (0 for a dense model)."""
    if not args.moe:
        return 0.0
    from paratrain.models.presets import count_params, expert_params

    return expert_params(args) / count_params(args)


def estimate_time(profile: HardwareProfile, args: ModelArgs, layout: Layout, seq_len: int, dtype: str,
                  device_type: str, async_tp: bool = False, dist_optimizer: bool = False,
                  moe_routing: str = "random") -> TimeEstimate:
    """async_tp: TP collectives overlapped with the matmuls (torch's micro-pipelined TP, which needs compile and
    SP; ignored otherwise). dist_optimizer: a ZeRO-1 layout runs as a distributed optimizer (see the top).
    moe_routing: which experts a token's k choices are, for --ep's exchange (expert_spread.py)."""
    est = TimeEstimate()
    overlapped_tp = async_tp and layout.compile and layout.sp and layout.tp > 1
    m = layout.microbatches
    gpn = profile.gpu.gpus_per_node
    if layout.pp == 1:
        chunk = chunk_time(profile, args, layout, "whole", args.n_layers, seq_len, dtype, device_type, est, m)
        if overlapped_tp:
            chunk.tp_exposed = async_tp_exposed(chunk, layout, profile.overlap)
        per_mb = chunk.fwd + chunk.bwd
        cp_exposed = chunk.cp_calls + (max(0.0, chunk.cp_comm - profile.overlap * 0.5 * per_mb)
                                       if layout.cp_impl == "ring" else chunk.cp_comm)
        opt = chunk.opt / layout.shard_degree if layout.fsdp else (
            chunk.opt / layout.dp if layout.zero_stage == 1 else chunk.opt)
        dp_exposed = data_parallel_comm(profile, layout, [chunk], dtype, est, dist_optimizer,
                                        expert_param_share(args))
        ep_comm = m * moe_all_to_all(profile, args, layout, seq_len, dtype, moe_layers_on(args, args.n_layers), est,
                                 moe_routing)
        est.compute_s = m * per_mb + opt
        est.comm_exposed_s = m * (chunk.tp_exposed + cp_exposed) + dp_exposed + ep_comm
        est.step_s = est.compute_s + est.comm_exposed_s
        est.breakdown = {"forward_s": m * chunk.fwd, "backward_s": m * chunk.bwd, "optimizer_s": opt,
                         "tp_comm_s": m * chunk.tp_exposed, "cp_comm_exposed_s": m * cp_exposed,
                         "dp_comm_exposed_s": dp_exposed, "pp_comm_exposed_s": 0.0}
        if ep_comm:
            est.breakdown["ep_comm_s"] = ep_comm
        return est
    # pipeline: every stage rank's per-micro-batch time; the slowest sets the pace
    stages = stage_layout(args, layout, seq_len)
    ranks: dict[int, list[ChunkTime]] = {}
    io = 0.0
    done: dict[tuple[str, int], tuple[ChunkTime, TimeEstimate]] = {}  # stages alike are priced once
    for rank, part, layers in stages:
        if (part, layers) not in done:
            share = TimeEstimate()
            c = chunk_time(profile, args, layout, part, layers, seq_len, dtype, device_type, share, m)
            if overlapped_tp:
                c.tp_exposed = async_tp_exposed(c, layout, profile.overlap)
            done[(part, layers)] = (c, share)
        c, share = done[(part, layers)]
        ranks.setdefault(rank, []).append(c)
        if rank == 0:
            est.comm_bytes += share.comm_bytes
            est.comm_wire_bytes += share.comm_wire_bytes
        io = max(io, c.tr.io_bytes)
    p2p = collective_time(profile, "p2p", io, 2, layout.placement("pp", gpn))
    est.add_comm("p2p", io, 2, 2 * m * layout.virtual_stages)
    # hand-offs are asynchronous: in the steady state a stage pays the transfer, and a call's latency only
    # where the pipeline waits on it (filling and draining: 2 (p - 1) hand-offs)
    p2p_latency = collective_time(profile, "p2p", 1, 2, layout.placement("pp", gpn))
    transfer = max(p2p - p2p_latency, 0.0)
    ramp = 2 * (layout.pp - 1) * p2p_latency
    per_rank = {r: stage_rank_slot(profile, cs, transfer) for r, cs in ranks.items()}
    slot = max(per_rank.values())
    busy, bubble = pipeline_factor(layout.pp_schedule, layout.pp, m, layout.virtual_stages)
    slowest, others = slowest_and_others(per_rank)
    opt = max(sum(c.opt for c in cs) for cs in ranks.values())
    opt = opt / layout.shard_degree if layout.fsdp else (opt / layout.dp if layout.zero_stage == 1 else opt)
    dp_exposed = data_parallel_comm(profile, layout, ranks[slowest], dtype, est, dist_optimizer,
                                    expert_param_share(args))
    per_part = math.ceil(args.n_layers / (layout.pp * layout.virtual_stages)) * layout.virtual_stages
    ep_comm = busy * moe_all_to_all(profile, args, layout, seq_len, dtype, moe_layers_on(args, per_part), est,
                                    moe_routing)
    compute = sum(c.fwd + c.bwd for c in ranks[slowest])
    est.compute_s = busy * compute + opt
    est.bubble_s = bubble * others
    est.comm_exposed_s = busy * (slot - compute) + ramp + dp_exposed + ep_comm
    est.step_s = est.compute_s + est.bubble_s + est.comm_exposed_s
    tp = busy * sum(c.tp_exposed for c in ranks[slowest])
    cp = busy * sum(c.cp_comm + c.cp_calls for c in ranks[slowest])
    est.breakdown = {"stage_slot_s": slot, "p2p_s": p2p, "optimizer_s": opt, "dp_comm_exposed_s": dp_exposed,
                     "tp_comm_s": tp, "cp_comm_exposed_s": cp,
                     "pp_comm_exposed_s": max(0.0, est.comm_exposed_s - tp - cp - dp_exposed - ep_comm),
                     **({"ep_comm_s": ep_comm} if ep_comm else {}),
                     "per_stage_rank_s": {r: round(t, 6) for r, t in per_rank.items()}}
    return est
