"""Hardware the planner reasons about: profiles built on the GPU catalog (gpu_catalog.py), and detect().

Peaks are dense (no structured sparsity) tensor-core figures. Bandwidths are GB/s per GPU, one direction.
A profile (HardwareProfile) is what the time model reads: catalog figures times documented efficiencies,
or what `paratrain plan --calibrate` measured on this machine.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from paratrain.errors import UserError, read_json_file
from paratrain.gpu_catalog import GPUSpec, catalog_name_for

# -- profiles: what the time model reads -------------------------------------------------------------------------
# Documented efficiencies for catalog GPUs (no calibration): cuBLAS bf16 GEMMs of LLM size reach ~70% of the
# dense datasheet peak on A100/H100; FlashAttention-2 ~40% (its backward recomputes); memory-bound kernels ~80%
# of HBM bandwidth; NCCL ring bus bandwidth ~80% of the link.
MATMUL_EFFICIENCY = 0.70
ATTENTION_EFFICIENCY = 0.40
MEMORY_EFFICIENCY = 0.80
LINK_EFFICIENCY = 0.80
# Per GPU type, where a published measurement is more specific than the defaults above (one entry per type,
# never per run):
#  A100: optimized GEMMs reach 80-90% of the peak, FlashAttention-2 50-73% forward+backward (Dao 2023,
#        "FlashAttention-2", abstract and section 1): 80% and 50%, the low ends.
#  H100 / H200: FlashAttention-2 (torch's SDPA flash kernel) reaches about 35% (Shah et al. 2024,
#        "FlashAttention-3", abstract); GEMMs keep the 70% default.
GPU_EFFICIENCY = {
    "a100-40": {"matmul": 0.80, "attention": 0.50}, "a100-80": {"matmul": 0.80, "attention": 0.50},
    "h100-sxm": {"attention": 0.35}, "h100-pcie": {"attention": 0.35}, "h200": {"attention": 0.35},
}
GPU_KERNEL_US = 4.0  # launch floor of one kernel; overlapped with the previous kernel's work (async launch)
GPU_LATENCY_US = {"intra": 10.0, "inter": 20.0}  # per ring hop


@dataclass
class HardwareProfile:
    """Achievable rates of one device type. Built from the catalog (documented efficiencies) or calibrated."""

    gpu: GPUSpec
    dtype_tflops: dict[str, float]  # achievable large-matmul TFLOP/s per dtype
    matmul_curve: dict[str, list[list[float]]] = field(default_factory=dict)  # dtype -> [[flops per call, TFLOP/s]]
    attention_tflops_fraction: float = ATTENTION_EFFICIENCY / MATMUL_EFFICIENCY  # of the matmul rate
    mem_bw_gbs: float = 0.0  # achievable
    op_overhead_us: dict[str, float] = field(default_factory=lambda: {"fwd": GPU_KERNEL_US, "bwd": GPU_KERNEL_US,
                                                                      "view": 0.0, "opt": GPU_KERNEL_US})
    overhead_overlaps: bool = True  # GPU: launch cost hides under the previous kernel; CPU: it adds
    # collective -> {"latency_us": per call, "busbw_gbs": ring bus bandwidth}, measured (calibrated) or None
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    link_gbs: dict[str, float] = field(default_factory=dict)  # "intra" / "inter": achievable per-GPU bandwidth
    latency_us: dict[str, float] = field(default_factory=lambda: dict(GPU_LATENCY_US))
    overlap: float = 0.9  # fraction of overlappable communication that hides under compute
    compute_scale: float = 1.0  # measured / op-level-predicted time of a reference training step (calibration)
    # on a host-synchronous device (CPU) per-op overhead is scaled on its own (fitted with compute_scale on two
    # reference sizes); None: the same as compute_scale
    overhead_scale: float | None = None
    # host-side costs of the frameworks strategies run on: extra per DTensor op (TP), per parameter per FSDP
    # gather / reduce-scatter (hooks, copy-in/out bookkeeping), per pipeline micro-batch per stage
    framework_us: dict[str, float] = field(default_factory=lambda: {"dtensor_op": 0.0, "fsdp_param": 0.0,
                                                                     "pp_microbatch": 0.0})
    calibrated: bool = False
    source: str = "catalog"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["format"] = "paratrain-hardware-profile/1"
        return doc

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p


def profile_from_spec(spec: GPUSpec) -> HardwareProfile:
    """A catalog GPU with the documented efficiencies applied."""
    eff = GPU_EFFICIENCY.get(spec.name, {})
    matmul, attention = eff.get("matmul", MATMUL_EFFICIENCY), eff.get("attention", ATTENTION_EFFICIENCY)
    tflops = {d: p * matmul for d, p in spec.peak_tflops.items() if d != "fp32_simt"}
    link = {"intra": spec.intra_node_gbs * LINK_EFFICIENCY, "inter": spec.inter_node_gbs * LINK_EFFICIENCY}
    notes = [f"compute: {matmul:.0%} of the datasheet dense peak for matmuls, "
             f"{attention:.0%} for attention, {MEMORY_EFFICIENCY:.0%} of memory bandwidth for the rest",
             f"links: {LINK_EFFICIENCY:.0%} of {spec.intra_node_gbs:g} GB/s intra-node, "
             f"{spec.inter_node_gbs:g} GB/s inter-node per GPU"]
    if spec.name == "cpu":
        notes.append("the 'cpu' entry is a placeholder; calibrate (paratrain plan --calibrate) for real figures")
    return HardwareProfile(gpu=spec, dtype_tflops=tflops, mem_bw_gbs=spec.mem_bw_gbs * MEMORY_EFFICIENCY,
                           attention_tflops_fraction=attention / matmul, link_gbs=link,
                           source=f"catalog: {spec.source}", notes=notes)


def load_profile(path: str | Path) -> HardwareProfile:
    p = Path(path)
    doc = read_json_file(p, "hardware profile")
    if not isinstance(doc, dict) or doc.get("format") != "paratrain-hardware-profile/1":
        raise UserError(f"{path} is not a paratrain hardware profile (write one with `paratrain plan --calibrate`)")
    try:
        gpu = GPUSpec(**doc.pop("gpu"))
        doc.pop("format")
        return HardwareProfile(gpu=gpu, **doc)
    except (TypeError, KeyError) as exc:
        raise UserError(f"hardware profile {path} has unexpected fields: {exc}") from None


def with_cluster_overrides(spec: GPUSpec, gpus_per_node: int | None = None, intra: float | None = None,
                           inter: float | None = None, mem_gib: float | None = None,
                           mem_bw_gbs: float | None = None) -> GPUSpec:
    """The catalog entry with the figures a cluster states for itself (a board variant's memory size and
    bandwidth, its links); the compute peaks stay the datasheet's."""
    changes = {k: v for k, v in (("gpus_per_node", gpus_per_node), ("intra_node_gbs", intra),
                                 ("inter_node_gbs", inter), ("mem_gib", mem_gib), ("mem_bw_gbs", mem_bw_gbs))
               if v is not None}
    return replace(spec, **changes) if changes else spec


# -- this machine -----------------------------------------------------------------------------------------------
def _total_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def detect() -> dict:
    """Describe the machine this runs on: {"gpu": catalog key or "cpu" or None, "gpus", "mem_gib", ...}."""
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        return {"device": "cuda", "gpu": catalog_name_for(names[0]), "device_name": names[0], "gpus": len(names),
                "mem_gib": round(mem, 2), "gpus_per_node": len(names)}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"device": "cpu", "gpu": "cpu", "device_name": "cpu", "gpus": cores, "mem_gib": round(_total_memory_gib(), 2),
            "gpus_per_node": cores, "torch_threads": torch.get_num_threads()}


def default_profile_path() -> Path:
    """Where `plan --calibrate` saves, and where `train --strategy auto` looks, unless told otherwise."""
    base = os.environ.get("PARATRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "paratrain")
    return Path(base) / "hardware-profile.json"
