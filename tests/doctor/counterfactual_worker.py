"""Run under torch.distributed.run with 2 ranks: the doctor's gradient-sync probe against the plain
measurement (two ranks minus one rank), side by side, round by round, in one process group.

Usage: counterfactual_worker.py MIN_ROUNDS MAX_ROUNDS TOLERANCE. Each round times, on the same pre-staged batch:
the full DDP step on both ranks; the same step with the gradient sync skipped and each rank alone in turn (the
doctor's probes, counterfactual.run_probes); and, independently of the doctor's code, the single-device step of a
one-rank Trainer on rank 0 while rank 1 waits in a barrier. The two reference steps run as Trainer.train_step runs
them (gradients set to None), each twice in a row, timing the second: its steady state, as in a run of its own, not
the step after another model's or variant's (whose freed memory decides whether its fresh gradients page-fault).
Every round, the fault too: the doctor's probes again with an alone probe that skips nothing (every rank runs the
full DDP step at once). Rounds go on past MIN_ROUNDS until both probes' agreement with the measurement, give or
take three standard errors of the rounds' own spread, is decided against 1 +- TOLERANCE, or MAX_ROUNDS. Prints
one JSON line on rank 0.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from paratrain.config import load_config
from paratrain.doctor import counterfactual
from paratrain.doctor.counterfactual import communication_split, counterfactual_costs, probe_step, run_probes
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.runtime import init_runtime, shutdown
from paratrain.train.trainer import Trainer

# 8.6M parameters, almost all in the embedding and output (a 33 MiB all-reduce); 16 tokens per rank
LARGE = {"model": "tiny", "vocab_size": 16384, "dim": 256, "ffn_dim": 512, "n_layers": 1, "seq_len": 16,
         "metrics": False, "resume": "never", "steps": 100}


def training_step_s(trainer, micro_batches) -> float:
    """One step on pre-staged data as Trainer.train_step runs it (gradients set to None first), in seconds."""
    t0 = time.perf_counter()
    for opt in trainer.optimizers:
        opt.zero_grad(set_to_none=True)
    local = trainer.step_runner.forward_backward(micro_batches)
    trainer.optimizer_step()
    trainer.global_loss(local)
    return time.perf_counter() - t0


def agreement(two_s, one_s, cf_s) -> tuple[float, float]:
    """(probe / measured, its standard error): mean probe cost over the mean two-rank minus one-rank step, and
    the standard error of the probe's mean per-round error as a share of the measured difference."""
    errors = [cf - (two - one) for two, one, cf in zip(two_s, one_s, cf_s)]
    measured = statistics.fmean(two_s) - statistics.fmean(one_s)
    if measured <= 0:
        return 0.0, float("inf")
    return statistics.fmean(cf_s) / measured, statistics.stdev(errors) / len(errors) ** 0.5 / measured


def decided(two_s, one_s, cf_s, tolerance: float) -> bool:
    """True once the ratio, give or take 3 standard errors, lies wholly inside 1 +- tolerance or wholly outside."""
    ratio, error = agreement(two_s, one_s, cf_s)
    low, high = ratio - 3 * error, ratio + 3 * error
    return (1 - tolerance <= low and high <= 1 + tolerance) or high < 1 - tolerance or low > 1 + tolerance


def main() -> None:
    min_rounds, max_rounds, tolerance = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    rt = init_runtime("cpu", 60)
    cfg = load_config(None, {**LARGE, "strategy": "ddp", "nproc": 2, "global_batch": 2})
    ddp = Trainer(cfg, rt, quiet=True)
    staged = [mb.to(rt.device) for mb in ddp.source.next_step()]
    one_cfg = load_config(None, {**LARGE, "strategy": "single", "nproc": 1, "global_batch": 1})
    one = Trainer(one_cfg, rt, quiet=True, layout=resolve_layout(one_cfg, 1)) if rt.rank == 0 else None
    one_staged = [mb.to(rt.device) for mb in one.source.next_step()] if one else None
    two_s, one_s, cf_s, no_sync_s, sync_s, alone_s, broken_s = [], [], [], [], [], [], []
    honest = counterfactual.alone_in_turn
    staged_s = []
    rounds = 0
    while True:
        training_step_s(ddp, staged)
        two_s.append(training_step_s(ddp, staged))
        if one is not None:
            training_step_s(one, one_staged)
            one_s.append(training_step_s(one, one_staged))
        dist.barrier()
        probes = run_probes(ddp, staged, 1)
        cf_s.append(counterfactual_costs(probes, probes["staged_s"])["communication"])
        no_sync_s.append(probes["no_grad_sync_s"])
        alone_s.append(probes["alone_s"])
        staged_s.append(probes["staged_s"])
        sync_s.append(communication_split(probes)["sync_s"])
        # the fault, every round, with the same estimator: an "alone" probe that removes nothing
        counterfactual.alone_in_turn = lambda trainer, mb: probe_step(trainer, mb)
        try:
            broken = run_probes(ddp, staged, 1)
        finally:
            counterfactual.alone_in_turn = honest
        broken_s.append(counterfactual_costs(broken, broken["staged_s"])["communication"])
        rounds += 1
        # more rounds while the rounds' own spread leaves the comparison undecided (a busy machine's steps vary
        # by half), decided on rank 0, which holds the reference
        more = torch.tensor([0])
        if rt.rank == 0 and rounds < max_rounds and \
                (rounds < min_rounds or not decided(two_s, one_s, cf_s, tolerance)
                 or not decided(two_s, one_s, broken_s, tolerance)):
            more[0] = 1
        dist.broadcast(more, 0)
        if not more.item():
            break
    if rt.rank == 0:
        print(json.dumps({"two_s": two_s, "one_s": one_s, "cf_s": cf_s, "no_sync_s": no_sync_s,
                          "alone_s": alone_s, "sync_s": sync_s, "broken_s": broken_s, "staged_s": staged_s,
                          "agreement": agreement(two_s, one_s, cf_s),
                          "broken_agreement": agreement(two_s, one_s, broken_s),
                          "pid": os.getpid()}), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
