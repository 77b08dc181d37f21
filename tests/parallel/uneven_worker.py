"""Uneven splits against one device, in ONE process group per world size (gloo, CPU), run by test_uneven.py.

    python tests/parallel/uneven_worker.py NPROC   -> one JSON document on stdout

NPROC=2: verify of --dp-batch-split 3:1, 1:3, 5:3 under ddp / zero1 / zero2 / zero3, the same split with the
token weighting planted wrong (mutation h: must fail), --pp-layers 3:1 and 1:3 (1f1b) and 3:1:1:1
(interleaved-1f1b, 2 stages per rank), and the test throttle (tests/support/throttle.py) on rank 1 only. NPROC=3: 2:1:1 (ddp) and
3:2:1 (zero3). The single-device reference is computed once per global batch on rank 0 and reused.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package

STEPS = 3
BASE = {"steps": STEPS, "timeout_s": 120.0, "device": "cpu", "resume": "never", "ckpt_every": 0, "metrics": False,
        "global_batch": 12}
TWO = {
    "ddp 3:1 x3": {"strategy": "ddp", "dp_batch_split": "3:1", "microbatches": 3},
    "ddp 1:3": {"strategy": "ddp", "dp_batch_split": "1:3"},
    "ddp 5:3": {"strategy": "ddp", "dp_batch_split": "5:3", "global_batch": 8},
    "zero1 3:1": {"strategy": "zero1", "dp_batch_split": "3:1"},
    "zero2 5:3": {"strategy": "zero2", "dp_batch_split": "5:3", "global_batch": 8},
    "zero3 3:1 x3": {"strategy": "zero3", "dp_batch_split": "3:1", "microbatches": 3},
    "zero3 1:3": {"strategy": "zero3", "dp_batch_split": "1:3"},
    "pp 3:1": {"strategy": "pp", "model": "tiny4", "pp_layers": "3:1", "microbatches": 2},
    "pp 1:3": {"strategy": "pp", "model": "tiny4", "pp_layers": "1:3", "microbatches": 2},
    "pp interleaved 3:1:1:1": {"strategy": "pp", "model": "tiny", "n_layers": 6, "pp_schedule": "interleaved-1f1b",
                               "virtual_stages": 2, "pp_layers": "3:1:1:1", "microbatches": 2},
}
MUTATED = {"ddp 3:1 unweighted": {"strategy": "ddp", "dp_batch_split": "3:1"},
           "zero3 1:3 unweighted": {"strategy": "zero3", "dp_batch_split": "1:3"}}
THREE = {
    "ddp 2:1:1 x3": {"strategy": "ddp", "dp_batch_split": "2:1:1", "microbatches": 3},
    "zero3 3:2:1": {"strategy": "zero3", "dp_batch_split": "3:2:1"},
}
KEEP = ("passed", "checks", "first_divergence", "margins", "dims", "max_loss_rel_diff", "max_grad_rel_diff",
        "max_param_rel_diff", "max_act_rel_diff", "same_loss_on_every_rank", "per_step",
        "model_state_bytes")


def one(rt, overrides: dict, mutation: str | None = None) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.verify.parity import verify_in_group
    from support.faults import planted

    with planted(mutation):
        report = verify_in_group(TrainConfig(**{**BASE, "nproc": rt.world_size, **overrides}), rt)
    return {k: report.get(k) for k in KEEP} if report else None


def throttled(rt) -> dict:
    """Two steps each of DDP and of a 2-stage pipeline with rank 1 throttled 3x: how long each rank slept."""
    import torch.distributed as dist

    from paratrain.config import TrainConfig
    from paratrain.train.hooks import Hooks
    from paratrain.train.trainer import Trainer
    from support.throttle import Throttle, attach

    out = {}
    for name, overrides in (("ddp", {"strategy": "ddp"}),
                            ("pp", {"strategy": "pp", "model": "tiny4", "pp_layers": "3:1", "microbatches": 2})):
        hooks, throttle = Hooks(), Throttle.for_rank(rt.rank, "cpu", "1:3")
        attach(hooks, throttle)
        trainer = Trainer(TrainConfig(**{**BASE, "nproc": 2, "steps": 2, **overrides}), rt, quiet=True, hooks=hooks)
        for _ in range(2):
            trainer.train_step(trainer.source.next_step())
        slept = throttle.slept_s if throttle else None
        everyone = [None] * rt.world_size
        dist.all_gather_object(everyone, slept)
        out[name] = everyone
    return out


def run_checks(rt) -> dict:
    """Every check for this group's world size (2 or 3); the suite runs the 2-rank ones in the shared group of
    tests/groups.py (dp_worker.py's "uneven")."""
    out: dict = {"clean": {}, "mutated": {}}
    for name, overrides in (TWO if rt.world_size == 2 else THREE).items():
        out["clean"][name] = one(rt, overrides)
    if rt.world_size == 2:
        for name, overrides in MUTATED.items():
            out["mutated"][name] = one(rt, overrides, "dp-split-unweighted")
        out["slept_s"] = throttled(rt)
    return out


def worker(nproc: int) -> dict | None:
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime("cpu", 120.0)
    out = run_checks(rt)
    shutdown()
    return out if rt.is_main else None


def main() -> None:
    from paratrain.train.launch import run_workers

    nproc = int(sys.argv[1])
    print(json.dumps(run_workers(worker, (nproc,), nproc=nproc, timeout_s=120.0)[0], default=str))


if __name__ == "__main__":
    sys.exit(main())
