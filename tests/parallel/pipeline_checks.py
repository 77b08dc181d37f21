"""Multi-rank pipeline checks in ONE process group per world size (for test_pipeline.py; the suite runs them
inside the shared groups of tests/groups.py, dp_worker.py's "pipeline"; on their own:)

    python tests/parallel/pipeline_checks.py 2|4 CKPT_DIR   -> one JSON document on stdout

For each layout: a single-device reference Trainer on rank 0 (same seed, weights, batches) against the
pipelined Trainer, through paratrain verify itself (verify/parity.py verify_in_group, fp32 tolerances).
The 2-rank group also saves a checkpoint from one stage layout and resumes it into another.
"""

from __future__ import annotations

import json
import os
import sys

# paratrain verify's defaults (global batch 16, seq 64, lr warm-up over 5 steps), 3 steps
BASE = {"steps": 3, "timeout_s": 120.0, "device": "cpu", "resume": "never", "ckpt_every": 0, "metrics": False}

LAYOUTS = {
    2: {
        "gpipe": {"strategy": "pp", "pp_schedule": "gpipe", "microbatches": 2},
        "1f1b": {"strategy": "pp", "pp_schedule": "1f1b", "microbatches": 4},
        "interleaved-1f1b": {"strategy": "pp", "model": "tiny4", "pp_schedule": "interleaved-1f1b",
                             "virtual_stages": 2, "microbatches": 4},
        "zero-bubble": {"strategy": "pp", "model": "tiny4", "pp_schedule": "zero-bubble", "virtual_stages": 2,
                        "microbatches": 4},
        "model": {"strategy": "model"},
        "micro-batch": {"strategy": "pp", "pp_schedule": "1f1b", "micro_batch": 4},  # 16 / 4 -> 4 micro-batches
    },
    4: {
        "1f1b-pp4": {"strategy": "pp", "model": "tiny4", "pp_schedule": "1f1b"},
        "pp2-dp_shard2": {"strategy": "pp", "pp": 2, "dp_shard": 2, "microbatches": 2},
        "pp2-ddp2": {"strategy": "pp", "pp": 2, "dp_replicate": 2, "microbatches": 2},
        "pp2-tp2": {"strategy": "pp", "pp": 2, "tp": 2, "microbatches": 2},
    },
}


def check_layout(rt, overrides: dict) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.verify.parity import verify_in_group

    result = verify_in_group(TrainConfig(**{**BASE, **overrides}), rt)
    if not rt.is_main:
        return None
    return {"passed": result["passed"], "checks": result["checks"], "max_loss_abs_diff": result["max_loss_abs_diff"],
            "max_grad_rel_diff": result["max_grad_rel_diff"], "max_param_abs_diff": result["max_param_abs_diff"],
            "first_divergence": result["first_divergence"],
            "same_loss_on_every_rank": result["same_loss_on_every_rank"], "timing": result["pipeline"],
            "n_parts_rank0": result["compared"]["model_parts"]}


def run_steps(trainer, steps: int) -> list[float]:
    return [trainer.train_step(trainer.source.next_step())["loss"] for _ in range(steps)]


def all_params(trainer) -> dict | None:
    """{name: full tensor} over every rank's parameters, on rank 0 (each pipeline rank holds some)."""
    import torch.distributed as dist

    from paratrain.verify.recorder import full_tensors

    mine = full_tensors(trainer.step_runner.model_parts, "param")
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return {k: v for d in everyone for k, v in d.items()} if everyone else None


def check_checkpoint_across_layouts(rt, ckpt_dir: str) -> dict | None:
    """Save after 2 steps of interleaved (2 stages/rank), resume into 1F1B (1 stage/rank): the parameters
    and the next step's loss must match exactly."""

    from paratrain.config import TrainConfig
    from paratrain.train.trainer import Trainer

    common = {**BASE, "model": "tiny4", "steps": 3, "ckpt_dir": ckpt_dir}
    saver = Trainer(TrainConfig(**{**common, **LAYOUTS[2]["interleaved-1f1b"]}), rt, quiet=True)
    run_steps(saver, 2)
    path = str(saver.save_checkpoint())
    saved = all_params(saver)
    next_loss = run_steps(saver, 1)[0]
    resumed = Trainer(TrainConfig(**{**common, "strategy": "pp", "pp_schedule": "1f1b", "microbatches": 2,
                                     "resume": path}), rt, quiet=True)
    resumed.maybe_resume()
    loaded = all_params(resumed)
    resumed_loss = run_steps(resumed, 1)[0]
    if not rt.is_main:
        return None
    same = set(saved) == set(loaded) and all(bool((saved[k] == loaded[k]).all()) for k in saved)
    return {"params_equal": same, "n_params": len(saved), "step": resumed.step, "next_loss": next_loss,
            "resumed_loss": resumed_loss}


def checks_worker(world: int, ckpt_dir: str) -> dict | None:
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime("cpu", 120.0)
    results = {name: check_layout(rt, overrides) for name, overrides in LAYOUTS[world].items()}
    if world == 2:
        results["checkpoint"] = check_checkpoint_across_layouts(rt, ckpt_dir)
    shutdown()
    return results if rt.is_main else None


def main() -> None:
    from paratrain.train.launch import run_workers

    world, ckpt_dir = int(sys.argv[1]), sys.argv[2]
    results = run_workers(checks_worker, (world, ckpt_dir), nproc=world, timeout_s=120.0)[0]
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
