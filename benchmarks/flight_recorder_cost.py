"""What the flight recorder (train/recovery/flight_recorder.py) adds per event, measured in isolation on this machine:

    torch entry   one small gloo all_reduce with PyTorch's recorder on (TORCH_FR_BUFFER_SIZE=256) minus off,
                  each in its own 1-rank process (the buffer size is read once per process)
    phase         one on_phase mark (the trainer fires 4 per step)
    collective    one of paratrain's own collectives through the interceptor, minus without it
(The send/recv wrapper, train/recovery/p2p_trace.py, does a dict and a counter per op, the interceptor's order of cost;
gloo cannot send to itself, so a 1-rank group cannot time it.)

Per-step cost is these times the events per step; benchmarks/doctor_overhead.py measures whole runs
(`norec` variant). Prints microseconds, median of R repeats of N events.

    python benchmarks/flight_recorder_cost.py [--n 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def timed(fn, n: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n)
    return statistics.median(runs) * 1e6


def child(mode: str, n: int, repeats: int) -> None:
    """One process, a 1-rank gloo group; prints JSON microseconds."""
    import torch
    import torch.distributed as dist

    from paratrain.parallel.collective_hooks import collective
    from paratrain.train.hooks import Hooks
    from paratrain.train.recovery.flight_recorder import FlightRecorder

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    t = torch.ones(16)
    out = {"all_reduce": timed(lambda: dist.all_reduce(t), n, repeats)}
    if mode == "on":
        plain = timed(lambda: collective("loss", "dp", "all_reduce", None, lambda: None), n * 10, repeats)
        recorder = FlightRecorder(0, None, stall_after_s=60)
        recorder.attach(Hooks())
        out["collective"] = timed(lambda: collective("loss", "dp", "all_reduce", None, lambda: None), n * 10,
                                  repeats) - plain
        out["phase"] = timed(lambda: recorder.on_phase("optimizer"), n * 10, repeats)
        recorder.detach()
    dist.destroy_process_group()
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", choices=("on", "off"))
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.n, opts.repeats)
        return
    results = {}
    for mode, size in (("off", "0"), ("on", "256")):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": size}
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--n", str(opts.n), "--repeats",
                               str(opts.repeats)], capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-2000:])
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = results["on"], results["off"]
    print(f"all_reduce (16 floats, 1 rank): {off['all_reduce']:.1f} us without torch's recorder, "
          f"{on['all_reduce']:.1f} us with it: +{on['all_reduce'] - off['all_reduce']:.1f} us per collective")
    print(f"on_phase mark: {on['phase']:.2f} us; paratrain collective through the interceptor: "
          f"+{on['collective']:.2f} us")


if __name__ == "__main__":
    main()
