"""verify on tiny transformers models, every strategy, in ONE 4-rank process group (gloo, CPU), run by
test_hf_verify.py.

    python tests/models/hf_verify_worker.py DIR   -> one JSON document on stdout

DIR holds the configs of hf_configs.py. Each run compares against the unwrapped transformers model on one
device (rank 0; the same seed, weights and batches). Then the same verify with a bug planted
(tests/support/faults.py) must fail: the harness still sees through a transformers model's module tree.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package

NPROC = 4
BASE = {"steps": 2, "timeout_s": 90.0, "device": "cpu", "resume": "never", "ckpt_every": 0, "metrics": False,
        "nproc": NPROC, "seq_len": 32, "global_batch": 8}
EVERY_STRATEGY = {
    "ddp": {"strategy": "ddp"}, "zero2": {"strategy": "zero2"}, "zero3": {"strategy": "zero3"},
    "hsdp": {"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2}, "tp": {"strategy": "tp"},
    "tp-sp": {"strategy": "tp-sp"}, "cp-ring": {"strategy": "cp-ring"}, "cp-ulysses": {"strategy": "cp-ulysses"},
    "dp_shard2xtp2": {"dp_shard": 2, "tp": 2},
    "pp-1f1b": {"strategy": "pp", "pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
    "dp_shard2xtp-sp2": {"dp_shard": 2, "tp": 2, "sp": True},
    "pp-interleaved": {"strategy": "pp", "pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2,
                       "microbatches": 2},
}
# the tied head (a Llama 3.2-style config): one sharded table under tp-sp, two copies summed under pp
TIED_RUNS = ("tp-sp", "dp_shard2xtp-sp2", "pp-1f1b", "pp-interleaved")
TIED_ONLY = ("dp_shard2xtp-sp2", "pp-interleaved")  # the untied configs run their plain forms only
# LoRA on q_proj, v_proj (models/lora.py): the adapters placed beside transformers' own TP plan, and in pipeline stages
LORA_RUNS = {"lora-dp_shard2xtp-sp2": {"dp_shard": 2, "tp": 2, "sp": True, "lora_r": 4},
             "lora-pp-1f1b": {"strategy": "pp", "pp": 2, "pp_schedule": "1f1b", "microbatches": 2, "lora_r": 4}}
EVERY_STRATEGY.update(LORA_RUNS)
RUNS = [(model, name) for model in ("llama", "qwen2") for name in EVERY_STRATEGY
        if name not in TIED_ONLY and name not in LORA_RUNS] + \
       [(model, name) for model in ("mistral", "gpt2") for name in ("ddp", "zero3")] + \
       [("llama-tied", name) for name in TIED_RUNS] + [("llama", name) for name in LORA_RUNS]
MUTATIONS = {"dp-grad-sum": ("llama", "ddp"), "fsdp-skip-update": ("llama", "zero3"),
             "tp-row-no-reduce": ("llama", "tp"), "cp-rope-positions": ("llama", "cp-ring"),
             "tied-grad-not-summed": ("llama-tied", "pp-1f1b")}
KEEP = ("passed", "checks", "first_divergence", "dims", "max_loss_abs_diff", "max_grad_rel_diff", "max_param_rel_diff",
        "max_act_rel_diff", "compared")


def one(rt, root: Path, model: str, strategy: str, mutation: str | None = None) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.verify.parity import verify_in_group
    from support.faults import planted

    with planted(mutation):
        cfg = TrainConfig(**{**BASE, **EVERY_STRATEGY[strategy], "model": f"hf:{root / model}"})
        report = verify_in_group(cfg, rt)
    return {k: report.get(k) for k in KEEP} if report else None


def worker(root: str) -> dict | None:
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime("cpu", 90.0)
    out = {"clean": {f"{m}/{s}": one(rt, Path(root), m, s) for m, s in RUNS},
           "mutated": {name: one(rt, Path(root), model, strategy, name)
                       for name, (model, strategy) in MUTATIONS.items()}}
    shutdown()
    return out if rt.is_main else None


def main() -> None:
    from paratrain.train.launch import run_workers

    print(json.dumps(run_workers(worker, (sys.argv[1],), nproc=NPROC, timeout_s=90.0)[0], default=str))


if __name__ == "__main__":
    sys.exit(main())
