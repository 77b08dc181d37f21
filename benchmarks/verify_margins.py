"""verify's measured margins: for each layout, the largest error over all steps and ranks against its tolerance.

One process group per world size (gloo, CPU) runs `paratrain verify` (verify/parity.py verify_in_group) on every
layout; the table gives each check's largest error and margin (tolerance / error). docs/verify.md quotes it.

    python benchmarks/verify_margins.py            # 2 and 4 ranks, 5 steps (a few minutes on 2 cores)
    python benchmarks/verify_margins.py --json
"""

from __future__ import annotations

import argparse
import json
import os

LAYOUTS = {
    2: {"ddp": {"strategy": "ddp"}, "ddp accum 2": {"strategy": "ddp", "micro_batch": 4},
        "ddp ac=full": {"strategy": "ddp", "ac": "full"}, "zero1": {"strategy": "zero1"},
        "zero2": {"strategy": "zero2"}, "zero3": {"strategy": "zero3"}, "tp": {"strategy": "tp"},
        "tp-sp": {"strategy": "tp-sp"}, "cp-ring": {"strategy": "cp-ring"}, "cp-ulysses": {"strategy": "cp-ulysses"},
        "model": {"strategy": "model"}, "pp 1f1b m=4": {"strategy": "pp", "microbatches": 4},
        "pp interleaved v=2": {"strategy": "pp", "model": "tiny4", "pp_schedule": "interleaved-1f1b",
                               "virtual_stages": 2, "microbatches": 4},
        "ddp bf16": {"strategy": "ddp", "dtype": "bf16"}, "tp bf16": {"strategy": "tp", "dtype": "bf16"},
        "zero3 bf16": {"strategy": "zero3", "dtype": "bf16"}, "ddp fp16": {"strategy": "ddp", "dtype": "fp16"}},
    4: {"hsdp 2x2": {"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2},
        "fsdp2 x tp2": {"strategy": "tp", "dp_shard": 2, "tp": 2},
        "pp2 x tp2": {"strategy": "pp", "pp": 2, "tp": 2, "microbatches": 2},
        "fsdp2 x cp2": {"strategy": "cp-ring", "dp_shard": 2, "cp": 2}},
}
METRICS = ("max_loss_rel_diff", "max_grad_norm_rel_diff", "max_grad_rel_diff", "max_param_rel_diff",
           "max_act_rel_diff")


def margins_worker(world: int, steps: int) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging
    from paratrain.verify.parity import verify_in_group

    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime("cpu", 120.0)
    out = {}
    for name, overrides in LAYOUTS[world].items():
        cfg = TrainConfig(**{"steps": steps, "device": "cpu", "nproc": world, "metrics": False, "resume": "never",
                             **overrides})
        report = verify_in_group(cfg, rt)
        if rt.is_main:
            out[name] = {k: report[k] for k in (*METRICS, "passed", "margins", "tolerance", "noise_floor")}
    shutdown()
    return out if rt.is_main else None


def main() -> None:
    from paratrain.train.launch import run_workers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = {}
    for world in (int(w) for w in args.worlds.split(",")):
        rows.update(run_workers(margins_worker, (world, args.steps), nproc=world, timeout_s=120.0)[0])
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'layout':<20} pass  " + "  ".join(f"{m[4:-5]:>16}" for m in METRICS))
    for name, r in rows.items():
        cells = []
        for metric, check in zip(METRICS, ("loss", "grad_norm", "grads", "params", "activations")):
            margin = r["margins"][check]
            cells.append(f"{r[metric]:.1e} ({'exact' if margin is None else f'{margin:.0f}x'})".rjust(16)
                         if r[metric] is not None else "n/a".rjust(16))
        print(f"{name:<20} {'yes' if r['passed'] else 'NO':<4}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
