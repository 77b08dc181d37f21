"""The planner's measured error, shown beside every predicted step time.

A layout belongs to one family (layout_family). The bar of a family is the mean |predicted / published step
time - 1| over the published runs of that family (benchmarks/published_runs.json, predicted by
benchmarks/planner_published.py); a family with fewer than MIN_CASES runs takes its pooled family's bar
(FALLBACK), then the bar over all runs. The figures are computed by the benchmark and shipped in
error_bars.json (`python benchmarks/planner_published.py --write-error-bars`); the benchmark also prints each
case's error against its family's bar computed without that case (leave-one-out), which is how a bar is
checked on runs it was not measured on. INPUT_FILES are hashed into the file, so a test sees when it is stale.
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
from pathlib import Path

from paratrain.parallel.dims import techniques

FORMAT = "paratrain-error-bars/1"
BARS_FILE = Path(__file__).with_name("error_bars.json")
MIN_CASES = 3
# a family with too few published runs is measured on a wider one
FALLBACK = {"FSDP": "data-parallel", "DDP/ZeRO-1": "data-parallel", "single": "data-parallel",
            "data-parallel": "all", "tensor-parallel": "all", "context-parallel": "all", "pipeline": "all"}
# what the predictions of the published runs depend on besides the traced model code (checked apart); the
# benchmark asks `plan` with each case's flags, so plan's request and model inputs count too
INPUT_FILES = ("costs/collectives.py", "costs/expert_spread.py", "plan/costing/compose.py", "plan/costing/memory.py",
               "plan/costing/time.py", "plan/search.py", "plan/priced_job.py", "costs/hardware.py", "gpu_catalog.py",
               "plan/error_bars.py", "parallel/technique.py", "parallel/dp/dp_cost.py", "parallel/dp/dp_memory.py",
               "parallel/tp/tp_cost.py",
               "parallel/pp/pp_cost.py", "parallel/ep/ep_cost.py", "parallel/dp/dp_technique.py",
               "parallel/tp/tp_technique.py", "parallel/pp/pp_technique.py", "parallel/cp/cp_technique.py",
               "parallel/ep/ep_technique.py", "plan/costing/block_kinds.py", "plan/plan_cli.py", "plan/request.py",
               "plan/inputs/hf_config.py", "plan/inputs/hf_count.py")


def layout_family(lay) -> str:
    """The kind of layout an error bar is measured on: the outermost technique that shapes its step time (an
    expert-parallel layout's token exchange and routing first: its bar is measured on MoE runs alone, and no
    dense family's bar counts them)."""
    ranked = [(t.family_rank, t.family_of(lay)) for t in techniques()]
    return max(((rank, family) for rank, family in ranked if family), default=(0, "single"))[1]


def pooled(family: str) -> list[str]:
    """The family, then the wider ones its bar falls back to."""
    chain = [family]
    while chain[-1] in FALLBACK:
        chain.append(FALLBACK[chain[-1]])
    return chain


def bar_over(errors: dict[str, tuple[str, float]], family: str, leave_out: str | None = None) -> dict:
    """{"step_time_rel", "cases", "family", "worst_step_time_rel"}: mean (and largest) |error| over the runs of the first
    group in the family's fallback chain with >= MIN_CASES runs (leave_out excluded), else over its last group."""
    chain = pooled(family)
    for group in chain:
        values = [abs(e) for cid, (fam, e) in errors.items() if cid != leave_out and group in pooled(fam)]
        if len(values) >= MIN_CASES or group == chain[-1]:
            return {"step_time_rel": round(statistics.mean(values), 4) if values else None, "cases": len(values),
                    "family": group, "worst_step_time_rel": round(max(values), 4) if values else None}
    raise AssertionError("unreachable: the chain's last group always answers")


def compute_bars(errors: dict[str, tuple[str, float]]) -> dict:
    """The error-bar document from {case id: (family, step error)}."""
    families = sorted({g for fam, _ in errors.values() for g in pooled(fam)} | set(FALLBACK) | {"expert-parallel"})
    loo = {cid: {"family": fam, "step_error": err, "leave_one_out": bar_over(errors, fam, cid)}
           for cid, (fam, err) in errors.items()}
    within = sum(c["leave_one_out"]["step_time_rel"] is not None  # a family's only run has no bar without it
                 and abs(c["step_error"]) <= c["leave_one_out"]["step_time_rel"] for c in loo.values())
    return {"format": FORMAT,
            "written_by": "python benchmarks/planner_published.py --write-error-bars",
            "statistic": "mean |predicted / published step time - 1| over the family's published runs",
            "min_cases": MIN_CASES,
            "families": {f: bar_over(errors, f) for f in families},
            "cases": loo,
            "leave_one_out_within_bar": f"{within} of {len(loo)}"}


def inputs_digest(runs_path: Path) -> str:
    """sha256 of the published runs and of the cost-model sources the bars were computed with."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(Path(runs_path).read_bytes())
    for name in INPUT_FILES:
        h.update(name.encode())
        h.update((root / name).read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def shipped_bars() -> dict:
    try:
        return json.loads(BARS_FILE.read_text())
    except (OSError, ValueError):
        return {}


def error_bar(lay) -> dict:
    """The bar shown for a candidate of this layout: {"step_time_rel", "cases", "family"} (None figures when
    the package ships no error-bar file)."""
    family = layout_family(lay)
    bar = shipped_bars().get("families", {}).get(family)  # already fallen back where the family has few runs
    if not bar:
        return {"step_time_rel": None, "cases": 0, "family": family, "layout_family": family}
    return {**bar, "layout_family": family}


def describe(bar: dict | None) -> str:
    """'±12% on 9 published FSDP runs' (or that none was measured)."""
    if not bar or bar.get("step_time_rel") is None:
        return "error not measured"
    runs = f"{bar['cases']} published {'' if bar['family'] == 'all' else bar['family'] + ' '}runs"
    worst = f", worst {bar['worst_step_time_rel']:.0%}" if bar.get("worst_step_time_rel") is not None else ""
    return f"±{bar['step_time_rel']:.0%} on {runs}{worst}"
