"""Expert parallelism's all-to-all bytes per step: counted at the process-group level against the formula.

    python benchmarks/ep_comm.py [--steps N] [--nproc 2|4] [--json]

Runs moe-tiny under --strategy ep (experts split over every rank) on gloo/CPU, once with its own router and once
with a router biased to expert 0 (tests/support/moe_faults.py: moe-biased-router). The bytes are counted by
parallel/collective_bytes.py's dispatch mode, which sees every c10d all-to-all as issued (its input buffer), not from the
split sizes paratrain computes. The formula reads the split sizes (parallel/ep/ep_exchange.py: a token travels once
to each rank holding any of its experts). Per MoE layer and micro-batch a rank's all-to-alls carry, as input:
the Sr rows it sends and the Rr rows its experts received, dim values each, twice (forward, then their
gradients); the (row, gate) pair of each of the Sc copies it sends and the pairs' gradients of the Rc copies it
received (2 fp64 each); the ep x (E/ep + 1) split counts (int64):
    (2 Sr + 2 Rr) * dim * 4 + (Sc + Rc) * 16 + 8 (E + ep) bytes.
A balanced router makes Rr = Sr = T * r, with r the ranks a token's k experts reach (the planner's closed form,
plan/costing/time.py: moe_all_to_all); the biased one loads the rank holding expert 0. Printed too: the rows per
token against the copies per token (k), the exchange's saving.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 0.05


def formula_bytes(args, seen: dict, ep: int) -> float:
    """The bytes of the MoE-layer exchanges whose split counts were `seen` (rows and copies sent and received)."""
    return ((2 * seen["rows_sent"] + 2 * seen["rows_received"]) * args.dim * 4
            + (seen["copies_sent"] + seen["copies_received"]) * 16 + seen["calls"] * 8 * (args.n_experts + ep))


def balanced_bytes(args, micro_batch: int, seq_len: int, microbatches: int, ep: int) -> float:
    from paratrain.costs.expert_spread import ranks_per_token

    layers = args.n_layers - args.n_dense_layers
    tokens = micro_batch * seq_len
    rows = tokens * ranks_per_token(args.n_experts, args.top_k, ep)
    copies = tokens * args.top_k
    return microbatches * layers * (4 * rows * args.dim * 4 + copies * 32 + 8 * (args.n_experts + ep))


def worker(steps: int, biased: bool) -> dict | None:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import torch.distributed as dist

    from paratrain.config import TrainConfig
    from paratrain.models.presets import model_args_for
    from paratrain.parallel.collective_bytes import count_collectives
    from paratrain.parallel.collective_hooks import add_interceptor
    from paratrain.parallel.ep.ep_exchange import split_counts
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer
    from support.moe_faults import planted

    rt = init_runtime("cpu", 120.0)
    cfg = TrainConfig(model="moe-tiny", strategy="ep", nproc=rt.world_size, device="cpu", steps=steps + 1,
                      metrics=False, resume="never", timeout_s=120.0)
    seen = {"leaving": 0, "copies_sent": 0, "copies_received": 0, "rows_sent": 0, "rows_received": 0, "calls": 0}

    def count_splits(call, proceed):
        out = proceed()
        if call.purpose == "moe_splits":
            ep = dist.get_world_size(call.group)
            sent_copies, sent_rows = split_counts(call.tensors[0], ep)
            got_copies, got_rows = split_counts(call.tensors[1], ep)
            me = dist.get_rank(call.group)
            seen["leaving"] += int(sent_rows.sum() - sent_rows[me])
            seen["copies_sent"] += int(sent_copies.sum())
            seen["copies_received"] += int(got_copies.sum())
            seen["rows_sent"] += int(sent_rows.sum())
            seen["rows_received"] += int(got_rows.sum())
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
    predicted = formula_bytes(args, seen, layout.ep) / steps
    row = {"router": "biased to expert 0" if biased else "as trained", "rank": rt.rank,
           "measured_bytes_per_step": measured, "formula_bytes_per_step": predicted,
           "balanced_bytes_per_step": balanced_bytes(args, layout.micro_batch, cfg.seq_len, layout.microbatches,
                                                     layout.ep),
           "error": measured / predicted - 1, "share_leaving_rank": seen["leaving"] / max(1, seen["rows_sent"]),
           "rows_per_token": seen["rows_sent"] / max(1, seen["copies_sent"]) * args.top_k, "copies_per_token": args.top_k}
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
                      f"  (balanced: {r['balanced_bytes_per_step']:.0f})  leaving the rank {r['share_leaving_rank']:.0%}"
                      f"  rows per token {r['rows_per_token']:.2f} (copies {r['copies_per_token']})")
        print(f"worst error {worst:.2%} (tolerance {TOLERANCE:.0%})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
