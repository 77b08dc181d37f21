"""Collective cost: ring formulas with a latency term, intra- vs inter-node placement, or calibrated figures.

Payload bytes follow parallel/comm.py (what bench measures): all_reduce the tensor reduced, all_gather the
gathered output, reduce_scatter the unsharded input, all_to_all this rank's input, p2p the bytes sent. The
bytes that cross each rank's link ("wire") are the payload times the ring factor below.
"""

from __future__ import annotations

from paratrain.plan.hardware import HardwareProfile

WIRE_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "p2p": lambda n: 1.0,
}
# latency hops of a ring: all-reduce = reduce-scatter + all-gather
HOPS = {"all_reduce": lambda n: 2 * (n - 1), "p2p": lambda n: 1}

def wire_bytes(kind: str, payload: float, n: int) -> float:
    return payload * WIRE_FACTOR[kind](n) if n > 1 else 0.0


def collective_time(profile: HardwareProfile, kind: str, payload: float, n: int, where: str) -> float:
    """Seconds for one collective of `payload` bytes over a group of n ranks placed `where`."""
    if n <= 1 or payload <= 0:
        return 0.0
    wire = wire_bytes(kind, payload, n)
    measured = profile.collectives.get(kind)
    if measured and where == "intra":
        # calibrated on this machine: latency per call and bus bandwidth, as measured at the calibration size
        return measured["latency_us"] * 1e-6 + wire / (measured["busbw_gbs"] * 1e9)
    hops = HOPS.get(kind, lambda m: m - 1)(n)
    latency = profile.latency_us.get(where, 10.0) * 1e-6 * hops
    return latency + wire / (profile.link_gbs[where] * 1e9)
