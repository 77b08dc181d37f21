"""Hardware catalog: datasheet dense peaks, memory and link bandwidths; plus detection of this machine.

Peaks are dense (no structured sparsity) tensor-core figures. Bandwidths are GB/s per GPU, one direction.
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
    source: str = ""
    extra: dict = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise UserError(f"no {dtype} peak is known for {self.name}")
        return self.peak_tflops[dtype]

    def to_dict(self) -> dict:
        return asdict(self)


# fp32 entries are the TF32 tensor-core dense peak where the GPU has one (that is what torch uses for
# fp32 matmuls when allow_tf32 is on); "fp32_simt" is the plain CUDA-core fp32 peak.
CATALOG: dict[str, GPUSpec] = {
    "a100-40": GPUSpec("a100-40", {"bf16": 312, "fp16": 312, "fp32": 156, "fp32_simt": 19.5}, 40, 300, 25,
                       source="NVIDIA A100 datasheet (2021): BF16/FP16 312, TF32 156, FP32 19.5 TFLOPS dense; "
                              "NVLink 600 GB/s bidirectional; DGX A100: one 200 Gb/s HDR NIC per GPU"),
    "a100-80": GPUSpec("a100-80", {"bf16": 312, "fp16": 312, "fp32": 156, "fp32_simt": 19.5}, 80, 300, 25,
                       source="NVIDIA A100 80GB datasheet: same compute as A100 40GB; NVLink 600 GB/s bidirectional"),
    "h100-sxm": GPUSpec("h100-sxm", {"bf16": 989, "fp16": 989, "fp32": 494, "fp32_simt": 67}, 80, 450, 50,
                        source="NVIDIA H100 datasheet, SXM: BF16 1979 sparse = 989 dense, TF32 494 dense, FP32 67; "
                               "NVLink 900 GB/s bidirectional; DGX H100: one 400 Gb/s NDR NIC per GPU"),
    "h100-pcie": GPUSpec("h100-pcie", {"bf16": 756, "fp16": 756, "fp32": 378, "fp32_simt": 51}, 80, 300, 50,
                         source="NVIDIA H100 datasheet, PCIe: BF16 1513 sparse = 756 dense, TF32 378 dense, "
                                "FP32 51; NVLink bridge 600 GB/s bidirectional"),
    "h200": GPUSpec("h200", {"bf16": 989, "fp16": 989, "fp32": 494, "fp32_simt": 67}, 141, 450, 50,
                    source="NVIDIA H200 datasheet, SXM: BF16 1979 sparse = 989 dense, 141 GB HBM3e; "
                           "NVLink 900 GB/s bidirectional"),
    "a6000": GPUSpec("a6000", {"bf16": 154.8, "fp16": 154.8, "fp32": 77.4, "fp32_simt": 38.7}, 48, 56.25, 12.5,
                     gpus_per_node=8,
                     source="NVIDIA RTX A6000 datasheet: 309.7 sparse tensor TFLOPS = 154.8 dense (FP16/BF16 "
                            "with FP32 accumulate), TF32 77.4 dense, FP32 38.7; NVLink bridge 112.5 GB/s bidirectional"),
    "rtx4090": GPUSpec("rtx4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6, "fp32_simt": 82.6}, 24, 32, 12.5,
                       source="NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 330.3 sparse FP16/BF16 "
                              "tensor TFLOPS with FP16 accumulate = 165.2 dense; no NVLink, PCIe 4.0 x16 32 GB/s"),
    "l4": GPUSpec("l4", {"bf16": 121, "fp16": 121, "fp32": 60, "fp32_simt": 30.3}, 24, 32, 12.5,
                  source="NVIDIA L4 datasheet: BF16 242 sparse = 121 dense, TF32 120 sparse = 60 dense, "
                         "FP32 30.3; PCIe 4.0 x16 64 GB/s bidirectional"),
    "l40s": GPUSpec("l40s", {"bf16": 362, "fp16": 362, "fp32": 183, "fp32_simt": 91.6}, 48, 32, 25,
                    source="NVIDIA L40S datasheet: BF16 733 sparse = 362 dense, TF32 366 sparse = 183 dense, "
                           "FP32 91.6; PCIe 4.0 x16 64 GB/s bidirectional"),
    "cpu": GPUSpec("cpu", {"bf16": 0.5, "fp16": 0.5, "fp32": 0.5, "fp32_simt": 0.5}, 24, 5, 1.25, gpus_per_node=2,
                   source="placeholder for a CPU 'device': calibrate with `paratrain plan --calibrate` for real figures"),
}


def get_gpu(name: str) -> GPUSpec:
    key = name.lower()
    if key not in CATALOG:
        raise UserError(f"unknown GPU {name!r}; known: {', '.join(CATALOG)} (or give --peak-tflops --mem-gib "
                        f"--intra-node-gbs --inter-node-gbs)")
    return CATALOG[key]


_NAME_HINTS = (("h100", "pcie", "h100-pcie"), ("h100", "", "h100-sxm"), ("h200", "", "h200"),
               ("a100", "80", "a100-80"), ("a100", "", "a100-40"), ("a6000", "", "a6000"),
               ("4090", "", "rtx4090"), ("l40s", "", "l40s"), ("l4", "", "l4"))


def catalog_name_for(device_name: str) -> str | None:
    """Map a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3') to a catalog key, or None if unknown."""
    low = device_name.lower()
    for needle, qualifier, key in _NAME_HINTS:
        if needle in low and qualifier in low:
            return key
    return None


def device_peak_tflops(device_type: str, dtype: str) -> float | None:
    """The catalog peak for the device this process runs on, or None when it is not honestly known.

    Never falls back to another GPU's peak: an unknown GPU gives None (MFU is then not reported).
    """
    if device_type != "cuda":
        return None
    import torch

    key = catalog_name_for(torch.cuda.get_device_name())
    return CATALOG[key].peak(dtype) if key else None
