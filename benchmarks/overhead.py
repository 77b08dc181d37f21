"""paratrain's DDP step time ÷ a hand-written torch DDP loop of the same model and data, side by side.

Both loops run in the same two processes, alternating in blocks (A B A B ...) so that machine noise hits
both alike. paratrain's loop is the real Trainer.fit(): prefetching, clipping, LR schedule, loss
all-reduce for logging and metrics.jsonl. The hand-written loop does the same math and nothing else.

    python benchmarks/overhead.py [--model small] [--seq-len 128] [--batch 16] [--steps 10] [--blocks 4]
Target: ratio <= 1.03.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def handwritten_steps(model, dataset, global_batch: int, rank: int, world: int, start: int, steps: int) -> float:
    import numpy as np
    import torch
    import torch.nn.functional as F

    opt = handwritten_steps.opt
    local = global_batch // world
    t0 = time.perf_counter()
    for step in range(start, start + steps):
        first = step * global_batch + rank * local
        tokens = torch.from_numpy(dataset.samples(np.arange(first, first + local)))
        x, y = tokens[:, :-1], tokens[:, 1:]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        loss.item()
    return (time.perf_counter() - t0) / steps


def worker(args: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from paratrain.config import TrainConfig
    from paratrain.models.presets import build_model, model_args_for
    from paratrain.train.data.indexed_sets import SyntheticMarkov
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    rt = init_runtime("cpu", 120)
    cfg = TrainConfig(model=args["model"], strategy="ddp", nproc=rt.world_size, seq_len=args["seq_len"],
                      global_batch=args["batch"], steps=args["steps"], resume="never", warmup_steps=0)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, rt, Path(tmp), quiet=True)
        margs = model_args_for(cfg)
        plain = DistributedDataParallel(build_model(margs, "cpu", seed=0))
        handwritten_steps.opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, betas=(0.9, 0.95), foreach=True)
        dataset = SyntheticMarkov(margs.vocab_size, cfg.seq_len, cfg.seed)
        ours, theirs = [], []
        done = 0
        for block in range(args["blocks"] + 1):  # block 0 warms both up and is discarded
            dist.barrier()
            trainer.cfg = cfg.model_copy(update={"steps": done + args["steps"]})
            t0 = time.perf_counter()
            trainer.fit()
            ours_t = (time.perf_counter() - t0) / args["steps"]
            dist.barrier()
            theirs_t = handwritten_steps(plain, dataset, cfg.global_batch, rt.rank, rt.world_size, done, args["steps"])
            done += args["steps"]
            if block:
                ours.append(ours_t)
                theirs.append(theirs_t)
    shutdown()
    if rt.rank != 0:
        return None
    return {"ours": ours, "theirs": theirs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.train.launch import run_workers

    out = run_workers(worker, ({"model": a.model, "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps,
                                "blocks": a.blocks},), a.nproc, 0, 120)[0]
    ours, theirs = statistics.median(out["ours"]), statistics.median(out["theirs"])
    print(f"model={a.model} seq_len={a.seq_len} global_batch={a.batch} nproc={a.nproc} "
          f"blocks={a.blocks}x{a.steps} steps", file=sys.stderr)
    print("| loop | median step time (ms) | per block (ms) |")
    print("|---|---|---|")
    print(f"| paratrain Trainer.fit (ddp) | {ours * 1e3:.1f} | {', '.join(f'{t * 1e3:.1f}' for t in out['ours'])} |")
    print(f"| hand-written torch DDP | {theirs * 1e3:.1f} | {', '.join(f'{t * 1e3:.1f}' for t in out['theirs'])} |")
    paired = [o / t for o, t in zip(out["ours"], out["theirs"])]
    print(f"ratio of medians paratrain / hand-written = {ours / theirs:.3f}")
    # adjacent blocks share the machine's state best, so the median of per-block ratios resists drift
    print(f"median of paired per-block ratios = {statistics.median(paired):.3f}  (target <= 1.03); "
          f"per block: {', '.join(f'{r:.3f}' for r in paired)}")


if __name__ == "__main__":
    main()
