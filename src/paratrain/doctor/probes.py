"""Short calibration probes run between training steps: matmul rate, per-op fixed cost, metrics-record cost.

Probes use their own constant tensors (no RNG draws), so the run they sit in is unchanged.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

PROBE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops_per_s(device: torch.device, dtype: str = "fp32", repeats: int = 3) -> float:
    """Achieved FLOP/s of a dense matmul big enough to reach this device's steady rate (median of repeats)."""
    m, k, n = (4096, 4096, 4096) if device.type == "cuda" else (256, 512, 1024)
    torch_dtype = PROBE_DTYPES.get(dtype, torch.float32) if device.type == "cuda" else torch.float32
    a = torch.full((m, k), 0.5, device=device, dtype=torch_dtype)
    b = torch.full((k, n), 0.25, device=device, dtype=torch_dtype)
    inner = 10 if device.type == "cuda" else 1
    torch.mm(a, b)
    _sync(device)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        _sync(device)
        rates.append(2.0 * m * k * n * inner / max(time.perf_counter() - t0, 1e-9))
    return statistics.median(rates)


def tiny_autograd_program(x: torch.Tensor, w: torch.Tensor) -> None:
    """A few small ops forward and backward: their cost is almost all fixed per-op overhead."""
    y = torch.nn.functional.linear(x, w)
    y = torch.nn.functional.silu(y * 2.0 + 1.0)
    y.sum().backward()


def op_probe_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.full((2, 8), 0.1, device=device, requires_grad=True)
    w = torch.full((8, 8), 0.01, device=device, requires_grad=True)
    return x, w


def time_tiny_program(device: torch.device, iterations: int = 60) -> float:
    """Seconds per run of tiny_autograd_program (median of 3 blocks)."""
    x, w = op_probe_tensors(device)
    tiny_autograd_program(x, w)
    blocks = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iterations):
            tiny_autograd_program(x, w)
        _sync(device)
        blocks.append((time.perf_counter() - t0) / iterations)
    return statistics.median(blocks)


def metrics_record_cost_s(records: int = 200) -> float:
    """Seconds to log one per-step metrics record (what --metrics adds to every step)."""
    from paratrain.train.metrics import StepLog

    record = {"step": 1, "loss": 2.5, "lr": 3e-3, "grad_norm": 1.0, "step_time_s": 0.01, "data_wait_s": 0.0,
              "tokens_per_s": 1e5, "mfu": None, "mem_peak_gib": 0.5}
    with tempfile.TemporaryDirectory(prefix="paratrain-doctor-") as tmp:
        log = StepLog(Path(tmp), records, None, enabled=True, quiet=True)
        t0 = time.perf_counter()
        for i in range(records):
            log.log({**record, "step": i})
        elapsed = time.perf_counter() - t0
        log.close()
    return elapsed / records
