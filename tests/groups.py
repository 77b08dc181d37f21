"""One process group per world size for the suite's verify-style checks (tests/parallel/dp_worker.py), shared
by the data-, tensor-, context- and pipeline-parallel tests, the uneven-split, validation and resharding ones
and the tied GPT-2 ones: a launch costs seconds of interpreter and torch start-up per rank, the checks inside it
far less. The fixtures are in tests/conftest.py.

Parity reference: verify/parity.py's single-device run of the same seed and batches at fp32 tolerances (loss
1e-5 relative, params 1e-5 + 1e-4 relative, grads 1e-4 relative). The `paratrain verify` command itself (its
launcher and JSON) is covered by the CLI tests that still start it: tests/bench/test_verify.py (the contract, the
model-state bytes and --ac full on DDP), test_pipeline's bubble and test_context_parallel's 8-rank mesh.
"""

from __future__ import annotations

import json
import os
import sys

from reliability.inproc import launch_here

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel", "dp_worker.py")

APPROX_STEPS = 300
APPROX_RUNS = {"ddp": {}, "fp16": {"ddp_comm_hook": "fp16"}, "powersgd": {"ddp_comm_hook": "powersgd"},
               "local_sgd": {"local_sgd_period": 4}}

GPT2_TIED = ("ddp", "zero1", "zero2", "zero3", "tp", "tp-sp", "cp-ring")
# a tied table on two pipeline stages: the first and last stage's copies summed (parallel/tied_weights.py)
GPT2_TIED_PP = [{"id": "gpt2-pp-1f1b", "strategy": "pp", "pp_schedule": "1f1b", "microbatches": 2},
                {"id": "gpt2-pp-interleaved", "strategy": "pp", "pp_schedule": "interleaved-1f1b",
                 "virtual_stages": 2, "microbatches": 2, "n_layers": 4}]
ZERO = [{"id": s, "strategy": s} for s in ("zero1", "zero2", "zero3")]
# LoRA (rank 4 on wq,wv, the base frozen): adapters' parity plus verify's LoRA checks (verify/lora_checks.py)
LORA = {"lora_r": 4, "lora_alpha": 8.0, "steps": 3}
LORA2 = [{"id": f"lora-{s}", "strategy": s, **LORA} for s in ("ddp", "zero3", "tp", "tp-sp", "pp")]
# what each world size verifies, by id; the TP and CP cases run 3 steps, as `paratrain verify --steps 3` did
VERIFY = {
    2: [*ZERO,
        {"id": "tp2", "strategy": "tp", "steps": 3},
        {"id": "tp-sp2", "strategy": "tp-sp", "steps": 3},
        {"id": "cp-ring2", "strategy": "cp-ring", "steps": 3},
        {"id": "cp-ulysses2", "strategy": "cp-ulysses", "steps": 3},
        # GPT-2's tied embedding and frozen key bias under every strategy that can hold a tied table
        *[{"id": f"gpt2-{s}", "strategy": s, "model": "gpt2-tiny", "steps": 3} for s in GPT2_TIED],
        *[{**case, "model": "gpt2-tiny", "steps": 3} for case in GPT2_TIED_PP],
        # MoE: experts split over both ranks, tokens through the all-to-all (tests/moe/; 4 ranks: moe_worker.py)
        {"id": "moe-ep2", "strategy": "ep", "model": "moe-tiny", "steps": 3},
        # with a capacity factor of 0.5: at least half the copies dropped, per sequence (docs/moe.md)
        {"id": "moe-ep2-capacity", "strategy": "ep", "model": "moe-tiny", "steps": 3, "moe_capacity_factor": 0.5},
        # the speed options that run on CPU (issue 47): the same arithmetic in fp32, verify's bf16 bounds in bf16
        {"id": "speed-fused-qkv-zero3", "strategy": "zero3", "fused_qkv": True, "steps": 3},
        # --optimizer-graph with the clip active (0.05 is below gpt2-tiny's gradient norms); --bf16-param-copies
        {"id": "speed-optimizer-graph-ddp", "strategy": "ddp", "model": "gpt2-tiny", "optimizer_graph": True,
         "grad_clip": 0.05, "steps": 3},
        {"id": "speed-bf16-param-copies-ddp", "strategy": "ddp", "model": "gpt2-tiny", "dtype": "bf16",
         "bf16_param_copies": True, "steps": 3},
        {"id": "speed-gpt2-bf16-zero2", "strategy": "zero2", "model": "gpt2-tiny", "dtype": "bf16", "steps": 3,
         "fused_qkv": True, "bf16_residual": True},
        # --fused-loss: the loss inside GPT-2's tied head, whose weight FSDP makes whole in that unit's forward
        {"id": "speed-fused-loss-gpt2-zero3", "strategy": "zero3", "model": "gpt2-tiny", "fused_loss": True,
         "steps": 3},
        *LORA2,
        # --semi-sync: 2 one-rank islands against them simulated on one device (verify/semi_sync_parity.py), with
        # fragments, an overlapped sync and int4 outer gradients (2 x 2 islands: tests/parallel/semi_sync_worker.py)
        {"id": "semi-sync-islands2", "strategy": "ddp", "dp_replicate": 2, "semi_sync": "streaming-diloco",
         "sync_every": 4, "fragments": 2, "fragment_delay": 1, "outer_dtype": "int4", "steps": 6}],
    4: [*ZERO,
        {"id": "hsdp", "strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2},
        {"id": "hsdp-tied", "strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2, "model": "gpt2-tiny"},
        {"id": "tp4", "strategy": "tp", "model": "tiny-mha", "steps": 3},  # tiny's 2 kv heads do not split 4 ways
        {"id": "fsdp2xtp2", "strategy": "tp-sp", "dp_shard": 2, "tp": 2, "steps": 3},  # FSDP outer, TP+SP inner
        {"id": "gpt2-fsdp2xtp-sp2", "strategy": "tp-sp", "dp_shard": 2, "tp": 2, "model": "gpt2-tiny", "steps": 3},
        {"id": "fsdp2xcp2", "strategy": "cp-ring", "dp_shard": 2, "cp": 2, "steps": 3},
        {"id": "lora-fsdp2xtp2", "strategy": "tp", "dp_shard": 2, "tp": 2, **LORA}],
}


def launch(nproc: int, spec: dict, tmp_path, timeout: int) -> dict:
    """dp_worker.run(spec) on `nproc` ranks forked from this process's warm forkserver (no interpreter or torch
    start per rank, as a torchrun launch pays); `timeout`: the process group's. tmp_path keeps the spec."""
    (tmp_path / f"spec-{nproc}.json").write_text(json.dumps(spec))  # to rerun by hand: torchrun dp_worker.py SPEC
    if os.path.dirname(WORKER) not in sys.path:
        sys.path.insert(0, os.path.dirname(WORKER))  # the ranks import dp_worker by name (they get this sys.path)
    import dp_worker

    report = launch_here(dp_worker.run, (spec,), nproc, timeout_s=timeout)
    assert report is not None
    return report


def verified(group: dict, case: str) -> dict:
    """The verify report of one VERIFY id from a group's result."""
    return next(r for r in group["verify"] if r["id"] == case)
