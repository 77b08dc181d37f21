"""The GPU catalog: datasheet figures per GPU type, and naming the device a process runs on.

Peaks are dense (no structured sparsity) tensor-core figures. Bandwidths are GB/s per GPU, one direction.
A leaf module: the trainer reads peaks from it for MFU, the planner builds its hardware profiles on it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paratrain.errors import UserError


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_tflops: dict[str, float]  # dtype -> dense TFLOP/s
    mem_gib: float
    intra_node_gbs: float  # per GPU, one direction (NVLink, or PCIe when there is none)
    inter_node_gbs: float  # per GPU, one direction (the NIC share of one GPU)
    gpus_per_node: int = 8
    mem_bw_gbs: float = 0.0  # device memory bandwidth (HBM / GDDR), GB/s
    source: str = ""
    assumptions: str = ""  # cluster-shape defaults that are ours, not the datasheet's
    extra: dict = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise UserError(f"no {dtype} peak is known for {self.name}; known: {', '.join(self.peak_tflops)}")
        return self.peak_tflops[dtype]

    def to_dict(self) -> dict:
        return asdict(self)


_DGX_A100 = "DGX/HGX A100 shape: 8 GPUs per node, one 200 Gb/s HDR NIC per GPU (25 GB/s)"
_DGX_H100 = "DGX/HGX H100 shape: 8 GPUs per node, one 400 Gb/s NDR NIC per GPU (50 GB/s)"
_PCIE_BOX = "assumed: 8 GPUs per PCIe server, intra-node over PCIe 4.0 x16 (32 GB/s), one 100 Gb/s NIC per GPU"

# fp32 entries are the TF32 tensor-core dense peak where the GPU has one (what torch uses for fp32 matmuls when
# allow_tf32 is on); "fp32_simt" is the plain CUDA-core fp32 peak. Sources: NVIDIA's datasheets, as named.
CATALOG: dict[str, GPUSpec] = {
    "a100-40": GPUSpec("a100-40", {"bf16": 312, "fp16": 312, "fp32": 156, "fp32_simt": 19.5}, 40, 300, 25,
                       mem_bw_gbs=1555, assumptions=_DGX_A100,
                       source="NVIDIA A100 Tensor Core GPU datasheet (2021), SXM 40GB: BF16/FP16 312, TF32 156, "
                              "FP32 19.5 TFLOPS dense; HBM2 1,555 GB/s; NVLink 600 GB/s bidirectional"),
    "a100-80": GPUSpec("a100-80", {"bf16": 312, "fp16": 312, "fp32": 156, "fp32_simt": 19.5}, 80, 300, 25,
                       mem_bw_gbs=2039, assumptions=_DGX_A100,
                       source="NVIDIA A100 Tensor Core GPU datasheet (2021), SXM 80GB: same compute as 40GB; "
                              "HBM2e 2,039 GB/s; NVLink 600 GB/s bidirectional"),
    "h100-sxm": GPUSpec("h100-sxm", {"bf16": 989, "fp16": 989, "fp32": 494, "fp32_simt": 67, "fp8": 1979}, 80, 450, 50,
                        mem_bw_gbs=3350, assumptions=_DGX_H100,
                        source="NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 1,979 with sparsity = 989 dense, "
                               "TF32 989 sparse = 494 dense, FP32 67, FP8 3,958 sparse = 1,979 dense; HBM3 3.35 TB/s; NVLink 900 GB/s bidirectional"),
    "h100-pcie": GPUSpec("h100-pcie", {"bf16": 756, "fp16": 756, "fp32": 378, "fp32_simt": 51, "fp8": 1513}, 80, 300, 50,
                         mem_bw_gbs=2000, assumptions=_DGX_H100 + "; intra-node via NVLink bridge",
                         source="NVIDIA H100 Tensor Core GPU datasheet, PCIe: BF16 1,513 sparse = 756 dense, TF32 756 "
                                "sparse = 378 dense, FP32 51, FP8 3,026 sparse = 1,513 dense; HBM2e 2 TB/s; NVLink bridge 600 GB/s bidirectional"),
    "h200": GPUSpec("h200", {"bf16": 989, "fp16": 989, "fp32": 494, "fp32_simt": 67, "fp8": 1979}, 141, 450, 50,
                    mem_bw_gbs=4800, assumptions=_DGX_H100,
                    source="NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 sparse = 989 dense, TF32 494 "
                           "dense, FP32 67, FP8 3,958 sparse = 1,979 dense; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s bidirectional"),
    "a6000": GPUSpec("a6000", {"bf16": 154.8, "fp16": 154.8, "fp32": 77.4, "fp32_simt": 38.7}, 48, 32, 12.5,
                     mem_bw_gbs=768, assumptions=_PCIE_BOX + " (an NVLink bridge joins only pairs: 56 GB/s)",
                     source="NVIDIA RTX A6000 datasheet: BF16/FP16 tensor 309.7 sparse = 154.8 dense (FP32 "
                            "accumulate), TF32 154.8 sparse = 77.4 dense, FP32 38.7; GDDR6 768 GB/s; PCIe 4.0 x16"),
    "rtx4090": GPUSpec("rtx4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6, "fp32_simt": 82.6}, 24, 32, 12.5,
                       mem_bw_gbs=1008, assumptions=_PCIE_BOX + " (no NVLink on the 4090)",
                       source="NVIDIA Ada GPU architecture whitepaper, RTX 4090: BF16 tensor with FP32 accumulate "
                              "165.2 dense (330.4 sparse), TF32 82.6 dense, FP32 82.6; GDDR6X 1,008 GB/s"),
    "l4": GPUSpec("l4", {"bf16": 121, "fp16": 121, "fp32": 60, "fp32_simt": 30.3}, 24, 32, 12.5,
                  mem_bw_gbs=300, assumptions=_PCIE_BOX,
                  source="NVIDIA L4 datasheet: BF16 242 sparse = 121 dense, TF32 120 sparse = 60 dense, FP32 30.3; "
                         "GDDR6 300 GB/s; PCIe 4.0 x16 64 GB/s bidirectional"),
    "l40s": GPUSpec("l40s", {"bf16": 362.05, "fp16": 362.05, "fp32": 183, "fp32_simt": 91.6}, 48, 32, 25,
                    mem_bw_gbs=864, assumptions=_PCIE_BOX.replace("100 Gb/s", "200 Gb/s"),
                    source="NVIDIA L40S datasheet: BF16 733 sparse = 362.05 dense, TF32 366 sparse = 183 dense, "
                           "FP32 91.6; GDDR6 864 GB/s; PCIe 4.0 x16 64 GB/s bidirectional"),
    "cpu": GPUSpec("cpu", {"bf16": 0.05, "fp16": 0.05, "fp32": 0.05, "fp32_simt": 0.05}, 24, 5, 1.25,
                   gpus_per_node=2, mem_bw_gbs=5,
                   source="placeholder, not a datasheet: run `paratrain plan --calibrate` for this machine's figures",
                   assumptions="one process per core; gloo over loopback"),
}


def known_gpus() -> str:
    return ", ".join(CATALOG)


def get_gpu(name: str) -> GPUSpec:
    key = name.lower()
    if key not in CATALOG:
        raise UserError(f"unknown GPU {name!r}; known: {known_gpus()} (or give --peak-tflops --mem-gib "
                        f"--intra-node-gbs --inter-node-gbs for custom hardware)")
    return CATALOG[key]


def custom_gpu(peak_tflops: float, mem_gib: float, intra_node_gbs: float, inter_node_gbs: float, dtype: str,
               name: str = "custom", gpus_per_node: int = 8, mem_bw_gbs: float | None = None) -> GPUSpec:
    """A GPU described on the command line. The peak is for the plan's dtype only (no guessing the others)."""
    for label, value in (("--peak-tflops", peak_tflops), ("--mem-gib", mem_gib),
                         ("--intra-node-gbs", intra_node_gbs), ("--inter-node-gbs", inter_node_gbs)):
        if value is None or value <= 0:
            raise UserError(f"custom hardware needs {label} > 0 (got {value})")
    assumed = ""
    if mem_bw_gbs is None:
        # H100 SXM's ratio of memory bandwidth to bf16 peak (3350 GB/s / 989 TFLOP/s)
        mem_bw_gbs = peak_tflops * 3350 / 989
        assumed = f"; memory bandwidth assumed {mem_bw_gbs:.0f} GB/s (H100's bytes per FLOP)"
    return GPUSpec(name, {dtype: float(peak_tflops)}, float(mem_gib), float(intra_node_gbs), float(inter_node_gbs),
                   gpus_per_node=gpus_per_node, mem_bw_gbs=float(mem_bw_gbs), source="given on the command line",
                   assumptions=f"{gpus_per_node} GPUs per node{assumed}")


# -- naming the device this process runs on ---------------------------------------------------------------------
# Whole device names as torch.cuda.get_device_name() reports them, normalised (see _normalise): a name must match
# one of these exactly, so a sibling model never borrows a peak ("NVIDIA L40" is not an L4 nor an L40S, an H100
# NVL or H800 is not an H100 SXM, an "RTX 6000 Ada" is not an RTX A6000, a 4090 D is not a 4090).
_DEVICE_NAMES: dict[str, str] = {
    "h100 80gb hbm3": "h100-sxm", "h100 sxm5 80gb": "h100-sxm", "h100 sxm": "h100-sxm",
    "h100 pcie": "h100-pcie", "h100 80gb pcie": "h100-pcie",
    "h200": "h200", "h200 141gb hbm3e": "h200",
    "a100 sxm4 40gb": "a100-40", "a100 pcie 40gb": "a100-40", "a100 40gb pcie": "a100-40",
    "a100 sxm4 80gb": "a100-80", "a100 pcie 80gb": "a100-80", "a100 80gb pcie": "a100-80",
    "rtx a6000": "a6000",
    "rtx 4090": "rtx4090",
    "l4": "l4",
    "l40s": "l40s",
}


def _normalise(device_name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'a100 sxm4 80gb'; 'NVIDIA GeForce RTX 4090' -> 'rtx 4090'."""
    words = device_name.lower().replace("-", " ").replace("_", " ").split()
    return " ".join(w for w in words if w not in ("nvidia", "geforce", "tesla"))


def catalog_name_for(device_name: str) -> str | None:
    """Map a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3') to a catalog key by its exact model, or None when
    the model is not in the catalog (then MFU is unknown rather than measured against another GPU's peak)."""
    return _DEVICE_NAMES.get(_normalise(device_name))


def device_peak_tflops(device_type: str, dtype: str) -> float | None:
    """The catalog peak for the device this process runs on, or None when it is not honestly known.

    Never falls back to another GPU's peak: an unknown GPU gives None (MFU is then not reported).
    """
    if device_type != "cuda":
        return None
    import torch

    key = catalog_name_for(torch.cuda.get_device_name())
    return CATALOG[key].peak_tflops.get(dtype) if key else None  # e.g. no fp8 peak for this GPU: unknown


# -- MIG slices ---------------------------------------------------------------------------------------------------
# NVIDIA's Multi-Instance GPU user guide, "Supported MIG Profiles": profile -> (compute slices of 7, memory slices
# of 8, instances one GPU holds). The GB in a profile's name is the slice's memory.
_MIG_80GB = {"1g.10gb": (1, 1, 7), "1g.20gb": (1, 2, 4), "2g.20gb": (2, 2, 3), "3g.40gb": (3, 4, 2),
             "4g.40gb": (4, 4, 1), "7g.80gb": (7, 8, 1)}
MIG_PROFILES: dict[str, dict[str, tuple[int, int, int]]] = {
    "a100-40": {"1g.5gb": (1, 1, 7), "1g.10gb": (1, 2, 4), "2g.10gb": (2, 2, 3), "3g.20gb": (3, 4, 2),
                "4g.20gb": (4, 4, 1), "7g.40gb": (7, 8, 1)},
    "a100-80": _MIG_80GB,
    "h100-sxm": _MIG_80GB,
    "h100-pcie": _MIG_80GB,
    "h200": {"1g.18gb": (1, 1, 7), "1g.35gb": (1, 2, 4), "2g.35gb": (2, 2, 3), "3g.71gb": (3, 4, 2),
             "4g.71gb": (4, 4, 1), "7g.141gb": (7, 8, 1)},
}
# MIG has no peer-to-peer path (NVLink or PCIe) between slices: they exchange through host memory
_MIG_HOST_GBS = 32.0


def mig_profile_names() -> list[str]:
    """Every MIG profile of the catalog's GPUs, for checking a launch's --mig where the GPU type is not named."""
    return sorted({p for table in MIG_PROFILES.values() for p in table}, key=_mig_order)


def _mig_order(profile: str) -> tuple[int, float]:
    compute, memory = profile.removesuffix("gb").split("g.")
    return int(compute), float(memory)


def check_mig_profile(profile: str, gpu: str | None = None) -> str:
    """The profile name, or a UserError listing the valid ones (those of `gpu` when it is given)."""
    valid = list(MIG_PROFILES[gpu]) if gpu else mig_profile_names()
    if profile not in valid:
        where = f" on {gpu}" if gpu else ""
        raise UserError(f"unknown MIG profile {profile!r}{where}; valid: {', '.join(valid)}")
    return profile


def mig_slice(spec: GPUSpec, profile: str) -> GPUSpec:
    """The catalog GPU cut to one MIG slice: g/7 of its compute, the profile's memory, its share of memory
    bandwidth, host-memory links between slices, and the node's NIC shared by the slices of each GPU."""
    if spec.name not in MIG_PROFILES:
        raise UserError(f"{spec.name} has no MIG; GPUs with MIG profiles: {', '.join(MIG_PROFILES)}")
    compute, memory, per_gpu = MIG_PROFILES[spec.name][check_mig_profile(profile, spec.name)]
    share = compute / 7
    return GPUSpec(
        f"{spec.name}/mig-{profile}",
        {dtype: peak * share for dtype, peak in spec.peak_tflops.items()},
        _mig_order(profile)[1],
        min(spec.intra_node_gbs, _MIG_HOST_GBS),
        spec.inter_node_gbs / per_gpu,
        gpus_per_node=spec.gpus_per_node * per_gpu,
        mem_bw_gbs=spec.mem_bw_gbs * memory / 8,
        source=f"{spec.source}; MIG {profile}: {compute}/7 of the SMs, {memory}/8 of the memory "
               "(NVIDIA MIG user guide, supported profiles)",
        assumptions=f"{spec.assumptions}; {per_gpu} {profile} slices per GPU, each a device; no peer-to-peer "
                    f"between MIG slices (host memory, assumed {_MIG_HOST_GBS:g} GB/s); the NIC is shared by "
                    "a GPU's slices",
        extra={**spec.extra, "mig": profile, "mig_of": spec.name},
    )
