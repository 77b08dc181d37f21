"""`bench --html FILE`: the scaling result as one self-contained HTML page (inline SVG, no network fetches).

Scaling curves (tokens/s against devices, with each strategy's ideal line), step time measured next to
predicted, and the full table, with the prediction's calibration state on the page.
"""

from __future__ import annotations

from html import escape

PALETTE = ("#1565c0", "#c62828", "#2e7d32", "#6a1b9a", "#ef6c00", "#00838f", "#5d4037")
W, H, PAD = 460, 300, 50


def _chart(series: dict[str, list[tuple[float, float]]], dashed: dict[str, list[tuple[float, float]]],
           y_label: str, colors: dict[str, str]) -> str:
    points = [p for s in (*series.values(), *dashed.values()) for p in s]
    if not points:
        return ""
    xs = sorted({p[0] for p in points})
    y_max = max(p[1] for p in points) * 1.1 or 1.0

    def at(x, y):
        i = xs.index(x)
        px = PAD + (i / max(1, len(xs) - 1)) * (W - 2 * PAD)
        return px, H - PAD - y / y_max * (H - 2 * PAD)

    parts = [f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#444"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#444"/>',
             f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">devices (N)</text>',
             f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">'
             f'{escape(y_label)}</text>']
    for x in xs:
        px, _ = at(x, 0)
        parts.append(f'<text x="{px:.1f}" y="{H - PAD + 16}" text-anchor="middle">{x:g}</text>')
    for f in (0.5, 1.0):
        _, py = at(xs[0], y_max / 1.1 * f)
        parts.append(f'<text x="{PAD - 4}" y="{py + 4:.1f}" text-anchor="end">{y_max / 1.1 * f:.3g}</text>')
    for style, group in (("", series), ('stroke-dasharray="5 4"', dashed)):
        for name, pts in group.items():
            coords = " ".join(f"{at(x, y)[0]:.1f},{at(x, y)[1]:.1f}" for x, y in sorted(pts))
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{colors[name]}" stroke-width="2" '
                         f'{style}/>')
            if not style:
                parts += [f'<circle cx="{at(x, y)[0]:.1f}" cy="{at(x, y)[1]:.1f}" r="3" fill="{colors[name]}">'
                          f'<title>{escape(name)} N={x:g}: {y:.4g}</title></circle>' for x, y in pts]
    return (f'<svg width="{W}" height="{H}" font-family="sans-serif" font-size="11">{"".join(parts)}</svg>')


def _legend(colors: dict[str, str], dashed_means: str) -> str:
    keys = "".join(f'<span class="key"><i style="background:{c}"></i>{escape(s)}</span>' for s, c in colors.items())
    return f"<div>{keys} <span class='note'>dashed: {escape(dashed_means)}</span></div>"


def _fmt(v, scale=1.0, spec=".1f") -> str:
    return "-" if v is None else format(v * scale, spec)


def render_bench_html(doc: dict) -> str:
    runs = doc["runs"]
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    colors = {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(strategies)}
    by = {s: sorted((r for r in runs if r["strategy"] == s), key=lambda r: r["world_size"]) for s in strategies}
    throughput = _chart({s: [(r["world_size"], r["tokens_per_s"]) for r in c] for s, c in by.items()},
                        {s: [(r["world_size"], r["ideal_tokens_per_s"]) for r in c if r.get("ideal_tokens_per_s")]
                         for s, c in by.items()}, "tokens/s", colors)
    step = _chart({s: [(r["world_size"], r["step_time_s"] * 1e3) for r in c] for s, c in by.items()},
                  {s: [(r["world_size"], r["predicted_step_time_s"] * 1e3) for r in c
                       if r.get("predicted_step_time_s")] for s, c in by.items()}, "step time (ms)", colors)
    calibrated = doc.get("prediction_calibrated")
    state = ("calibrated on this machine" if calibrated else
             "UNCALIBRATED: catalog placeholder figures; run `paratrain plan --calibrate` for this machine")
    head = ("<tr><th>strategy</th><th>N</th><th>step ms</th><th>predicted step ms</th><th>tokens/s</th>"
            "<th>efficiency</th><th>peak GiB (measured)</th><th>predicted GiB</th><th>comm MiB/step</th></tr>")
    rows = "".join(
        f"<tr><td>{escape(r['strategy'])}</td><td>{r['world_size']}</td><td>{_fmt(r['step_time_s'], 1e3)}</td>"
        f"<td>{_fmt(r['predicted_step_time_s'], 1e3)}</td><td>{_fmt(r['tokens_per_s'], 1, '.0f')}</td>"
        f"<td>{_fmt(r['scaling_efficiency'], 100, '.0f')}%</td><td>{_fmt(r['peak_mem_gib'], 1, '.3f')}</td>"
        f"<td>{_fmt(r['predicted_mem_gib'], 1, '.3f')}</td><td>{_fmt(r['comm_bytes_per_step'], 1 / 2**20, '.2f')}</td>"
        f"</tr>" for r in runs)
    title = f"paratrain bench: {doc.get('model')} ({doc.get('scaling')} scaling), {', '.join(strategies)}"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title><style>
body{{font-family:sans-serif;margin:24px;max-width:1000px;color:#222}}h1{{font-size:20px}}h2{{font-size:16px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 8px}}.key{{margin-right:12px;font-size:12px}}
.key i{{display:inline-block;width:10px;height:10px;margin-right:4px}}.note{{color:#666;font-size:12px}}
.charts{{display:flex;gap:20px;flex-wrap:wrap}}</style></head><body>
<h1>{escape(title)}</h1>
<p>Prediction: {escape(state)} ({escape(doc.get('prediction_hardware') or 'none')}).</p>
<div class="charts"><div><h2>Throughput</h2>{throughput}{_legend(colors, "ideal (linear from the smallest N)")}</div>
<div><h2>Step time</h2>{step}{_legend(colors, "predicted")}</div></div>
<h2>All runs</h2><table>{head}{rows}</table>
<p class="note">peak GiB: {escape(doc.get('memory_measure') or 'per-rank peak')}.</p>
</body></html>
"""


def write_bench_html(doc: dict, path: str) -> str:
    from paratrain.doctor.doctor_html import write_html

    return write_html(render_bench_html(doc), path)
