"""Expert parallelism's all-to-all bytes per step: counted at the process-group level against the formula.

    python benchmarks/ep_comm.py [--steps N] [--nproc 2|4] [--json]

Runs moe-tiny under --strategy ep (experts split over every rank) on gloo/CPU, once with its own router and once
with a router biased to expert 0 (tests/support/moe_faults.py: moe-biased-router). The bytes are counted by
parallel/comm.py's dispatch mode, which sees every c10d all-to-all as issued (its input buffer), not from the
split sizes paratrain computes. The formula reads the split sizes: per MoE layer and micro-batch a rank's
all-to-alls carry, as input, the S copies it sends (dispatch forward, then the gradient of what came back)
and the R copies its experts received (combine forward, then the gradient of what they got), dim values each,
plus the E split counts (int64): (2 S + 2 R) * dim * 4 + 8 E bytes. A balanced router makes R = S = T*k (the
planner's closed form, plan/costing/time.py: moe_all_to_all); the biased one loads the rank holding expert 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 0.05


def formula_bytes(args, sent: int, received: int, calls: int) -> float:
    """The bytes of `calls` MoE-layer exchanges that sent `sent` and received `received` routed copies."""
    return (2 * sent + 2 * received) * args.dim * 4 + calls * args.n_experts * 8  # fp32 activations


def balanced_bytes(args, micro_batch: int, seq_len: int, microbatches: int) -> float:
    layers = args.n_layers - args.n_dense_layers
    return microbatches * layers * (4 * micro_batch * seq_len * args.top_k * args.dim * 4 + args.n_experts * 8)


def worker(steps: int, biased: bool) -> dict | None:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import torch.distributed as dist

    from paratrain.config import TrainConfig
    from paratrain.models.presets import model_args_for
    from paratrain.parallel.collective_hooks import add_interceptor
    from paratrain.parallel.comm import count_collectives
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer
    from support.moe_faults import planted

    rt = init_runtime("cpu", 120.0)
    cfg = TrainConfig(model="moe-tiny", strategy="ep", nproc=rt.world_size, device="cpu", steps=steps + 1,
                      metrics=False, resume="never", timeout_s=120.0)
    seen = {"leaving": 0, "sent": 0, "received": 0, "calls": 0}  # routed copies, from the split counts

    def count_splits(call, proceed):
        out = proceed()
        if call.purpose == "moe_splits":
            sent = call.tensors[0].view(dist.get_world_size(call.group), -1).sum(1)
            me = dist.get_rank(call.group)
            seen["leaving"] += int(sent.sum() - sent[me])
            seen["sent"] += int(sent.sum())
            seen["received"] += int(call.tensors[1].sum())
            seen["calls"] += 1
        return out

    with planted("moe-biased-router" if biased else None):
        trainer = Trainer(cfg, rt, quiet=True)
        trainer.train_step(trainer.source.next_step())  # warm-up step, not counted
        remove = add_interceptor(count_splits)
        with count_collectives() as stats:
            for _ in range(steps):
                trainer.train_step(trainer.source.next_step())
        remove()
    layout = trainer.layout
    measured = stats.bytes_by_op.get("all_to_all", 0) / steps
    args = model_args_for(cfg)
    predicted = formula_bytes(args, seen["sent"], seen["received"], seen["calls"]) / steps
    row = {"router": "biased to expert 0" if biased else "as trained", "rank": rt.rank,
           "measured_bytes_per_step": measured, "formula_bytes_per_step": predicted,
           "balanced_bytes_per_step": balanced_bytes(args, layout.micro_batch, cfg.seq_len, layout.microbatches),
           "error": measured / predicted - 1, "share_leaving_rank": seen["leaving"] / max(1, seen["sent"])}
    rows = [None] * rt.world_size
    dist.all_gather_object(rows, row)
    shutdown()
    return {"router": row["router"], "ranks": rows} if rt.rank == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", choices=("balanced", "biased"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        out = worker(opts.steps, opts.worker == "biased")
        if out is not None:
            print(json.dumps(out), flush=True)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    for kind in ("balanced", "biased"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(opts.nproc),
               __file__, "--worker", kind, "--steps", str(opts.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    worst = max(abs(r["error"]) for res in results for r in res["ranks"])
    if opts.json:
        print(json.dumps({"runs": results, "worst_error": worst, "tolerance": TOLERANCE}))
    else:
        for res in results:
            for r in res["ranks"]:
                print(f"router {res['router']:<20} rank {r['rank']}: measured {r['measured_bytes_per_step']:>10.0f} B/step"
                      f"  formula {r['formula_bytes_per_step']:>10.0f}  error {r['error']:+.2%}"
                      f"  (balanced: {r['balanced_bytes_per_step']:.0f})  leaving the rank {r['share_leaving_rank']:.0%}")
        print(f"worst error {worst:.2%} (tolerance {TOLERANCE:.0%})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
