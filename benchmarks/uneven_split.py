"""A throttled rank: an even split against an uneven one, median step time side by side.

Two ranks on CPU (gloo, one thread each); rank 1 is made FACTOR x slower by the test throttle
(tests/support/throttle.py, attached through each trainer's hooks; tests/ is put on sys.path). Both trainers live in the same two processes and run
alternating blocks (A B A B ...), so machine noise hits both alike.

--mode dp (default): DDP. The even run gives both ranks half the global batch, so every step waits for rank 1;
the uneven run, --dp-batch-split FACTOR:1, balances them. Ideal ratio for FACTOR 2: ~2/3 of the compute part.
--mode pp: a 2-stage 1F1B pipeline of the 4-layer model; rank 1 holds the last stage. The even run,
--pp-layers 2:2, has rank 1 as the bottleneck; the uneven one, --pp-layers 3:1, moves a block off it.

    python benchmarks/uneven_split.py [--mode dp|pp] [--model small] [--seq-len 128] [--batch 12] [--factor 2]
                                      [--steps 3] [--blocks 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def worker(args: dict) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.train.hooks import Hooks
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer
    from support.throttle import Throttle, attach

    rt = init_runtime("cpu", 300)
    base = {"model": args["model"], "nproc": 2, "seq_len": args["seq_len"], "global_batch": args["batch"],
            "steps": 10**6, "resume": "never", "metrics": False, "device": "cpu", **args["common"]}
    runs, throttles = {}, {}
    for name, overrides in args["runs"].items():  # one throttle per trainer: each counts its own sleep
        hooks, throttles[name] = Hooks(), Throttle.for_rank(rt.rank, "cpu", f"1:{args['factor']}")
        attach(hooks, throttles[name])
        runs[name] = Trainer(TrainConfig(**base, **overrides), rt, quiet=True, hooks=hooks)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for trainer in runs.values():  # warm-up: DDP builds its buckets on the first steps
        for _ in range(2):
            trainer.train_step(trainer.source.next_step())
    for _ in range(args["blocks"]):
        for name, trainer in runs.items():
            for _ in range(args["steps"]):
                micro = trainer.source.next_step()
                t0 = time.perf_counter()
                trainer.train_step(micro)  # ends in the loss all-reduce: both ranks are done
                times[name].append(time.perf_counter() - t0)
    slept = {name: t.slept_s if t else 0.0 for name, t in throttles.items()}
    shutdown()
    return {"times": times, "slept_s": slept} if rt.is_main or rt.rank == 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("dp", "pp"), default="dp")
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--factor", type=int, default=2, help="rank 1 computes this many times as long")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per block")
    parser.add_argument("--blocks", type=int, default=3)
    opts = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # the throttle stretches one compute thread's CPU time
    from paratrain.train.launch import run_workers

    if opts.mode == "dp":
        common, runs = {"strategy": "ddp"}, {"even": {}, "uneven": {"dp_batch_split": f"{opts.factor}:1"}}
        labels = {"even": "even (1:1)", "uneven": f"--dp-batch-split {opts.factor}:1"}
    else:
        common = {"strategy": "pp", "pp_schedule": "1f1b", "microbatches": 4}
        runs = {"even": {"pp_layers": "2:2"}, "uneven": {"pp_layers": "3:1"}}
        labels = {"even": "--pp-layers 2:2", "uneven": "--pp-layers 3:1"}
    args = {"model": opts.model, "seq_len": opts.seq_len, "batch": opts.batch, "factor": opts.factor,
            "steps": opts.steps, "blocks": opts.blocks, "common": common, "runs": runs}
    out = run_workers(worker, (args,), nproc=2, timeout_s=300)
    times = out[0]["times"]
    even, uneven = statistics.median(times["even"]), statistics.median(times["uneven"])
    print(f"model {opts.model}, seq {opts.seq_len}, global batch {opts.batch}, 2 {common['strategy']} ranks on CPU, "
          f"rank 1 throttled "
          f"{opts.factor}x; {opts.blocks} alternating blocks of {opts.steps} steps each")
    print(f"{'run':<28}{'median step s':>14}{'min':>9}{'max':>9}")
    for name, label in labels.items():
        print(f"{label:<28}{statistics.median(times[name]):>14.3f}{min(times[name]):>9.3f}{max(times[name]):>9.3f}")
    print(f"ratio uneven / even: {uneven / even:.2f}   (rank 1 slept {out[1]['slept_s']['even']:.2f} s even, "
          f"{out[1]['slept_s']['uneven']:.2f} s uneven, warm-up included)")


if __name__ == "__main__":
    sys.exit(main())
