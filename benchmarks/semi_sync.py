"""--semi-sync against DDP on the synthetic Markov data, side by side: the final loss, and the bytes that cross
between islands.

Runs (4 ranks each, tiny preset, default AdamW inner optimizer, same seed and data): DDP over the 4 ranks, and
DiLoCo on 2 islands x 2 ranks (FSDP inside each island) with H = --sync-every, its outer all-reduce in fp32,
bf16, int8 and int4; plus Streaming DiLoCo (4 fragments, delay 2) in int4. The final loss is the held-out loss of
the final parameters (the global copy under --semi-sync), measured by the trainer's own validation after the last
step. The bytes are the ring "wire" bytes per rank per optimizer step on the cross-island group, counted over the
whole run by parallel/collective_bytes.py (its counting filtered to that one process group): DDP's data-parallel
group is the 4 ranks, all of whose gradient traffic crosses; under --semi-sync it is the dp_replicate group.

The bounds checked: fp32 DiLoCo at most DDP's / H; bf16, int8, int4 at most 1/2, 1/4, 1/8 of fp32 DiLoCo's plus
the bytes the encoding states beside the values (parallel/semi_sync/outer_codec.py overhead_bytes: the per-row
scales and the padding to whole rows); every final loss within 3% of DDP's.
Run: python benchmarks/semi_sync.py [--steps 300] [--sync-every 20]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

ISLANDS = {"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2}
RUNS = {
    "ddp": {"strategy": "ddp"},
    "diloco fp32": {**ISLANDS, "semi_sync": "diloco", "outer_dtype": "fp32"},
    "diloco bf16": {**ISLANDS, "semi_sync": "diloco", "outer_dtype": "bf16"},
    "diloco int8": {**ISLANDS, "semi_sync": "diloco", "outer_dtype": "int8"},
    "diloco int4": {**ISLANDS, "semi_sync": "diloco", "outer_dtype": "int4"},
    "streaming P=4 T=2 int4": {**ISLANDS, "semi_sync": "streaming-diloco", "fragments": 4, "fragment_delay": 2,
                               "outer_dtype": "int4"},
}
SHARE = {"fp32": 1.0, "bf16": 1 / 2, "int8": 1 / 4, "int4": 1 / 8}
LOSS_MARGIN = 0.03


def run_worker(cfg_dict: dict) -> dict | None:
    """Train the whole run counting the cross-island group's collectives; rank 0 returns the figures."""
    from paratrain.config import TrainConfig
    from paratrain.parallel.collective_bytes import count_collectives
    from paratrain.parallel.semi_sync.outer_codec import overhead_bytes
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(**cfg_dict)
    rt = init_runtime("cpu", cfg.timeout_s)
    trainer = Trainer(cfg, rt, quiet=True)
    cross = trainer.layout.submesh("dp_replicate").get_group()
    with count_collectives(group=cross) as stats:
        summary = trainer.fit()
    result = {"val_loss": summary["val_loss"], "final_loss": summary["final_loss"], "floor": summary["loss_floor"],
              **stats.per_step(summary["steps"]), "syncs": 0, "stated_overhead_wire": 0.0}
    outer = trainer.outer_sync
    if outer is not None:  # what the encoding carries beside the values, per step, in wire bytes (ring factor)
        n = outer.islands
        lengths = outer.pending_lengths()
        per_h = sum(overhead_bytes(length, n, cfg.outer_dtype) for length in lengths.values())
        result["stated_overhead_wire"] = 2 * (n - 1) / n * per_h / cfg.sync_every
        result["syncs"] = summary["steps"] * outer.schedule.fragments // cfg.sync_every
    trainer = outer = None  # free the reducers and groups' users before the groups go (see train/worker.py)
    gc.collect()
    shutdown()
    return result if rt.is_main else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--model", default="tiny")
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.config import TrainConfig
    from paratrain.train.launch import run_workers

    results = {}
    for name, overrides in RUNS.items():
        extra = {"sync_every": ns.sync_every} if "semi_sync" in overrides else {}
        cfg = TrainConfig(model=ns.model, nproc=4, device="cpu", steps=ns.steps, eval_every=ns.steps, val_batches=8,
                          timeout_s=300, metrics=False, **overrides, **extra)
        results[name] = run_workers(run_worker, (cfg.model_dump(),), 4, 0, cfg.timeout_s)[0]
        print(f"... {name} done", file=sys.stderr, flush=True)

    ddp, fp32 = results["ddp"], results["diloco fp32"]
    print(f"model {ns.model}, 4 ranks (islands: 2 x 2), {ns.steps} steps, H = {ns.sync_every}, AdamW inner; "
          f"entropy floor {ddp['floor']:.4f} nats. Bytes: ring wire bytes per rank per optimizer step on the "
          f"cross-island group")
    header = (f"{'run':<24} {'val loss':>8} {'vs DDP':>7} {'train loss':>10} {'cross B/step':>12} {'vs DDP':>8} "
              f"{'vs fp32':>7} {'bound B/step':>12} {'stated':>7}  ok")
    print(header)
    print("-" * len(header))
    failures = []
    for name, r in results.items():
        loss_ratio = r["val_loss"] / ddp["val_loss"]
        wire = r["total_wire_bytes"]
        if name == "ddp":
            bound, ok = None, True
        else:
            dtype = name.rsplit(" ", 1)[-1]
            base = ddp["total_wire_bytes"] / ns.sync_every if dtype == "fp32" else fp32["total_wire_bytes"]
            bound = base * SHARE[dtype] + r["stated_overhead_wire"]
            # the figures are per-step means of whole-run byte counts: equal up to float rounding at the bound
            ok = wire <= bound * (1 + 1e-9) and abs(loss_ratio - 1) <= LOSS_MARGIN
        if not ok:
            failures.append(name)
        print(f"{name:<24} {r['val_loss']:>8.4f} {loss_ratio - 1:>+7.1%} {r['final_loss']:>10.4f} {wire:>12,.0f} "
              f"{wire / ddp['total_wire_bytes']:>8.4f} {wire / fp32['total_wire_bytes']:>7.4f} "
              f"{'' if bound is None else f'{bound:,.0f}':>12} {r['stated_overhead_wire']:>7,.0f}  "
              f"{'yes' if ok else 'NO'}")
    print("bound: DDP's / H for fp32; fp32 DiLoCo's x 1/2, 1/4, 1/8 for bf16, int8, int4, plus 'stated' (scales and "
          f"row padding); ok also needs the val loss within {LOSS_MARGIN:.0%} of DDP's")
    if failures:
        print(f"outside the bounds: {', '.join(failures)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
