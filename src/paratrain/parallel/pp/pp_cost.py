"""Pipeline parallelism's step-time terms: the bubble per schedule, a stage rank's slot with its hand-offs, and
how a step's parts add up (plan/costing/time.py's top: "PP")."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.costs.collectives import collective_time


def pipeline_factor(schedule: str, pp: int, m: int, v: int) -> tuple[float, float]:
    """(busy slots, bubble slots) in units of one micro-batch's forward+backward on one stage rank."""
    if pp == 1:
        return float(m), 0.0
    bubble = (pp - 1) / v
    if schedule == "zero-bubble":
        bubble /= 3.0  # ZB-H1: backward split into input and weight gradients fills about 2/3 of the bubble
    return float(m), bubble


def stage_rank_slot(profile, chunks: list, transfer: float) -> float:
    """One micro-batch's forward + backward on a pipeline stage rank (its chunks), with its hand-offs."""
    per_mb = profile.framework_us.get("pp_microbatch", 0.0) * 1e-6  # the schedule's own cost (fitted, fit.py)

    def exposed_transfer(c) -> float:
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


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, virtual: int) -> int:
    """Micro-batches (per chunk) whose activations a pipeline rank holds at once, per schedule."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, pp - rank)
    # interleaved / zero-bubble: torch's warm-up count, spread over the rank's `virtual` chunks
    warmup = min(microbatches * virtual, (virtual - 1) * pp + 2 * (pp - 1 - rank) + 1)
    return max(1, -(-warmup // virtual))


@dataclass
class Schedule:
    per_rank: dict  # every stage rank's slot: one micro-batch's forward + backward with its hand-offs
    busy: float  # micro-batch slots of the slowest rank
    bubble: float  # bubble slots of the other ranks' work
    slowest: int = 0
    others: float = 0.0  # the other ranks' mean slot
    p2p: float = 0.0  # one hand-off of one micro-batch's activations
    ramp: float = 0.0  # hand-off latencies the pipeline waits on while filling and draining


def handoffs(p, io: float) -> tuple[float, float, float]:
    """(one hand-off, the transfer a stage pays per micro-batch, the ramp's latencies) of activations of `io`
    bytes between stages."""
    layout, where = p.layout, p.where("pp")
    p2p = collective_time(p.profile, "p2p", io, 2, where)
    p.est.add_comm("p2p", io, 2, 2 * layout.microbatches * layout.virtual_stages)
    # hand-offs are asynchronous: in the steady state a stage pays the transfer, and a call's latency only
    # where the pipeline waits on it (filling and draining: 2 (p - 1) hand-offs)
    p2p_latency = collective_time(p.profile, "p2p", 1, 2, where)
    return p2p, max(p2p - p2p_latency, 0.0), 2 * (layout.pp - 1) * p2p_latency


def schedule(p, ranks: dict, io: float) -> Schedule:
    """The pipeline's slots: every stage rank's, the slowest one's count and the bubble (one slot of micro-batches
    on one rank without a pipeline)."""
    layout = p.layout
    if layout.pp == 1:
        return Schedule({r: 0.0 for r in ranks}, float(layout.microbatches), 0.0)
    p2p, transfer, ramp = handoffs(p, io)
    per_rank = {r: stage_rank_slot(p.profile, cs, transfer) for r, cs in ranks.items()}
    busy, bubble = pipeline_factor(layout.pp_schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    slowest, others = slowest_and_others(per_rank)
    return Schedule(per_rank, busy, bubble, slowest, others, p2p, ramp)


def compose(p, chunks: list, sched: Schedule, opt: float, terms: dict[str, float]) -> None:
    """The step on the slowest stage rank (its `chunks`): compute, bubble and exposed communication, with the
    other techniques' step terms (`terms`, exposed seconds by breakdown key) added, into `p.est`."""
    est, layout = p.est, p.layout
    if layout.pp == 1:
        chunk, m = chunks[0], layout.microbatches
        est.compute_s = m * (chunk.fwd + chunk.bwd) + opt
        exposed = m * (chunk.tp_exposed + chunk.cp_exposed)
        for seconds in terms.values():
            exposed += seconds
        est.comm_exposed_s = exposed
        est.step_s = est.compute_s + est.comm_exposed_s
        est.breakdown = {"forward_s": m * chunk.fwd, "backward_s": m * chunk.bwd, "optimizer_s": opt,
                         "tp_comm_s": m * chunk.tp_exposed, "cp_comm_exposed_s": m * chunk.cp_exposed,
                         "pp_comm_exposed_s": 0.0, **terms}
        return
    busy, slot = sched.busy, max(sched.per_rank.values())
    compute = sum(c.fwd + c.bwd for c in chunks)
    est.compute_s = busy * compute + opt
    est.bubble_s = sched.bubble * sched.others
    exposed = busy * (slot - compute) + sched.ramp
    for seconds in terms.values():
        exposed += seconds
    est.comm_exposed_s = exposed
    est.step_s = est.compute_s + est.bubble_s + est.comm_exposed_s
    tp = busy * sum(c.tp_exposed for c in chunks)
    cp = busy * sum(c.cp_comm + c.cp_calls for c in chunks)
    rest = est.comm_exposed_s - tp - cp
    for seconds in terms.values():
        rest -= seconds
    est.breakdown = {"stage_slot_s": slot, "p2p_s": sched.p2p, "optimizer_s": opt, "tp_comm_s": tp,
                     "cp_comm_exposed_s": cp, "pp_comm_exposed_s": max(0.0, rest), **terms,
                     "per_stage_rank_s": {r: round(t, 6) for r, t in sched.per_rank.items()}}
