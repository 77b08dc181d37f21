"""A cluster of possibly different devices: `plan --gpu h100-sxm:8,a100-80:8` or `plan --cluster FILE`.

Ranks fill nodes in the order given (node 0 holds ranks 0..n0-1, and so on). Every device has a GPU type (a
catalog name), the memory of that type, and a relative `speed` (1.0: the type's own figures; 0.5: its compute
takes twice as long, e.g. a throttled or older part). Collectives run at the cluster's slowest links: one
intra-node and one inter-node figure for all (the smallest given). A cluster file is JSON, read as data:

    {"nodes": [{"gpu": "h100-sxm", "count": 8, "intra_node_gbs": 450, "inter_node_gbs": 50},
               {"gpu": "a100-80", "count": 8, "speed": [1, 1, 1, 1, 1, 1, 1, 0.5]}]}
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.costs.hardware import HardwareProfile, profile_from_spec, with_cluster_overrides
from paratrain.errors import UserError, read_json_file
from paratrain.gpu_catalog import CATALOG, get_gpu

NODE_KEYS = {"gpu", "count", "intra_node_gbs", "inter_node_gbs", "speed"}


@dataclass(frozen=True)
class Device:
    rank: int
    node: int
    gpu: str
    speed: float = 1.0


@dataclass
class Cluster:
    devices: list[Device]
    gpus_per_node: int  # the smallest node (placement of groups is judged on it)
    intra_node_gbs: float | None = None  # None: the GPU types' catalog figures (the smallest of them)
    inter_node_gbs: float | None = None
    source: str = ""
    profiles: dict[str, HardwareProfile] = field(default_factory=dict)  # GPU type -> profile at speed 1

    @property
    def mixed(self) -> bool:
        return len({(d.gpu, d.speed) for d in self.devices}) > 1

    @property
    def nodes(self) -> int:
        return len({d.node for d in self.devices})

    def spec(self) -> str:
        """The cluster as a --gpu list: TYPE:COUNT per node."""
        counts: dict[int, list] = {}
        for d in self.devices:
            counts.setdefault(d.node, [d.gpu, 0])[1] += 1
        return ",".join(f"{g}:{n}" for g, n in counts.values())

    def describe(self) -> str:
        runs, last = [], None
        for d in self.devices:
            key = (d.node, d.gpu, d.speed)
            if key == last:
                runs[-1][1] += 1
            else:
                runs.append([key, 1])
            last = key
        return ", ".join(f"node {n}: {c} x {g}" + (f" at speed {s:g}" if s != 1 else "") for (n, g, s), c in runs)

    def profile_for(self, device: Device) -> HardwareProfile:
        """The time model's profile for one device: its type's, its compute (and per-op host cost) divided by
        its speed; communication is the cluster's."""
        base = self.profiles[device.gpu]
        if device.speed == 1:
            return base
        overhead = base.compute_scale if base.overhead_scale is None else base.overhead_scale
        return dataclasses.replace(base, compute_scale=base.compute_scale / device.speed,
                                   overhead_scale=overhead / device.speed)

    def mem_gib(self, device: Device) -> float:
        return self.profiles[device.gpu].gpu.mem_gib


def _number(value, what: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise UserError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _known_type(name, where: str) -> str:
    if not isinstance(name, str) or name.lower() not in CATALOG:
        raise UserError(f"{where}: unknown GPU type {name!r}; known: {', '.join(CATALOG)}")
    return name.lower()


def is_gpu_list(text: str | None) -> bool:
    """`--gpu` names a list (h100-sxm:8,a100-80:8 or cpu,cpu) rather than one type."""
    return bool(text) and ("," in text or ":" in text)


def parse_gpu_list(text: str) -> list[dict]:
    """'h100-sxm:8,a100-80:8' -> one node per item, in rank order; a bare name is a node of one device."""
    nodes = []
    for item in text.split(","):
        name, _, count = item.strip().partition(":")
        gpu = _known_type(name.strip(), "--gpu")
        try:
            n = int(count) if count.strip() else 1
        except ValueError:
            raise UserError(f"--gpu: the count in {item.strip()!r} is not an integer (expected TYPE:COUNT)") from None
        if n < 1:
            raise UserError(f"--gpu: the count in {item.strip()!r} must be >= 1")
        nodes.append({"gpu": gpu, "count": n})
    return nodes


def read_cluster_file(path: str) -> list[dict]:
    doc = read_json_file(Path(path), "cluster file")
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list) or not doc["nodes"]:
        raise UserError(f"cluster file {path}: expected a JSON object with a non-empty \"nodes\" list")
    unknown = set(doc) - {"nodes", "intra_node_gbs", "inter_node_gbs"}
    if unknown:
        raise UserError(f"cluster file {path}: unknown key(s) {', '.join(sorted(unknown))}")
    nodes = []
    for i, node in enumerate(doc["nodes"]):
        where = f"cluster file {path}, node {i}"
        if not isinstance(node, dict):
            raise UserError(f"{where}: expected an object with gpu and count")
        extra = set(node) - NODE_KEYS
        if extra:
            raise UserError(f"{where}: unknown key(s) {', '.join(sorted(extra))} (known: {', '.join(sorted(NODE_KEYS))})")
        count = node.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise UserError(f"{where}: count must be an integer >= 1, got {count!r}")
        out = {"gpu": _known_type(node.get("gpu"), where), "count": count}
        for key in ("intra_node_gbs", "inter_node_gbs"):
            value = node.get(key, doc.get(key))
            if value is not None:
                out[key] = _number(value, f"{where}: {key}")
        speed = node.get("speed", 1.0)
        speeds = speed if isinstance(speed, list) else [speed] * count
        if len(speeds) != count:
            raise UserError(f"{where}: speed lists {len(speeds)} device(s) but count is {count}")
        out["speed"] = [_number(s, f"{where}: speed") for s in speeds]
        nodes.append(out)
    return nodes


def build_cluster(nodes: list[dict], gpus: int | None, source: str, hardware: HardwareProfile | None = None) -> Cluster:
    """Devices in rank order and a profile per GPU type. `hardware` (a --hardware profile, e.g. calibrated on
    this machine) stands for the devices of its own type; other types use the catalog."""
    total = sum(n["count"] for n in nodes)
    if gpus is not None and gpus != total:
        raise UserError(f"{source} describes {total} device(s) but --gpus is {gpus}")
    devices, rank = [], 0
    for i, node in enumerate(nodes):
        for k in range(node["count"]):
            devices.append(Device(rank=rank, node=i, gpu=node["gpu"], speed=node.get("speed", [1.0] * node["count"])[k]))
            rank += 1
    intra = [n["intra_node_gbs"] for n in nodes if "intra_node_gbs" in n]
    inter = [n["inter_node_gbs"] for n in nodes if "inter_node_gbs" in n]
    cluster = Cluster(devices=devices, gpus_per_node=min(n["count"] for n in nodes),
                      intra_node_gbs=min(intra) if intra else None, inter_node_gbs=min(inter) if inter else None,
                      source=source)
    types = list(dict.fromkeys(d.gpu for d in devices))
    intra_all = cluster.intra_node_gbs or min(get_gpu(t).intra_node_gbs for t in types)
    inter_all = cluster.inter_node_gbs or min(get_gpu(t).inter_node_gbs for t in types)
    for t in types:
        spec = with_cluster_overrides(get_gpu(t), gpus_per_node=cluster.gpus_per_node, intra=intra_all, inter=inter_all)
        if hardware is not None and hardware.gpu.name == t:
            gpu = with_cluster_overrides(hardware.gpu, gpus_per_node=cluster.gpus_per_node)
            cluster.profiles[t] = dataclasses.replace(hardware, gpu=gpu)
        else:
            cluster.profiles[t] = profile_from_spec(spec)
    return cluster


def reference_profile(cluster: Cluster, dtype: str) -> HardwareProfile:
    """One profile for the planner's search: the slowest device's type at its speed, with the smallest memory
    in the cluster (a layout the search keeps must fit every device when split evenly)."""
    for t, prof in cluster.profiles.items():
        if dtype not in prof.gpu.peak_tflops:
            raise UserError(f"{t} has no {dtype} peak (known: {', '.join(prof.gpu.peak_tflops)})")
    slowest = max(cluster.devices, key=lambda d: _device_seconds(cluster, d, dtype))
    prof = cluster.profile_for(slowest)
    smallest = min(cluster.mem_gib(d) for d in cluster.devices)
    return dataclasses.replace(prof, gpu=with_cluster_overrides(prof.gpu, mem_gib=smallest))


def _device_seconds(cluster: Cluster, device: Device, dtype: str) -> float:
    """A rough per-FLOP cost to order devices: the type's large-matmul rate, times its speed."""
    prof = cluster.profiles[device.gpu]
    rate = prof.dtype_tflops.get(dtype) or max(prof.dtype_tflops.values())
    return prof.compute_scale / (rate * device.speed)


def resolve_cluster(o: dict, hardware: HardwareProfile | None) -> Cluster | None:
    """The cluster `plan` was given (--cluster FILE, or --gpu as a list), or None for one GPU type."""
    if o.get("cluster"):
        if is_gpu_list(o.get("gpu")):
            raise UserError("give either --cluster FILE or --gpu as a list, not both")
        return build_cluster(read_cluster_file(o["cluster"]), o.get("gpus"), f"cluster file {o['cluster']}",
                             hardware)
    if is_gpu_list(o.get("gpu")):
        return build_cluster(parse_gpu_list(o["gpu"]), o.get("gpus"), f"--gpu {o['gpu']}", hardware)
    return None
