"""`doctor --html FILE`: the report as one self-contained HTML page (inline SVG and CSS, no network fetches).

Sections: the breakdown as a stacked bar per rank, the timeline of one measured step per rank, predicted
next to measured, what removing each cause saves, and the findings with their evidence and fixes.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from paratrain.doctor.analyze import CATEGORIES
from paratrain.errors import UserError

COLORS = {"compute": "#2e7d32", "communication_exposed": "#c62828", "data_wait": "#ef6c00",
          "host_overhead": "#6a1b9a", "bubble": "#1565c0", "other": "#9e9e9e",
          "forward": "#43a047", "backward": "#1b5e20", "optimizer": "#00897b", "loss_sync": "#e53935"}
WIDTH = 760
ROW = 26


def _legend(keys) -> str:
    return "".join(f'<span class="key"><i style="background:{COLORS[k]}"></i>{escape(k)}</span>' for k in keys)


def stacked_bars(per_rank: list[dict]) -> str:
    """One horizontal bar per rank, its length the rank's step time, split by category."""
    longest = max((r["step_time_s"] for r in per_rank), default=0.0) or 1.0
    parts = []
    for i, r in enumerate(per_rank):
        y, x = i * ROW + 4, 70.0
        parts.append(f'<text x="0" y="{y + 15}">rank {r["rank"]}</text>')
        for k in CATEGORIES:
            w = r["seconds"][k] / longest * (WIDTH - 150)
            if w > 0:
                parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{ROW - 8}" fill="{COLORS[k]}">'
                             f'<title>{escape(k)}: {r["seconds"][k] * 1e3:.1f} ms</title></rect>')
            x += w
        parts.append(f'<text x="{x + 6:.1f}" y="{y + 15}">{r["step_time_s"] * 1e3:.1f} ms</text>')
    return _svg(parts, len(per_rank) * ROW + 8)


def step_timeline(per_rank: list[dict]) -> str:
    """One measured step in order per rank: data wait, forward, backward (+ grad sync), optimizer, loss sync."""
    longest = max((r["step_time_s"] for r in per_rank), default=0.0) or 1.0
    scale = (WIDTH - 150) / longest
    parts = []
    for i, r in enumerate(per_rank):
        y, x = i * ROW + 4, 70.0
        parts.append(f'<text x="0" y="{y + 15}">rank {r["rank"]}</text>')
        segments = [("data_wait", r["seconds"]["data_wait"])] + [(p, s) for p, s in r["phases_s"].items()]
        for name, seconds in segments:
            w = seconds * scale
            if w > 0:
                parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{ROW - 8}" fill="{COLORS[name]}">'
                             f'<title>{escape(name)}: {seconds * 1e3:.1f} ms</title></rect>')
            x += w
    axis_y = len(per_rank) * ROW + 16
    ticks = [f'<text x="{70 + f * (WIDTH - 150):.1f}" y="{axis_y}" text-anchor="middle">'
             f'{longest * f * 1e3:.0f} ms</text>' for f in (0, 0.25, 0.5, 0.75, 1.0)]
    return _svg(parts + ticks, axis_y + 6)


def _svg(parts: list[str], height: int) -> str:
    return (f'<svg width="{WIDTH}" height="{height}" '
            f'font-family="sans-serif" font-size="12">{"".join(parts)}</svg>')


def _comparison(report: dict) -> str:
    predicted = report.get("predicted") or {}
    rows = [("step time", f"{report['step_time_s'] * 1e3:.1f} ms",
             f"{predicted['step_time_s'] * 1e3:.1f} ms" if predicted.get("step_time_s") else "n/a"),
            ("peak memory per rank", f"{report['peak_mem_gib']:.3f} GiB" if report.get("peak_mem_gib") else "n/a",
             f"{predicted['mem_gib']:.3f} GiB" if predicted.get("mem_gib") else "n/a")]
    body = "".join(f"<tr><td>{a}</td><td>{escape(b)}</td><td>{escape(c)}</td></tr>" for a, b, c in rows)
    note = escape(predicted.get("hardware") or "no prediction for this run")
    return (f"<table><tr><th></th><th>measured</th><th>predicted</th></tr>{body}</table>"
            f"<p class='note'>prediction: {note}. Measured memory: "
            f"{'peak RSS (includes the runtime)' if report['run']['device'] == 'cpu' else 'allocator peak'}; "
            f"predicted: tensor bytes.</p>")


def _costs(report: dict) -> str:
    costs = (report.get("counterfactual") or {}).get("seconds") or {}
    if not costs:
        return "<p>no counterfactual probes ran (--probe-rounds 0)</p>"
    step = report["step_time_s"] or 1.0
    rows = "".join(f"<tr><td>{escape(k)}</td><td>{v * 1e3:.1f} ms</td><td>{v / step:.1%}</td></tr>"
                   for k, v in sorted(costs.items(), key=lambda kv: -kv[1]))
    return f"<table><tr><th>cause removed</th><th>step saves</th><th>of the step</th></tr>{rows}</table>"


def _findings(report: dict) -> str:
    if not report["findings"]:
        return "<p>no findings: nothing here is costing you measurable time</p>"
    items = "".join(f'<li><b class="sev {f["severity"]}">{f["severity"]}</b> <b>{escape(f["cause"])}</b>'
                    f'<p><i>evidence</i> {escape(f["evidence"])}</p><p><i>fix</i> <code>{escape(f["fix"])}</code>'
                    f'</p></li>' for f in report["findings"])
    return f"<ol>{items}</ol>"


CSS = """body{font-family:sans-serif;margin:24px;max-width:900px;color:#222}h1{font-size:20px}h2{font-size:16px;
margin-top:28px}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}
.key{margin-right:14px;font-size:12px}.key i{display:inline-block;width:10px;height:10px;margin-right:4px}
.note{color:#666;font-size:12px}.sev{padding:1px 6px;border-radius:3px;color:#fff}.high{background:#c62828}
.medium{background:#ef6c00}.low{background:#757575}li{margin-bottom:12px}code{white-space:pre-wrap}"""


def render_doctor_html(report: dict) -> str:
    run = report["run"]
    title = (f"paratrain doctor: {run['model']} with {run['strategy']} on {run['world_size']} x {run['device']}, "
             f"{report['step_time_s'] * 1e3:.1f} ms per step")
    fractions = " ".join(f"{k} {v:.1%}" for k, v in report["breakdown"].items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{CSS}</style></head><body>
<h1>{escape(title)}</h1>
<p>{run['measured_steps']} measured steps, timed without the profiler. Breakdown: {escape(fractions)}</p>
<h2>Where the step time goes, per rank</h2>{stacked_bars(report['per_rank'])}<div>{_legend(CATEGORIES)}</div>
<h2>One step, in order</h2>{step_timeline(report['per_rank'])}
<div>{_legend(('data_wait', 'forward', 'backward', 'optimizer', 'loss_sync'))}</div>
<h2>Predicted next to measured</h2>{_comparison(report)}
<h2>What removing a cause saves (counterfactual probes)</h2>{_costs(report)}
<h2>Findings</h2>{_findings(report)}
</body></html>
"""


def write_html(page: str, path: str) -> str:
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return str(out)


def write_doctor_html(report: dict, path: str) -> str:
    return write_html(render_doctor_html(report), path)
