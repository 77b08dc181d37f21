"""Splits for a mixed cluster: how much of the batch each data-parallel rank takes, how many blocks each
pipeline stage holds, chosen from the planner's own per-device time and memory model.

A layout's step is as slow as its slowest device: with data parallelism, the rank that finishes its share
last (the gradient all-reduce waits for it); with a pipeline, the slowest stage sets the pace. Each device
is priced with its own profile (its GPU type, its compute divided by its speed, cluster.py) and its memory
is checked against its own capacity.
  Data parallel (pp = 1): every rank runs the same number of micro-batches; rank i's micro-batch holds u_i
    sequences, sum(u_i) = global batch / micro-batches. Starting from one sequence each, the next sequence goes
    to the rank whose predicted time after taking it is smallest, while its memory allows (water-filling:
    the best min-max split for times that grow with the batch). Weights u_i -> `--dp-batch-split`.
  Pipeline (dp = 1): blocks go one at a time to the stage whose slot (forward + backward of one micro-batch,
    its embedding or head included) grows least, while its memory allows -> `--pp-layers`.
The even split (what the runtime does without those flags) is priced the same way; the uneven one is kept
only when it is predicted faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from paratrain.costs.collectives import collective_time
from paratrain.parallel.layout import Layout
from paratrain.parallel.pp.pp_cost import in_flight, pipeline_factor, slowest_and_others, stage_rank_slot
from paratrain.plan.costing.memory import (
    GIB,
    chunk_memory,
    estimate_memory,
    memory_from_chunks,
    stage_layout,
)
from paratrain.plan.costing.time import TimeEstimate, chunk_time, estimate_time
from paratrain.plan.inputs.cluster import Cluster, Device
from paratrain.plan.search import Candidate, Job


@dataclass
class Split:
    kind: str  # "even", or the uneven split it is (Layout.uneven_split): "batch" | "blocks"
    step_s: float
    per_device: list[dict]
    dp_batch_split: list[int] | None = None  # each data-parallel rank's micro-batch (the runtime's weights)
    pp_layers: list[int] | None = None
    fits: bool = True
    layout: Layout | None = None  # the layout that runs this split (dp_micro_batches / pp_layers set)

    def bottleneck(self) -> dict:
        return max(self.per_device, key=lambda d: d["busy_s"])


@dataclass
class MixedResult:
    even: Split
    chosen: Split
    uneven: Split | None = None
    reasons: list[str] = field(default_factory=list)

    def bottleneck(self) -> dict:
        d = self.chosen.bottleneck()
        return {"rank": d["rank"], "gpu": d["gpu"], "speed": d["speed"], "busy_s": d["busy_s"],
                "why": self.reasons[0] if self.reasons else ""}


def _usable(job: Job, cluster: Cluster, dev: Device) -> float:
    return cluster.mem_gib(dev) * GIB * (1 - job.mem_reserve)


def _device_row(job: Job, cluster: Cluster, dev: Device, busy: float, mem: float, **share) -> dict:
    return {"rank": dev.rank, "node": dev.node, "gpu": dev.gpu, "speed": dev.speed,
            "mem_capacity_gib": cluster.mem_gib(dev), "mem_usable_gib": round(_usable(job, cluster, dev) / GIB, 4),
            "memory_gib": round(mem / GIB, 4), "busy_s": busy, **share}


# -- data parallel ---------------------------------------------------------------------------------------------
class DataParallelModel:
    """Per-rank step time and memory of a pp = 1 layout as a function of that rank's micro-batch (and of the
    number of micro-batches every rank runs)."""

    def __init__(self, job: Job, cluster: Cluster, lay: Layout):
        self.job, self.cluster, self.lay = job, cluster, lay
        self.groups: dict[int, list[Device]] = {}
        for dev in cluster.devices:
            self.groups.setdefault(lay.dp_rank(dev.rank), []).append(dev)
        self._time: dict = {}
        self._mem: dict = {}

    def layout(self, mb: int, m: int) -> Layout:
        return replace(self.lay, micro_batch=mb, microbatches=m)

    def time(self, dev: Device, mb: int, m: int) -> float:
        key = (dev.gpu, dev.speed, mb, m)
        if key not in self._time:
            j = self.job
            self._time[key] = estimate_time(self.cluster.profile_for(dev), j.args, self.layout(mb, m), j.seq_len,
                                            j.dtype, j.device_type).step_s
        return self._time[key]

    def memory(self, mb: int, m: int) -> float:
        if (mb, m) not in self._mem:
            j = self.job
            self._mem[(mb, m)] = estimate_memory(j.args, self.layout(mb, m), j.seq_len, j.dtype, j.device_type,
                                                 j.optimizer_states).total
        return self._mem[(mb, m)]

    def group_time(self, i: int, mb: int, m: int) -> float:
        return max(self.time(d, mb, m) for d in self.groups[i])

    def group_time_between(self, i: int, mb: int, m: int) -> float:
        """group_time, priced exactly at powers of two and linearly between them: small micro-batches sit on
        fixed floors (collective latency, per-op overhead), so a line through 1 and 2 would not do."""
        lo = 1 << (mb.bit_length() - 1)
        if lo == mb:
            return self.group_time(i, mb, m)
        t0, t1 = self.group_time(i, lo, m), self.group_time(i, 2 * lo, m)
        return t0 + (t1 - t0) * (mb - lo) / lo

    def max_micro_batch(self, i: int, m: int, limit: int) -> int:
        """The largest micro-batch every device of DP rank i holds (memory is linear in the micro-batch)."""
        cap = min(_usable(self.job, self.cluster, d) for d in self.groups[i])
        m1, m2 = self.memory(1, m), self.memory(2, m)
        if m1 > cap:
            return 0
        per = m2 - m1
        return limit if per <= 0 else max(1, min(limit, 1 + int((cap - m1) / per)))

    def split(self, sizes: list[int], m: int, kind: str) -> Split:
        rows, fits = [], True
        for i, mb in enumerate(sizes):
            for dev in self.groups[i]:
                mem = self.memory(mb, m)
                fits &= mem <= _usable(self.job, self.cluster, dev)
                rows.append(_device_row(self.job, self.cluster, dev, self.time(dev, mb, m), mem, dp_rank=i,
                                        batch=mb * m, micro_batch=mb))
        if kind == "even":
            return Split(kind, max(r["busy_s"] for r in rows), rows, fits=fits, layout=self.lay)
        lay = replace(self.lay, micro_batch=max(sizes), microbatches=m, dp_micro_batches=tuple(sizes))
        return Split(kind, max(r["busy_s"] for r in rows), rows, dp_batch_split=list(sizes), fits=fits, layout=lay)


def water_fill(n: int, units: int, cost, cap) -> list[int] | None:
    """`units` items over n bins (each >= 1, bin i <= cap(i)), each next item to the bin whose cost after
    taking it is smallest. cost(i, k): the bin's time holding k items."""
    sizes = [1] * n
    if units < n or any(cap(i) < 1 for i in range(n)):
        return None
    for _ in range(units - n):
        options = [(cost(i, sizes[i] + 1), i) for i in range(n) if sizes[i] + 1 <= cap(i)]
        if not options:
            return None
        sizes[min(options)[1]] += 1
    return sizes


def dp_splits(job: Job, cluster: Cluster, lay: Layout) -> tuple[Split, Split | None]:
    """The even split, and the best uneven one over the micro-batch counts that leave room to split: with m
    micro-batches each rank's share is a multiple of m sequences, so fewer (larger) micro-batches split finer."""
    model = DataParallelModel(job, cluster, lay)
    n = lay.dp
    even = model.split([lay.micro_batch] * n, lay.microbatches, "even")
    if n == 1:
        return even, None
    best = None
    for m in (d for d in range(lay.microbatches, 0, -1) if job.global_batch % d == 0):
        units = job.global_batch // m
        caps = {i: model.max_micro_batch(i, m, units) for i in range(n)}
        sizes = water_fill(n, units, lambda i, k, m=m: model.group_time_between(i, k, m),
                           lambda i, caps=caps: caps[i])
        if sizes is None or len(set(sizes)) == 1:
            continue
        trial = model.split(sizes, m, "batch")
        if trial.fits and (best is None or trial.step_s < best.step_s):
            best = trial
    return even, best


# -- pipeline --------------------------------------------------------------------------------------------------
class PipelineModel:
    """Per-stage-rank slot and memory of a dp = 1 pipeline layout for any number of blocks per stage."""

    def __init__(self, job: Job, cluster: Cluster, lay: Layout):
        self.job, self.cluster, self.lay = job, cluster, lay
        self.chunks = lay.pp * lay.virtual_stages
        self.members: dict[int, list[Device]] = {}
        for dev in cluster.devices:
            self.members.setdefault(lay.coords(dev.rank)["pp"], []).append(dev)
        self._chunk: dict = {}

    def part(self, k: int) -> str:
        return "first" if k == 0 else "last" if k == self.chunks - 1 else "middle"

    def chunk(self, dev: Device, k: int, layers: int):
        key = (dev.gpu, dev.speed, self.part(k), layers)
        if key not in self._chunk:
            j, lay = self.job, self.lay
            t = chunk_time(self.cluster.profile_for(dev), j.args, lay, self.part(k), layers, j.seq_len, j.dtype,
                           j.device_type, TimeEstimate(), lay.microbatches)
            m = chunk_memory(j.args, lay, self.part(k), layers, j.seq_len, j.dtype, j.device_type, [])
            self._chunk[key] = (t, m)
        return self._chunk[key]

    def rank_chunks(self, layers: list[int], r: int) -> list[tuple[int, int]]:
        return [(k, layers[k]) for k in range(self.chunks) if k % self.lay.pp == r]

    def memory(self, layers: list[int], r: int, dev: Device) -> float:
        items = self.rank_chunks(layers, r)
        chunks = [self.chunk(dev, k, n)[1] for k, n in items]
        lay = self.lay
        flight = [in_flight(lay.pp_schedule, lay.pp, r, lay.microbatches, lay.virtual_stages)] * len(items)
        parts = memory_from_chunks(chunks, flight, lay.microbatches, pipelined=True)
        return sum(parts[k] for k in ("params", "grads", "optimizer", "activations", "other"))

    def slot(self, layers: list[int], r: int, dev: Device, transfer: float) -> tuple[float, float]:
        """(one micro-batch's forward + backward and hand-offs on this stage rank, its optimizer step)."""
        chunks = [self.chunk(dev, k, n)[0] for k, n in self.rank_chunks(layers, r)]
        return stage_rank_slot(self.cluster.profile_for(dev), chunks, transfer), sum(c.opt for c in chunks)

    def split(self, layers: list[int], kind: str) -> Split:
        """Price a split as plan/costing/time.py prices a pipeline: m slots of the slowest stage rank, a bubble of the
        other ranks' work, the optimizer step, and the hand-off latencies while filling and draining."""
        lay, j = self.lay, self.job
        ref = self.cluster.profile_for(self.cluster.devices[0])
        io = max(self.chunk(self.members[k % lay.pp][0], k, n)[0].tr.io_bytes for k, n in enumerate(layers))
        where = lay.placement("pp", ref.gpu.gpus_per_node)
        latency = collective_time(ref, "p2p", 1, 2, where)
        transfer = max(collective_time(ref, "p2p", io, 2, where) - latency, 0.0)
        slots, rows, fits = {}, [], True
        for r, devs in sorted(self.members.items()):
            priced = {dev: self.slot(layers, r, dev, transfer) for dev in devs}
            slots[r] = max(priced.values())
            for dev in devs:
                mem = self.memory(layers, r, dev)
                fits &= mem <= _usable(j, self.cluster, dev)
                slot, opt = priced[dev]
                rows.append(_device_row(self.job, self.cluster, dev, lay.microbatches * slot + opt, mem, pp_rank=r,
                                        layers=sum(n for _, n in self.rank_chunks(layers, r))))
        busy, bubble = pipeline_factor(lay.pp_schedule, lay.pp, lay.microbatches, lay.virtual_stages)
        slowest, others = slowest_and_others({r: slot for r, (slot, _) in slots.items()})
        step = busy * slots[slowest][0] + bubble * others + max(o for _, o in slots.values()) \
            + 2 * (lay.pp - 1) * latency
        if kind == "even":
            return Split(kind, step, rows, fits=fits, layout=lay)
        return Split(kind, step, rows, pp_layers=list(layers), fits=fits, layout=replace(lay, pp_layers=tuple(layers)))


def even_layers(job: Job, lay: Layout) -> list[int]:
    """The runtime's own split (no --pp-layers), stage by stage."""
    return [layers for _, _, layers in stage_layout(job.args, lay, job.seq_len)]


def pp_splits(job: Job, cluster: Cluster, lay: Layout) -> tuple[Split, Split | None]:
    model = PipelineModel(job, cluster, lay)
    even = model.split(even_layers(job, lay), "even")
    v, pp = lay.virtual_stages, lay.pp
    if job.args.n_layers < pp * v:
        return even, None

    def spread(per_rank: list[int]) -> list[int]:
        # a rank's blocks over its v chunks, as evenly as possible (earlier chunks take the remainder)
        return [per_rank[k % pp] // v + (k // pp < per_rank[k % pp] % v) for k in range(pp * v)]

    def cost(r: int, n: int) -> float:
        trial = spread([n if q == r else v for q in range(pp)])
        return max(model.slot(trial, r, dev, 0.0)[0] for dev in model.members[r])

    def cap(r: int) -> int:
        n = v
        while n < job.args.n_layers and all(model.memory(spread([n + 1 if q == r else v for q in range(pp)]), r, d)
                                            <= _usable(job, cluster, d) for d in model.members[r]):
            n += 1
        return n if all(model.memory(spread([n if q == r else v for q in range(pp)]), r, d) <= _usable(job, cluster, d)
                        for d in model.members[r]) else 0

    caps = {r: cap(r) // v for r in range(pp)}
    sizes = water_fill(pp, job.args.n_layers // v, lambda r, k: cost(r, k * v), lambda r: caps[r])
    if sizes is None:
        return even, None
    per_rank = [s * v for s in sizes]
    for _ in range(job.args.n_layers - sum(per_rank)):  # blocks left over when v does not divide them
        per_rank[min(range(pp), key=lambda q: cost(q, per_rank[q] + 1))] += 1
    layers = spread(per_rank)
    if layers == even.pp_layers or layers == even_layers(job, lay):
        return even, None
    return even, model.split(layers, "blocks")


# -- both, and why ---------------------------------------------------------------------------------------------
def slowest_devices(cluster: Cluster, lay: Layout, job: Job) -> Split:
    """Layouts with no split to choose (pipeline and data parallel together): every device priced at the
    layout's even share; the slowest sets the step."""
    rows = []
    for dev in cluster.devices:
        t = estimate_time(cluster.profile_for(dev), job.args, lay, job.seq_len, job.dtype, job.device_type).step_s
        mem = estimate_memory(job.args, lay, job.seq_len, job.dtype, job.device_type, job.optimizer_states).total
        rows.append(_device_row(job, cluster, dev, t, mem))
    return Split("even", max(r["busy_s"] for r in rows), rows, layout=lay, fits=all(
        r["memory_gib"] * GIB <= _usable(job, cluster, d) for r, d in zip(rows, cluster.devices)))


def _name(d: dict) -> str:
    speed = "" if d["speed"] == 1 else f" at speed {d['speed']:g}"
    return f"rank {d['rank']} ({d['gpu']}{speed})"


def explain_split(even: Split, uneven: Split | None, chosen: Split, lay: Layout) -> list[str]:
    slow, fast = chosen.bottleneck(), min(chosen.per_device, key=lambda d: d["busy_s"])
    out = [f"bottleneck: {_name(slow)} is busy {slow['busy_s']:.3g} s per step"
           + (f" (the least busy, {_name(fast)}, {fast['busy_s']:.3g} s)" if fast["rank"] != slow["rank"] else "")]
    if uneven is None:
        if lay.uneven_split == "batch":
            out.append("even split of the batch kept: no uneven split is predicted faster, or none fits")
        elif lay.uneven_split == "blocks":
            out.append("even split of the blocks kept: no uneven split is predicted faster, or none fits")
        else:
            out.append("even split: the runtime splits unevenly over data parallelism alone (no tp / cp) or over "
                       "pipeline stages alone (no dp); every device priced at its even share")
        return out
    gain = 1 - uneven.step_s / even.step_s
    if chosen is uneven:
        if uneven.kind == "batch":
            shares = ":".join(map(str, uneven.dp_batch_split))
            out.append(f"batch split {shares} over the data-parallel ranks, more sequences to the faster ones: "
                       f"{uneven.step_s:.3g} s vs {even.step_s:.3g} s per step split evenly ({gain:.0%} faster)")
        else:
            out.append(f"blocks per stage {':'.join(map(str, uneven.pp_layers))}, fewer on the slower stages: "
                       f"{uneven.step_s:.3g} s vs {even.step_s:.3g} s per step with the even split ({gain:.0%} faster)")
        capped = [d for d in uneven.per_device if d["memory_gib"] >= 0.9 * d["mem_usable_gib"]]
        if capped:
            out.append("memory caps the share of " + ", ".join(_name(d) for d in capped))
    else:
        out.append(f"even split kept: the uneven one ({uneven.step_s:.3g} s) is not predicted faster or does not fit")
    return out


def analyze(job: Job, cluster: Cluster, cand: Candidate) -> MixedResult:
    """Even and uneven splits of a candidate's layout on the cluster, the chosen one, and why."""
    lay = cand.layout
    if lay.uneven_split == "batch":
        even, uneven = dp_splits(job, cluster, lay)
    elif lay.uneven_split == "blocks":
        even, uneven = pp_splits(job, cluster, lay)
    else:  # the runtime splits the batch unevenly over data parallelism alone (parallel/uneven_split.py)
        even, uneven = slowest_devices(cluster, lay, job), None
    chosen = uneven if uneven is not None and uneven.fits and uneven.step_s < even.step_s else even
    return MixedResult(even=even, chosen=chosen, uneven=uneven, reasons=explain_split(even, uneven, chosen, lay))
