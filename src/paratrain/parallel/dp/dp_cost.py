"""Data parallelism's step-time terms: the gradient all-reduce (DDP), ZeRO-1's broadcast or distributed optimizer,
FSDP's gathers and reduce-scatters (HSDP's all-reduce), each with the overlap rule plan/costing/time.py's top
describes, and the optimizer step's share of a rank.

`rails_of(group)`: how many of a group's ranks share one node (the planner passes parallel/group_nodes.py's
answer for the Layout: this package is imported by the registry, which the Layout is built from).
"""

from __future__ import annotations

from paratrain.costs.collectives import collective_time

DDP_BUCKET_BYTES = 25 * 2**20


def fsdp_group_costs(profile, n: int, where: str):
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


def hsdp_all_reduce(profile, layout, shard_bytes: float, est, rails_of) -> float:
    """HSDP: the reduce-scattered gradient shard is then all-reduced across the replicas (exposed)."""
    nr = layout.dp_replicate
    if nr <= 1:
        return 0.0
    est.add_comm("all_reduce", shard_bytes, nr)
    gpn = profile.gpu.gpus_per_node
    where = layout.placement("dp_replicate", gpn)
    return collective_time(profile, "all_reduce", shard_bytes, nr, where, rails_of("dp_replicate"))


def distributed_optimizer_comm(profile, layout, grads: float, params: float, fwd: float, bwd: float, est,
                               rails_of) -> float:
    """ZeRO-1 run as a distributed optimizer: one bucketed reduce-scatter of the gradients under the last
    micro-batch's backward, one bucketed all-gather of the updated parameters under the next step's forward."""
    gpn = profile.gpu.gpus_per_node
    n, where, rails = layout.group_size("dp_cp"), layout.placement("dp_cp", gpn), rails_of("dp_cp")
    est.add_comm("reduce_scatter", grads, n)
    est.add_comm("all_gather", params, n)
    exposed = 0.0
    for kind, nbytes, under in (("reduce_scatter", grads, bwd), ("all_gather", params, fwd)):
        whole = collective_time(profile, kind, nbytes, n, where, rails)
        bucket = collective_time(profile, kind, min(nbytes, DDP_BUCKET_BYTES), n, where, rails)
        exposed += bucket + max(0.0, whole - bucket - profile.overlap * under)
    return exposed


def fsdp_meshes(layout, params: float, grads: float, expert_share: float, gpn: int, rails_of) -> list[tuple]:
    """(group size, placement, rails, parameter bytes, gradient bytes) of each FSDP mesh one rank takes part in.
    Under --ep a rank holds 1/ep of the experts (`expert_share` of the parameters), sharded over the other data
    ranks of its ep group's stride (dp_shard x cp / ep; not at all when that is 1: parallel/ep/expert_parallel.py);
    the rest of the model over all of dp_shard x cp."""
    group = layout.fsdp_group
    n, where, rails = layout.group_size(group), layout.placement(group, gpn), rails_of(group)
    if layout.ep <= 1 or expert_share <= 0:
        return [(n, where, rails, params, grads)]
    experts = params * expert_share  # the trace holds every expert's bytes, fp32 (moe_trace.split_experts)
    meshes = [(n, where, rails, params - experts, params - experts)]
    if n // layout.ep > 1:
        mine = experts / layout.ep
        meshes.append((n // layout.ep, where, max(1, rails // layout.ep), mine, mine))
    return meshes


def gathered_once(chunks: list) -> float:
    """ZeRO-3's parameter bytes gathered once per micro-batch, not again for the backward: the norm + head, and a
    tied table's whole group (embedding, norm, head), which stay unsharded from their forward to their backward
    (data_parallel.apply_fsdp). Every other group is gathered for its forward and again for its backward."""
    total = 0.0
    for c in chunks:
        head = c.tr.unit_params("head")
        if head and c.tr.key.args.tie_embeddings:
            head += c.tr.unit_params("pre")  # 0 on a last pipeline stage: its tied copy is the head's own
        total += head
    return total


def gathers_per_step(layout) -> tuple[int, int, bool]:
    """(forward gathers, backward re-gathers, whether the reduce-scatter runs under a backward) of FSDP's groups
    per step. Without a pipeline every micro-batch gathers for its forward, ZeRO-3 again for its backward, and the
    last backward reduce-scatters as it goes. Under torch.distributed.pipelining a stage's micro-batches all run
    without gradient sync and without resharding after their backward, and the stage reduce-scatters once after
    its last one (PipelineStage.backward_maybe_with_nosync, perform_reduce_grad): ZeRO-2 gathers once per step;
    ZeRO-3 reshards after each forward, so it gathers for each backward and for the warm-up's forwards only (a
    later forward follows a backward, which left the parameters gathered)."""
    m = layout.microbatches
    if layout.pp <= 1:
        return m, (m if layout.zero_stage == 3 else 0), True
    if layout.zero_stage != 3:
        return 1, 0, False
    return min(m, layout.pp), m, False


def data_parallel_comm(profile, layout, chunks: list, dtype: str, est, rails_of, dist_optimizer: bool = False,
                       expert_share: float = 0.0) -> float:
    """Exposed seconds of the data-parallel collectives of one step on one rank (`expert_share`: the experts'
    fraction of the parameters, for --ep)."""
    gpn = profile.gpu.gpus_per_node
    grads = sum(c.tr.scalar("grads", c.layers) for c in chunks)  # local fp32 gradient bytes (unsharded)
    params = sum(c.tr.scalar("params", c.layers) for c in chunks)
    fwd = sum(c.fwd for c in chunks)
    bwd = sum(c.bwd for c in chunks)
    overlap = profile.overlap
    if layout.fsdp:
        half = 2 if dtype in ("bf16", "fp8") else 1  # the mixed-precision parameter dtype: bytes gathered
        meshes = [(size, where, rails, p / half, g)
                  for size, where, rails, p, g in fsdp_meshes(layout, params, grads, expert_share, gpn, rails_of)]
        n = meshes[0][0]
        blocks = max(sum(c.layers for c in chunks), 1)
        heads = sum(c.tr.key.part in ("whole", "last") for c in chunks)
        groups = blocks + heads + sum(c.tr.key.part in ("whole", "first") for c in chunks)
        # each block, the embedding and the head are gathered alone: one collective per group (the total bytes,
        # and a latency per call). ZeRO-3 gathers again for the backward, all but the head's group (in the dense
        # mesh; with a tied table, the embedding's group is the head's)
        once = gathered_once(chunks) / half if layout.zero_stage == 3 else 0.0
        kept = heads + sum(c.tr.key.part == "whole" and c.tr.key.args.tie_embeddings for c in chunks)
        regroups = (groups - kept) / groups if layout.zero_stage == 3 else 0.0  # the share gathered again
        fwd_gathers, bwd_gathers, rs_overlaps = gathers_per_step(layout)
        for i, (size, _, _, p, g) in enumerate(meshes):
            est.add_comm("all_gather", p, size, fwd_gathers)
            if bwd_gathers:
                est.add_comm("all_gather", p - (once if i == 0 else 0.0), size, bwd_gathers)
            est.add_comm("reduce_scatter", g, size)
        gathers = fwd_gathers + bwd_gathers * regroups  # whole-model gathers per step, for the copies below
        gathered = sum(p for *_, p, _ in meshes)
        grads = sum(g for *_, g in meshes)
        measured = [fsdp_group_costs(profile, size, where) for size, where, *_ in meshes]
        if all(c is not None for c in measured):
            exposed = 0.0
            for (gather, bwd_gather, reduce_scatter), (*_, p, g) in zip(measured, meshes):
                exposed += fwd_gathers * groups * gather(p / groups) + groups * reduce_scatter(g / groups)
                exposed += bwd_gathers * regroups * groups * bwd_gather(p / groups)
            return exposed + hsdp_all_reduce(profile, layout, grads / n, est, rails_of)
        ag_first = sum(collective_time(profile, "all_gather", p / groups, size, where, rails)
                       for size, where, rails, p, _ in meshes)
        ag = ag_first * groups
        rs = sum(collective_time(profile, "reduce_scatter", g / groups, size, where, rails)
                 for size, where, rails, _, g in meshes) * groups
        exposed = fwd_gathers * (ag_first + max(0.0, ag - ag_first - overlap * fwd))
        exposed += bwd_gathers * max(0.0, regroups * ag - overlap * bwd)
        rs_last = rs / groups
        exposed += rs_last + max(0.0, rs - rs_last - overlap * bwd) if rs_overlaps else rs
        # FSDP's own work on the host and in memory: per group, per gather and reduce-scatter, bookkeeping and
        # copies (all-gather output + copy-out; reduce-scatter copy-in + the sharded gradient)
        tensors = sum(c.tr.scalar("param_tensors", c.layers) for c in chunks)
        exposed += (gathers + 1) * tensors * profile.framework_us.get("fsdp_param", 0.0) * 1e-6
        exposed += (gathers * 2 * gathered + 2 * grads) / (profile.mem_bw_gbs * 1e9)
        return exposed + hsdp_all_reduce(profile, layout, grads / n, est, rails_of)
    # what the optimizer steps (all the parameters, or LoRA's adapters): ZeRO-1 hands back only those
    trained = sum(c.tr.scalar("trained_params", c.layers) for c in chunks)
    if layout.ddp and layout.zero_stage == 1 and dist_optimizer:
        gathered = trained / 2 if dtype in ("bf16", "fp8") else trained  # the model's low-precision copy
        return distributed_optimizer_comm(profile, layout, grads, gathered, fwd, bwd, est, rails_of)
    if layout.ddp:
        group = "dp_cp"
        n, where, rails = layout.group_size(group), layout.placement(group, gpn), rails_of(group)
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
            rails_d = rails_of("dp")
            exposed += collective_time(profile, "broadcast", trained / count, nd, where_d, rails_d) * count
            est.add_comm("broadcast", trained, nd)
        return exposed
    return 0.0


def optimizer_share(layout, seconds: float) -> float:
    """The optimizer step's time on one rank: FSDP shards it over its shards, ZeRO-1 over the data ranks."""
    return seconds / layout.shard_degree if layout.fsdp else (seconds / layout.dp if layout.zero_stage == 1 else seconds)
