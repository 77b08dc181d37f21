"""Assemble the doctor report (the `doctor --json` document) and its human rendering on stderr."""

from __future__ import annotations

from paratrain.doctor.analyze import CATEGORIES, breakdown
from paratrain.doctor.rules import Context, diagnose


def build_report(cfg, args, layout, device_type: str, result: dict, mem_budget_gib: float | None,
                 predicted: dict | None, trace: str | None) -> dict:
    """`layout`: the Layout the workers ran (from their fit summary), which `predicted` was made for."""
    analysis = breakdown(result["ranks"])
    ctx = Context(cfg=cfg, args=args, layout=layout, device_type=device_type, analysis=analysis,
                  captures=result["ranks"], mem_budget_gib=mem_budget_gib,
                  predicted_mem_gib=(predicted or {}).get("mem_gib"))
    findings = diagnose(ctx)
    summary = result.get("summary") or {}
    rank0 = result["ranks"][0]
    step = analysis["step_time_s"]
    return {
        "breakdown": {k: round(analysis["fractions"][k], 4) for k in CATEGORIES},
        "findings": [f.to_dict() for f in findings],
        "trace": trace,
        "step_time_s": step,
        # rank 0's fastest measured step, timed as train's metrics.jsonl times a step: least disturbed by load
        "step_time_fastest_s": min(r["step_time_s"] for r in rank0["steps"]),
        "seconds": analysis["seconds"],
        # what each removable cause costs: the step with it minus the step without it (counterfactual probes)
        "counterfactual": {**analysis["counterfactual"], "probes": rank0.get("probes")},
        # measured before the profiler started: the figures `paratrain train` would show (rank 0)
        "peak_mem_gib": rank0.get("memory_gib"),
        "peak_rss_gib": rank0.get("rss_gib"),
        # rank 0's CPU seconds per measured step (all its threads, between-step work included)
        "cpu_s_per_step": rank0.get("cpu_s_per_step"),
        "per_rank": analysis["per_rank"],
        "run": {"strategy": cfg.strategy, "world_size": layout.world, "dims": layout.degrees(),
                "layout": layout.to_dict(),
                "model": args.name, "device": device_type, "measured_steps": len(result["ranks"][0]["steps"]),
                "tokens_per_s": rank0["tokens_per_step"] * layout.dp / step if step else None,
                "mfu": _measured_mfu(summary, rank0["tokens_per_step"] * layout.dp, step),
                "metrics": cfg.metrics},
        "predicted": predicted,
        "nvml": result["ranks"][0].get("nvml"),
        "comm": result["ranks"][0].get("comm"),
    }


def _measured_mfu(summary: dict, tokens_per_step: float, step: float) -> float | None:
    """MFU over the measured steps: the fit summary's also covers the profiled and warm-up steps."""
    if not summary.get("mfu") or not summary.get("tokens_per_s") or not step:
        return None
    return summary["mfu"] * (tokens_per_step / summary["tokens_per_s"]) / step


def format_report(report: dict) -> str:
    run = report["run"]
    lines = [f"doctor: {run['model']} with {run['strategy']} on {run['world_size']} x {run['device']}, "
             f"{report['step_time_s'] * 1e3:.1f} ms per step over {run['measured_steps']} measured steps", "",
             "where the step time goes:"]
    for key, value in report["breakdown"].items():
        bar = "#" * round(value * 40)
        lines.append(f"  {key:<22} {value:6.1%}  {bar}")
    costs = report.get("counterfactual", {}).get("fractions") or {}
    if costs:
        lines.append("")
        lines.append("what removing a cause saves (counterfactual probes): " +
                     ", ".join(f"{k} {v:.1%}" for k, v in sorted(costs.items(), key=lambda kv: -kv[1])))
    lines.append("")
    if not report["findings"]:
        lines.append("no findings: nothing here is costing you measurable time")
    for i, f in enumerate(report["findings"], start=1):
        lines.append(f"{i}. [{f['severity']}] {f['cause']}")
        lines.append(f"   evidence: {f['evidence']}")
        lines.append(f"   fix:      {f['fix']}")
    if report.get("trace"):
        lines.append("")
        lines.append(f"trace: {report['trace']} (open in https://ui.perfetto.dev)")
    return "\n".join(lines) + "\n"
