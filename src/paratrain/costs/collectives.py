"""Collective cost: ring formulas with a latency term, intra- vs inter-node placement, or calibrated figures.

Payload bytes follow parallel/collective_bytes.py (what bench measures): all_reduce the tensor reduced, all_gather the
gathered output, reduce_scatter the unsharded input, all_to_all this rank's input, p2p the bytes sent. The
bytes that cross each rank's link ("wire") are the payload times the ring factor below.

Inter-node groups: every GPU has its own NIC (the catalog's inter-node rate is per GPU), and NCCL runs one ring
per NIC ("rail"), so a group with k members on each node moves its inter-node traffic over k NICs at once:
k times the per-GPU rate, at most the intra-node rate that feeds them. A group with one member per node (data
parallelism across tensor-parallel nodes) gets one NIC's rate. An all-to-all is no ring: every rank sends its
off-node share through its own NIC at once (all_to_all_across_nodes).
"""

from __future__ import annotations

from paratrain.costs.hardware import HardwareProfile

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


def all_to_all_across_nodes(profile: HardwareProfile, payload: float, n: int, rails: int) -> float:
    """Transfer seconds of an all-to-all whose n ranks sit `rails` to a node: each rank sends (n - rails) / n of
    its payload off its node through its own NIC (every rank of a node does so at once: no NIC is shared, none
    is borrowed, unlike a ring's rails) and the rest over the intra-node links meanwhile."""
    rails = max(1, min(rails, n))
    off_node = payload * (n - rails) / n / (profile.link_gbs["inter"] * 1e9)
    on_node = payload * (rails - 1) / n / (profile.link_gbs.get("intra", profile.link_gbs["inter"]) * 1e9)
    return max(off_node, on_node)


def collective_time(profile: HardwareProfile, kind: str, payload: float, n: int, where: str,
                    rails: int = 1) -> float:
    """Seconds for one collective of `payload` bytes over a group of n ranks placed `where`; `rails`: the
    group's members per node, whose NICs an inter-node collective uses together (module docstring)."""
    if n <= 1 or payload <= 0:
        return 0.0
    wire = wire_bytes(kind, payload, n)
    measured = profile.collectives.get(kind)
    if measured and where == "intra":
        # calibrated on this machine: latency per call and bus bandwidth, as measured at the calibration size
        return measured["latency_us"] * 1e-6 + wire / (measured["busbw_gbs"] * 1e9)
    hops = HOPS.get(kind, lambda m: m - 1)(n)
    latency = profile.latency_us.get(where, 10.0) * 1e-6 * hops
    if kind == "all_to_all" and where == "inter":
        return latency + all_to_all_across_nodes(profile, payload, n, rails)
    link = profile.link_gbs[where]
    if where == "inter" and kind != "p2p":
        link = min(link * rails, max(link, profile.link_gbs.get("intra", link)))
    return latency + wire / (link * 1e9)
