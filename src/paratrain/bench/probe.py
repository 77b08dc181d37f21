"""`train --strategy auto --probe K`, the measuring half: run the planner's top K layouts a few warm steps each
on this machine (one process group per layout, bench's machinery), then let plan/probe.py refit and choose.

It lives in bench/ because it starts process groups (the planner never does); see docs/mixed-clusters.md.
"""

from __future__ import annotations

import logging
import sys

from paratrain.errors import CheckFailed, UserError

log = logging.getLogger("paratrain")
PROBE_WARMUP, PROBE_STEPS = 2, 3


def probe_config(cfg, layout, warmup: int, steps: int):
    from paratrain.parallel.strategies import config_fields

    return cfg.model_copy(update={**config_fields(layout), "probe": 0, "steps": warmup + steps, "metrics": False,
                                  "resume": "never", "ckpt_every": 0, "out": None, "eval_every": 0})


def measure(cfg, cand, warmup: int, steps: int) -> tuple[list[float], str | None]:
    """The slowest rank's time of each measured step of one layout, or the reason it did not run."""
    from paratrain.bench.scaling import run_cell, slowest_rank_step_times
    from paratrain.train.validate import validate_run

    pcfg = probe_config(cfg, cand.layout, warmup, steps)
    try:
        validate_run(pcfg, cand.layout.world)
        raw = run_cell(pcfg, cand.layout.world, warmup, steps)
    except (UserError, CheckFailed) as exc:
        return [], str(exc)
    if raw is None:
        return [], "rank 0 returned nothing"
    return slowest_rank_step_times(raw), None


def resolve_by_probe(cfg, warmup: int = PROBE_WARMUP, steps: int = PROBE_STEPS):
    """cfg (strategy auto, probe K) -> (the config of the measured best of the top K, the probe document)."""
    from paratrain.parallel.strategies import config_fields
    from paratrain.plan.auto import plan_for_auto
    from paratrain.plan.probe import Probe, choose, format_probe_table, probe_document
    from paratrain.train.runtime import in_launched_process

    if in_launched_process():
        raise UserError("--probe starts its own process groups; run it directly, not under torchrun/srun")
    job, profile, where, feasible = plan_for_auto(cfg)
    picks = feasible[:cfg.probe]
    log.info("--strategy auto --probe %d (%s, %d x %s): %d feasible layout(s); probing %d, %d warm-up + %d measured "
             "steps each", cfg.probe, where, job.gpus, profile.gpu.name, len(feasible), len(picks), warmup, steps)
    probes = []
    for rank, cand in enumerate(picks):
        log.info("probe %d/%d: %s (predicted %.3g ms/step)", rank + 1, len(picks), cand.layout.label(),
                 cand.time.step_s * 1e3)
        times, error = measure(cfg, cand, warmup, steps)
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
