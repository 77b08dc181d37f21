"""verify against planted bugs, in ONE 2-rank process group (gloo, CPU), run by test_verify_mutations.py.

    python tests/bench/mutation_worker.py   -> one JSON document on stdout

For each mutation of tests/support/faults.py (planted through paratrain's hooks): a clean verify of its strategy (must pass; its errors
against the tolerances are the measured margins) and the same verify with the bug planted (must fail and say
where). Plus one bf16 DDP verify, whose tolerances come from its measured noise floor. The single-device
reference is computed once per config on rank 0 and reused.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package

STEPS = 3
BASE = {"steps": STEPS, "timeout_s": 120.0, "device": "cpu", "resume": "never", "ckpt_every": 0, "metrics": False,
        "nproc": 2}
RUNS = {
    "dp-grad-sum": {"strategy": "ddp"},
    "fsdp-skip-update": {"strategy": "zero3"},
    "tp-row-no-reduce": {"strategy": "tp"},
    "cp-rope-positions": {"strategy": "cp-ring"},
    "pp-drop-microbatch-grad": {"strategy": "pp", "pp_schedule": "1f1b", "microbatches": 2},
    "zero1-no-broadcast": {"strategy": "zero1"},
    "sp-norm-grad-no-reduce": {"strategy": "tp-sp"},
    "tied-grad-not-summed": {"strategy": "pp", "pp_schedule": "1f1b", "microbatches": 2, "model": "gpt2-tiny"},
}
KEEP = ("passed", "checks", "first_divergence", "tolerance", "margins", "noise_floor", "floor_multiple", "dims",
        "max_loss_abs_diff", "max_loss_rel_diff", "max_grad_rel_diff", "max_grad_norm_rel_diff", "max_param_rel_diff",
        "max_act_rel_diff", "max_param_abs_diff")


def one(rt, overrides: dict, mutation: str | None) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.verify.parity import verify_in_group
    from support.faults import planted

    with planted(mutation):
        report = verify_in_group(TrainConfig(**{**BASE, **overrides}), rt)
    return {k: report.get(k) for k in KEEP} if report else None


def worker() -> dict | None:
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime("cpu", 120.0)
    out = {}
    for name, overrides in RUNS.items():
        out[name] = {"clean": one(rt, overrides, None), "mutated": one(rt, overrides, name)}
    out["bf16"] = {"clean": one(rt, {"strategy": "ddp", "dtype": "bf16"}, None),
                   "mutated": one(rt, {"strategy": "ddp", "dtype": "bf16"}, "dp-grad-sum")}
    shutdown()
    return out if rt.is_main else None


def main() -> None:
    from paratrain.train.launch import run_workers

    print(json.dumps(run_workers(worker, (), nproc=2, timeout_s=120.0)[0], default=str))


if __name__ == "__main__":
    sys.exit(main())
