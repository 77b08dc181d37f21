"""`--strategy auto --probe K`, the planner's half: from the step times measured for the top K layouts, refit
the model's cost per strategy, choose the measured best, and say why.

The measuring is bench's (bench/probe_layouts.py runs each layout a few warm steps); nothing here starts a process.
Refit: per strategy, the median of measured / predicted over its probed layouts scales every candidate of
that strategy (strategies not probed take the median over all probes), so the report can say whether a
layout that was not probed would now be expected to win. The choice itself is the measured best: a model
that was wrong by tens of percent cannot pick a layout that measured slower.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from paratrain.plan.search import Candidate


@dataclass
class Probe:
    rank: int  # the planner's rank (0: its first choice)
    candidate: Candidate
    predicted_s: float
    step_times_s: list[float] = field(default_factory=list)  # per measured step, the slowest rank's
    error: str | None = None

    @property
    def measured_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    @property
    def ratio(self) -> float | None:
        return self.measured_s / self.predicted_s if self.measured_s and self.predicted_s else None

    @property
    def label(self) -> str:
        lay = self.candidate.layout
        return f"{lay.label()} mb {lay.micro_batch}x{lay.microbatches} ac {lay.ac}"


@dataclass
class ProbeResult:
    probes: list[Probe]
    winner: Probe
    factors: dict[str, float]  # strategy -> measured / predicted ("*": all probes)
    refit: list[tuple[Candidate, float]]  # every candidate with its refitted step time, fastest first
    reasons: list[str]


def refit_factors(probes: list[Probe]) -> dict[str, float]:
    measured = [p for p in probes if p.ratio is not None]
    factors = {"*": statistics.median(p.ratio for p in measured)}
    for strategy in {p.candidate.layout.strategy for p in measured}:
        factors[strategy] = statistics.median(p.ratio for p in measured if p.candidate.layout.strategy == strategy)
    return factors


def refit_ranking(feasible: list[Candidate], factors: dict[str, float]) -> list[tuple[Candidate, float]]:
    scaled = [(c, c.time.step_s * factors.get(c.layout.strategy, factors["*"])) for c in feasible]
    return sorted(scaled, key=lambda x: x[1])


def choose(probes: list[Probe], feasible: list[Candidate]) -> ProbeResult:
    """The measured best of the probes, the refitted ranking, and the reasons."""
    measured = [p for p in probes if p.measured_s is not None]
    if not measured:
        raise ValueError("no probe measured a step")
    winner = min(measured, key=lambda p: p.measured_s)
    factors = refit_factors(probes)
    refit = refit_ranking(feasible, factors)
    return ProbeResult(probes, winner, factors, refit, explain_winner(probes, winner, factors, refit))


def explain_winner(probes: list[Probe], winner: Probe, factors: dict[str, float],
                   refit: list[tuple[Candidate, float]]) -> list[str]:
    measured = sorted((p for p in probes if p.measured_s is not None), key=lambda p: p.measured_s)
    out = []
    if len(measured) > 1:
        runner = measured[1]
        out.append(f"measured fastest: {winner.measured_s * 1e3:.3g} ms per step vs {runner.measured_s * 1e3:.3g} ms "
                   f"for the next, {runner.label} ({1 - winner.measured_s / runner.measured_s:.0%} faster)")
    else:
        out.append(f"the only probe that ran: {winner.measured_s * 1e3:.3g} ms per step")
    first = probes[0]
    if winner is first:
        out.append(f"the planner's first choice held (predicted {first.predicted_s * 1e3:.3g} ms, "
                   f"measured {first.measured_s * 1e3:.3g} ms)")
    else:
        seen = f"measured {first.measured_s * 1e3:.3g} ms" if first.measured_s else f"failed: {first.error}"
        out.append(f"the probe overturned the planner's first choice {first.label} (predicted "
                   f"{first.predicted_s * 1e3:.3g} ms, {seen}); the winner was its #{winner.rank} "
                   f"(predicted {winner.predicted_s * 1e3:.3g} ms)")
    fits = ", ".join(f"{s} x{f:.2f}" for s, f in sorted(factors.items()) if s != "*")
    out.append(f"refit measured / predicted per strategy: {fits} (all probes: x{factors['*']:.2f})")
    probed = {id(p.candidate) for p in probes}
    better = [(c, t) for c, t in refit if id(c) not in probed and t < winner.measured_s]
    if better:
        c, t = better[0]
        out.append(f"not probed: {c.layout.label()} refits to {t * 1e3:.3g} ms, below the winner; a larger --probe "
                   "would measure it")
    return out


def format_probe_table(result: ProbeResult) -> str:
    lines = ["probe: predicted vs measured step time (median of the measured steps, slowest rank)",
             f"  {'#':>2} {'layout':<58} {'pred ms':>9} {'meas ms':>9} {'meas/pred':>9}"]
    for p in result.probes:
        meas = f"{p.measured_s * 1e3:9.3g}" if p.measured_s is not None else f"{'failed':>9}"
        ratio = f"{p.ratio:9.2f}" if p.ratio is not None else f"{'-':>9}"
        mark = "  <- chosen" if p is result.winner else ""
        lines.append(f"  {p.rank:>2} {p.label:<58} {p.predicted_s * 1e3:9.3g} {meas} {ratio}{mark}")
    lines += [f"  why: {r}" for r in result.reasons]
    return "\n".join(lines) + "\n"


def probe_document(result: ProbeResult) -> dict:
    return {"winner": result.winner.rank, "factors": result.factors, "reasons": result.reasons,
            "probes": [{"rank": p.rank, "layout": p.label, "strategy": p.candidate.layout.strategy,
                        "predicted_step_time_s": p.predicted_s, "measured_step_time_s": p.measured_s,
                        "measured_steps_s": p.step_times_s, "ratio": p.ratio, "error": p.error}
                       for p in result.probes]}
