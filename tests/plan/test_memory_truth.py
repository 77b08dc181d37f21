"""Memory truth: the planner's per-rank peak vs the peak measured by the live-tensor tracker on CPU.

Reference: calibrate/harness.py runs the real Trainer (2 gloo ranks, one process group for every config) under a
LiveTensorTracker and reports each rank's peak live bytes over a steady-state step. Tolerance: 10% on the
busiest rank, for two model sizes (tiny, and `small`: 4 layers, d=256, vocab 4096), plus the GPT-2 family, an
MoE (moe-tiny: one device, zero3, and --ep over both ranks) and LoRA runs (the frozen base, the adapters'
gradients and AdamW state; under zero3, and tp-sp with every linear adapted and dropout).
"""

from __future__ import annotations

import pytest

from memory_check import predicted_vs_measured
from paratrain.calibrate.harness import measure
from paratrain.config import TrainConfig

STRATEGIES = [("single", {}), ("ddp", {}), ("zero1", {}), ("zero2", {}), ("zero3", {}), ("tp", {}), ("tp-sp", {}),
              ("pp", {"pp_schedule": "1f1b", "micro_batch": 1}), ("cp-ring", {}), ("cp-ulysses", {})]
MODELS = [("tiny", 64, 8, 4), ("small", 64, 4, 2)]  # (preset, seq_len, global batch, micro-batch)
TOLERANCE = 0.10


GPT2 = [("single", {}), ("tp-sp", {}), ("zero3", {})]  # the GPT-2 family (LayerNorm, GELU, learned positions)
MOE = [("single", {}), ("zero3", {}), ("ep", {})]  # Mixture of Experts: routed copies, experts split under --ep
LORA = [("zero3", {"lora_r": 8}),  # adapters on wq, wv; on every linear, with dropout
        ("tp-sp", {"lora_r": 4, "lora_targets": "wq,wk,wv,wo,w1,w2,w3", "lora_dropout": 0.1})]


def _configs():
    cfgs = []
    for model, seq, batch, micro in MODELS + [("gpt2-tiny", 64, 8, 4), ("moe-tiny", 64, 8, 4)]:
        for strategy, extra in (GPT2 if model.startswith("gpt2") else MOE if model.startswith("moe") else STRATEGIES):
            fields = {"model": model, "seq_len": seq, "global_batch": batch, "micro_batch": micro,
                      "strategy": strategy, "nproc": 2, "device": "cpu", "timeout_s": 120, **extra}
            cfgs.append(TrainConfig(**fields))
    for strategy, extra in LORA:
        cfgs.append(TrainConfig(model="tiny", seq_len=64, global_batch=8, micro_batch=4, strategy=strategy, nproc=2,
                                device="cpu", timeout_s=120, **extra))
    return cfgs


@pytest.fixture(scope="module")
def measured():
    cfgs = _configs()
    return list(zip(cfgs, measure(cfgs, nproc=2, steps=2, timeout_s=120)))


@pytest.mark.timeout(400)
def test_predicted_peak_memory_within_10_percent(measured):
    rows, misses = predicted_vs_measured(measured, TOLERANCE,
                                         label=lambda cfg: cfg.model + (f" lora {cfg.lora_r}" if cfg.lora_r else ""))
    print("\n".join(rows))
    assert not misses, "outside 10%:\n" + "\n".join(misses)
