"""plan --model hf:DIR: predicted peak memory of transformers models vs the peak measured on CPU.

Reference: calibrate/harness.py runs the real Trainer on the transformers model (2 gloo ranks, one process group
for every config) under its live-tensor tracker, and reports each rank's peak live bytes over a steady step.
The planner predicts from the config.json's shape (plan/inputs/hf_config.py), its activations traced on paratrain's
equivalent block. Tolerance: 10% on the busiest rank, for single, ddp and zero3 on all four test models.

GPT-2 runs with activation_function "gelu_pytorch_tanh" (one fused op, as the planner's block has): with
GPT-2's default "gelu_new", written as five elementwise ops that autograd keeps, the planner predicts 22% low
(measured: 5.17 vs 6.68 MiB); docs/models.md says so.
"""

from __future__ import annotations

import os
import sys

import pytest

from helpers import CLIResult
from memory_check import predicted_vs_measured
from reliability.inproc import run_cli_inproc

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_configs import CONFIGS, write_config  # noqa: E402

TOLERANCE = 0.10
CHANGES = {"gpt2": {"activation_function": "gelu_pytorch_tanh"}}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from paratrain.calibrate.harness import measure
    from paratrain.config import TrainConfig

    root = tmp_path_factory.mktemp("hf")
    cfgs = [TrainConfig(model=f"hf:{write_config(root, kind, **CHANGES.get(kind, {}))}", seq_len=64, global_batch=8,
                        micro_batch=4, strategy=strategy, nproc=2, device="cpu", timeout_s=120)
            for kind in CONFIGS for strategy in ("single", "ddp", "zero3")]
    return list(zip(cfgs, measure(cfgs, nproc=2, steps=2, timeout_s=120)))


@pytest.mark.timeout(300)
def test_plan_memory_within_10_percent_of_measured(measured):
    rows, misses = predicted_vs_measured(measured, TOLERANCE, label=lambda cfg: cfg.model.rsplit("/", 1)[-1])
    print("\n".join(rows))
    assert not misses, "outside 10%:\n" + "\n".join(misses)


@pytest.mark.timeout(120)
def test_plan_cli_reads_an_hf_directory(measured):
    cfg, result = next((c, r) for c, r in measured if c.strategy == "zero3" and c.model.endswith("qwen2"))
    path = cfg.model.removeprefix("hf:")
    out = CLIResult(*run_cli_inproc(["plan", "--model", cfg.model, "--gpu", "cpu", "--gpus", "2", "--dp-shard", "2",
                                     "--seq-len", "64", "--global-batch", "8", "--micro-batch", "4", "--dtype", "fp32",
                                     "--ac", "none", "--json"]))  # in this process: plan starts no worker
    assert out.returncode == 0, out.stderr
    doc = out.json()
    assert doc["model"]["name"] == cfg.model and doc["model"]["kv_heads"] == CONFIGS["qwen2"]["num_key_value_heads"]
    total_mib = doc["candidates"][0]["memory_gib"]["total"] * 1024
    assert abs(total_mib / (max(result["peak_bytes"]) / 2**20) - 1) < TOLERANCE, total_mib
    # --hf-config takes the same directory (or its config.json) and reads the same shape
    from paratrain.models.presets import count_params
    from paratrain.plan.inputs.hf_config import load_hf_config

    assert count_params(load_hf_config(path)) == doc["model"]["params_priced"]
    assert count_params(load_hf_config(f"{path}/config.json")) == doc["model"]["params_priced"]
    # the count is transformers' own: Qwen2's q, k and v biases (2 layers x 3 x 64 here) are in it, not in the stand-in
    assert doc["model"]["params"] - doc["model"]["params_priced"] == 2 * 3 * 64
