"""What precision a run computes in, decided once: FP8 (torchao float8 linears, GPUs with FP8 tensor cores),
CUDA graphs (one GPU), and TF32 for fp32 on CUDA. Each refusal is one line, before any process starts."""

from __future__ import annotations

import importlib.util
import logging

from paratrain.errors import UserError

log = logging.getLogger("paratrain")

FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) or newer


def cuda_device_of_this_process() -> tuple[str, tuple[int, int]]:
    import torch

    return torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability())


def check_precision(cfg, layout, device_type: str, gpu: tuple[str, tuple[int, int]] | None = None) -> None:
    """Raise UserError for an fp8 or --cuda-graphs run that cannot work here. `gpu`: (name, compute capability)
    of the CUDA device (default: this process's)."""
    if cfg.dtype == "fp8":
        check_fp8(layout, device_type, gpu)
    if getattr(cfg, "cuda_graphs", False):
        check_cuda_graphs(layout, device_type)


def check_fp8(layout, device_type: str, gpu: tuple[str, tuple[int, int]] | None = None) -> None:
    if device_type != "cuda":
        raise UserError(f"--dtype fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper "
                        f"or newer); this run is on {device_type}: use --dtype bf16 or fp32")
    name, capability = gpu or cuda_device_of_this_process()
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise UserError(f"--dtype fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper or newer); "
                        f"{name} is {capability[0]}.{capability[1]}: use --dtype bf16")
    if layout.splits_within_layers:
        raise UserError(f"--dtype fp8 with tensor parallel (tp={layout.tp}) needs torchao's float8 TP styles, which "
                        "paratrain does not apply yet: use fp8 with single, ddp, zero1/2/3 or hsdp, or bf16 with tp")
    if importlib.util.find_spec("torchao") is None:
        raise UserError("--dtype fp8 needs torchao for its float8 linears: pip install torchao "
                        "(or pip install 'paratrain[fp8]')")


def check_cuda_graphs(layout, device_type: str) -> None:
    if device_type != "cuda":
        raise UserError(f"--cuda-graphs captures the step's CUDA kernels and needs a CUDA GPU; this run is on "
                        f"{device_type}")
    if layout.world > 1:
        raise UserError(f"--cuda-graphs runs on one GPU (single, or ddp with --nproc 1); {layout.strategy} over "
                        f"{layout.world} processes launches collectives inside the step, which paratrain does not "
                        "capture")


def enable_tf32(device_type: str, dtype: str, tf32: bool) -> bool:
    """fp32 on CUDA: matmuls and convolutions in TF32 unless --no-tf32 (then true fp32). Returns whether TF32 is on,
    which is also the peak MFU is measured against (the catalog's "fp32" is the TF32 peak)."""
    if device_type != "cuda" or dtype != "fp32":
        return False
    import torch

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    log.info("fp32 matmuls run %s", "in TF32 on tensor cores (--no-tf32 for true fp32); MFU against the TF32 peak"
             if tf32 else "in true fp32 (TF32 off); MFU against the CUDA-core fp32 peak")
    return tf32


def peak_dtype(dtype: str, tf32: bool) -> str:
    """The catalog peak that matches what runs: fp32 is the TF32 peak only with TF32 on."""
    if dtype == "fp32":
        return "fp32" if tf32 else "fp32_simt"
    return dtype
