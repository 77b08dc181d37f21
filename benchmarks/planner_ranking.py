"""Ranking quality of the planner on this machine: is its first choice within 10% of the measured best, and how
well does its whole order match the measured one (Kendall's tau), without and with `--probe K`.

    python benchmarks/planner_ranking.py [--quick] [--profile FILE] [--probe 3] [--steps 5] [--json]

For each configuration of the grid (model, sequence length, global batch; 2 gloo ranks):
1. the planner ranks its feasible layouts (plan/search.py, every strategy it searches on 2 ranks, plus its best
   pipeline layout) with the hardware profile: --profile FILE, else the one `paratrain plan --calibrate` saved,
   else a fresh `--calibrate --calibrate-rounds 1` into runs/ (said so in the output);
2. every candidate is measured (2 interleaved rounds of 2 warm-up + --steps steps, one process group for all
   of a configuration's candidates; the step time is the median over steps of the slowest rank's): the truth;
3. the probe (bench/probe_layouts.py, as `train --strategy auto --probe K` runs it: the top K, 2 interleaved rounds of
   2 warm-up + 2 steps, a separate measurement from the truth's) picks its measured best; the ranking with the probe orders probed
   layouts by what the probe measured and the others by the refitted model (plan/probe_refit.py).
Per configuration: the planner's pick, the measured best, whether the pick is within 10% of it, tau; then the
fraction within 10% and the mean tau, both ways. Timings are this machine's at the time: the load average is
printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_accuracy import kendall_tau  # noqa: E402 - the benchmarks share the one tau

# (model, seq_len, global_batch)
GRID = [("tiny", 64, 8), ("small", 64, 8), ("tiny4", 128, 8), ("gpt2-tiny", 64, 16),
        ("tiny", 32, 4), ("tiny", 128, 16), ("tiny4", 64, 16), ("small", 128, 8),
        ("small", 32, 16), ("gpt2-tiny", 128, 4), ("tiny-mha", 64, 16), ("tiny4", 32, 8)]
QUICK = 4
WORLD = 2


def load_or_calibrate(path: str | None) -> tuple[object, str]:
    from paratrain.costs.hardware import default_profile_path, load_profile

    if path:
        return load_profile(path), f"profile {path}"
    if default_profile_path().exists():
        return load_profile(default_profile_path()), f"calibrated profile {default_profile_path()}"
    out = Path("runs") / "planner-ranking-profile.json"
    if not out.exists():
        import subprocess

        print(f"no calibrated profile: running `paratrain plan --calibrate --calibrate-rounds 1` into {out}",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "paratrain.cli", "plan", "--calibrate", "--calibrate-rounds", "1",
                        "--nproc", str(WORLD), "--hardware", str(out)], check=True)
    return load_profile(out), f"freshly calibrated (1 round) {out}"


def candidates(model: str, seq: int, batch: int, profile, limit: int) -> tuple[object, list]:
    """The planner's feasible layouts, fastest first (its own order), and its best pipeline layout."""
    import dataclasses

    from paratrain.models.presets import get_preset
    from paratrain.plan.search import Job, search

    profile = dataclasses.replace(profile, gpu=dataclasses.replace(profile.gpu, gpus_per_node=WORLD))
    job = Job(args=get_preset(model), model_name=model, gpus=WORLD, seq_len=seq, global_batch=batch, dtype="fp32",
              device_type="cpu")
    feasible, _, _ = search(job, profile, {})
    pool = feasible[:limit]
    if not any(c.layout.pp > 1 for c in pool):
        piped, _, _ = search(job, profile, {"pp": 2})
        pool += piped[:1]
    return job, sorted(pool, key=lambda c: c.time.step_s)


def measure(base, pool: list, steps: int) -> list[float | None]:
    """The truth: every candidate in 2 interleaved rounds of 2 warm-up + `steps` steps (bench/probe_layouts.py's
    measure, a separate run from the probe's), the median of the slowest rank's step times."""
    from paratrain.bench.probe_layouts import measure as measure_layouts

    return [statistics.median(times) if times else None for times, _ in measure_layouts(base, pool, 2, steps, 2)]


def with_probe(base, pool: list, k: int) -> tuple[int, list[float]]:
    """(the probe's pick, the order after the probe: measured where probed, refitted elsewhere)."""
    from paratrain.bench.probe_layouts import PROBE_STEPS, PROBE_WARMUP
    from paratrain.bench.probe_layouts import measure as probe_measure
    from paratrain.plan.probe_refit import Probe, choose

    picks = pool[:k]
    probes = [Probe(i, c, c.time.step_s, times, err)
              for i, (c, (times, err)) in enumerate(zip(picks, probe_measure(base, picks, PROBE_WARMUP,
                                                                              PROBE_STEPS)))]
    result = choose(probes, pool)
    refit = {id(c): t for c, t in result.refit}
    order = [probes[i].measured_s if i < len(probes) and probes[i].measured_s else refit[id(c)]
             for i, c in enumerate(pool)]
    return result.winner.rank, order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK} configurations only")
    parser.add_argument("--profile", help="hardware profile JSON (default: the calibrated one, else calibrate)")
    parser.add_argument("--probe", type=int, default=3, help="K of --probe K")
    parser.add_argument("--candidates", type=int, default=6, help="layouts per configuration (planner's top)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per layout and round for the truth")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.config import TrainConfig

    profile, where = load_or_calibrate(a.profile)
    print(f"hardware: {where}; load average before: {os.getloadavg()}", file=sys.stderr, flush=True)
    rows, started = [], time.time()
    for model, seq, batch in GRID[:QUICK] if a.quick else GRID:
        job, pool = candidates(model, seq, batch, profile, a.candidates)
        base = TrainConfig(model=model, seq_len=seq, global_batch=batch, nproc=WORLD, device="cpu", dtype="fp32",
                           timeout_s=120.0)
        truth = measure(base, pool, a.steps)
        ok = [i for i, t in enumerate(truth) if t is not None]
        best = min(ok, key=lambda i: truth[i])
        probe_pick, probe_order = with_probe(base, pool, a.probe)
        predicted = [c.time.step_s for c in pool]
        row = {"model": model, "seq_len": seq, "global_batch": batch,
               "layouts": [c.layout.label() + f" mb{c.layout.micro_batch}x{c.layout.microbatches} {c.layout.ac}"
                           for c in pool],
               "predicted_s": predicted, "measured_s": truth, "best": best,
               "pick": 0, "within_10": truth[0] is not None and truth[0] <= 1.10 * truth[best],
               "tau": kendall_tau([predicted[i] for i in ok], [truth[i] for i in ok]),
               "probe_pick": probe_pick,
               "probe_within_10": truth[probe_pick] is not None and truth[probe_pick] <= 1.10 * truth[best],
               "probe_tau": kendall_tau([probe_order[i] for i in ok], [truth[i] for i in ok])}
        rows.append(row)
        print(f"{model:>9} seq {seq:>3} batch {batch:>2}: pick {row['layouts'][0]} "
              f"({_ms(truth[0])} ms) | best {row['layouts'][best]} ({_ms(truth[best])} ms) | within 10%: "
              f"{'yes' if row['within_10'] else 'no'}, tau {row['tau']:+.2f} | with probe: pick #{probe_pick} "
              f"({_ms(truth[probe_pick])} ms), within 10%: {'yes' if row['probe_within_10'] else 'no'}, "
              f"tau {row['probe_tau']:+.2f}", file=sys.stderr, flush=True)
    summary = {"configurations": len(rows), "hardware": where,
               "within_10_fraction": sum(r["within_10"] for r in rows) / len(rows),
               "mean_tau": statistics.fmean(r["tau"] for r in rows),
               "probe_within_10_fraction": sum(r["probe_within_10"] for r in rows) / len(rows),
               "probe_mean_tau": statistics.fmean(r["probe_tau"] for r in rows),
               "probe_k": a.probe, "seconds": round(time.time() - started), "load_average_after": os.getloadavg()}
    print(f"summary over {len(rows)} configurations: top pick within 10% of the measured best "
          f"{summary['within_10_fraction']:.0%} (target >= 90%), mean Kendall tau {summary['mean_tau']:+.2f}; "
          f"with --probe {a.probe}: {summary['probe_within_10_fraction']:.0%}, mean tau "
          f"{summary['probe_mean_tau']:+.2f}; {summary['seconds']} s, load average after "
          f"{summary['load_average_after']}", file=sys.stderr)
    if a.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


def _ms(t: float | None) -> str:
    return "failed" if t is None else f"{t * 1e3:.3g}"


if __name__ == "__main__":
    sys.exit(main())
