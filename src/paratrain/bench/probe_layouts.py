"""`train --strategy auto --probe K`, the measuring half: run the planner's top K layouts a few warm steps each
on this machine (one process group per layout, bench's machinery), then let plan/probe_refit.py refit and choose.

It lives in bench/ because it starts process groups (the planner never does); see docs/mixed-clusters.md.
"""

from __future__ import annotations

import logging
import sys

from paratrain.errors import CheckFailed, UserError

log = logging.getLogger("paratrain")
PROBE_WARMUP, PROBE_STEPS, PROBE_ROUNDS = 2, 2, 2


def probe_config(cfg, layout, warmup: int, steps: int):
    from paratrain.parallel.strategies import config_fields

    return cfg.model_copy(update={**config_fields(layout), "probe": 0, "steps": warmup + steps, "metrics": False,
                                  "resume": "never", "ckpt_every": 0, "out": None, "eval_every": 0})


def measure(cfg, picks: list, warmup: int, steps: int,
            rounds: int = PROBE_ROUNDS) -> list[tuple[list[float], str | None]]:
    """Per layout, the slowest rank's time of each measured step, or why it did not run. All layouts run in one
    process group (one start-up), in rounds: A B C, A B C, ... so that a shared machine's changing load falls on
    all of them alike rather than on whichever ran last."""
    from paratrain.bench.scaling import run_cells, slowest_rank_step_times
    from paratrain.train.validate import validate_run

    out: list = [None] * len(picks)
    runnable = []
    for i, cand in enumerate(picks):
        pcfg = probe_config(cfg, cand.layout, warmup, steps)
        try:
            validate_run(pcfg, cand.layout.world)
            runnable.append((i, pcfg))
        except UserError as exc:
            out[i] = ([], str(exc))
    if not runnable:
        return out
    cells = run_cells([c for _ in range(rounds) for _, c in runnable], picks[0].layout.world, warmup, steps,
                      keep_going=True)
    if cells is None:
        raise CheckFailed("--probe: rank 0 returned nothing")
    for j, (i, _) in enumerate(runnable):
        mine = cells[j::len(runnable)]
        errors = [c["error"] for c in mine if "error" in c]
        out[i] = ([], errors[0]) if errors else ([t for c in mine for t in slowest_rank_step_times(c)], None)
    return out


def resolve_by_probe(cfg, warmup: int = PROBE_WARMUP, steps: int = PROBE_STEPS):
    """cfg (strategy auto, probe K) -> (the config of the measured best of the top K, the probe document)."""
    from paratrain.parallel.strategies import config_fields
    from paratrain.plan.auto import plan_for_auto
    from paratrain.plan.probe_refit import Probe, choose, format_probe_table, probe_document
    from paratrain.train.runtime import in_launched_process

    if in_launched_process():
        raise UserError("--probe starts its own process groups; run it directly, not under torchrun/srun")
    job, profile, where, feasible = plan_for_auto(cfg)
    picks = feasible[:cfg.probe]
    log.info("--strategy auto --probe %d (%s, %d x %s): %d feasible layout(s); probing %d in %d rounds of %d warm-up "
             "+ %d measured steps each", cfg.probe, where, job.gpus, profile.gpu.name, len(feasible), len(picks),
             PROBE_ROUNDS, warmup, steps)
    for rank, cand in enumerate(picks):
        log.info("probe %d/%d: %s (predicted %.3g ms/step)", rank + 1, len(picks), cand.layout.label(),
                 cand.time.step_s * 1e3)
    probes = []
    for rank, (cand, (times, error)) in enumerate(zip(picks, measure(cfg, picks, warmup, steps))):
        if error:
            log.warning("probe %d: %s did not run: %s", rank + 1, cand.layout.label(), error)
        probes.append(Probe(rank, cand, cand.time.step_s, times, error))
    if not any(p.step_times_s for p in probes):
        raise CheckFailed("--probe: no probed layout ran; see the errors above")
    result = choose(probes, feasible)
    sys.stderr.write(format_probe_table(result))
    lay = result.winner.candidate.layout
    log.info("--strategy auto --probe: training with %s, micro-batch %d, ac %s", lay.label(), lay.micro_batch, lay.ac)
    return cfg.model_copy(update={**config_fields(lay), "probe": 0}), probe_document(result)
