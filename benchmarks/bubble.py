"""Pipeline bubble: measured per-rank idle fraction of each schedule against (p-1)/(v*m+p-1), at p=2.

Runs 2 CPU processes (gloo). Each stage gets enough compute (~10+ ms per micro-batch forward) that the
bubble, not p2p latency, dominates the idle time. The micro-batch size is fixed, so m micro-batches mean
m times the work per step, as in the textbook picture.

    python benchmarks/bubble.py                 # the table (1-3 minutes on 2 cores)
    python benchmarks/bubble.py --json          # the same, as JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CASES = [  # (label, schedule, virtual stages per rank, micro-batches)
    *[("gpipe", "gpipe", 1, m) for m in (1, 2, 4, 8)],
    *[("1f1b", "1f1b", 1, m) for m in (2, 4, 8)],
    *[("zero-bubble", "zero-bubble", 1, m) for m in (2, 4, 8)],
    *[("interleaved-1f1b v=2", "interleaved-1f1b", 2, m) for m in (2, 4, 8)],
]


def bubble_worker(spec: dict) -> list[dict] | None:
    import torch
    import torch.distributed as dist

    from paratrain.config import TrainConfig
    from paratrain.models.llama import ModelArgs
    from paratrain.models.presets import build_model
    from paratrain.parallel.layout import Layout
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.train.data.indexed_sets import Batch
    from paratrain.train.pipeline_step import build_pipeline_step
    from paratrain.train.runtime import init_runtime, shutdown

    torch.set_num_threads(1)
    rt = init_runtime("cpu", 300)
    mesh = Layout(pp=2).with_mesh("cpu").mesh
    args = ModelArgs(name="bubble", vocab_size=256, dim=spec["dim"], n_layers=4, n_heads=8, ffn_dim=3 * spec["dim"],
                     max_seq_len=spec["seq_len"])
    gen = torch.Generator().manual_seed(0)
    runs = []
    for _, schedule, v, m in CASES:
        cfg = TrainConfig(model="tiny", strategy="pp", global_batch=m * spec["micro_batch"], seq_len=spec["seq_len"],
                          pp_schedule=schedule, microbatches=m, virtual_stages=v)
        layout = resolve_layout(cfg, 2).replace(mesh=mesh)
        step = build_pipeline_step(build_model(args, "cpu", seed=0), layout, rt.device, cfg.seq_len)
        tokens = torch.randint(0, args.vocab_size, (m * spec["micro_batch"], spec["seq_len"] + 1), generator=gen)
        runs.append((step, Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), []))
    # round-robin over the cases, so a burst of load from other processes hits every case alike
    for i in range(spec["warmup"] + spec["steps"]):
        for step, batch, samples in runs:
            dist.barrier()  # every step starts together, as after the optimizer step's collectives
            step.forward_backward([batch])
            for part in step.model_parts:
                part.zero_grad(set_to_none=True)
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, step.last_timing)
            if i >= spec["warmup"]:
                samples.append(([r["busy_s"] for r in everyone], max(r["total_s"] for r in everyone)))
    rows = []
    for (label, _, v, m), (step, _, samples) in zip(CASES, runs):
        # a rank that finishes early idles until the slowest one is done (in training: in the next
        # collective), so idle is measured against the step time. The median step resists noise.
        samples.sort(key=lambda s: sum(1 - b / s[1] for b in s[0]))
        busy, step_s = samples[len(samples) // 2]
        idle = [1 - b / step_s for b in busy]
        rows.append({"schedule": label, "p": 2, "v": v, "m": m, "formula": step.layout.ideal_bubble,
                     "idle_per_rank": idle, "idle_mean": sum(idle) / len(idle), "busy_per_rank": busy,
                     "step_s": step_s})
    shutdown()
    return rows if rt.is_main else None


def print_table(rows: list[dict]) -> None:
    out = sys.stderr
    out.write(f"{'schedule':<22}{'m':>3}{'formula':>10}{'measured':>10}{'diff(pts)':>11}{'rank0':>8}{'rank1':>8}"
              f"{'step s':>9}{'busy0/busy1':>13}\n")
    for r in rows:
        diff = 100 * (r["idle_mean"] - r["formula"])
        ranks = "".join(f"{x:>8.3f}" for x in r["idle_per_rank"])
        balance = r["busy_per_rank"][0] / r["busy_per_rank"][1]
        out.write(f"{r['schedule']:<22}{r['m']:>3}{r['formula']:>10.3f}{r['idle_mean']:>10.3f}{diff:>+11.1f}{ranks}"
                  f"{r['step_s']:>9.3f}{balance:>13.2f}\n")
    by = {(r["schedule"], r["m"]): r["idle_mean"] for r in rows}
    for m in (2, 4, 8):
        zb, ofob = by.get(("zero-bubble", m)), by.get(("1f1b", m))
        if zb is not None and ofob is not None:
            out.write(f"m={m}: zero-bubble idle {zb:.3f} vs 1f1b {ofob:.3f} ({'lower' if zb < ofob else 'NOT lower'})\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256, help="model width (per-stage compute grows with dim^2)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per pipeline micro-batch")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per case (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per case (shape inference, caches)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    opts = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.train.launch import run_workers

    spec = {"dim": opts.dim, "seq_len": opts.seq_len, "micro_batch": opts.micro_batch, "steps": opts.steps,
            "warmup": opts.warmup}
    rows = run_workers(bubble_worker, (spec,), nproc=2, timeout_s=300)[0]
    print_table(rows)
    if opts.json:
        print(json.dumps({"spec": spec, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
