"""Draw a `bench --inference` result as one PNG with three panels: throughput against devices per layout (the one
device run starts every layout's line, dashed: ideal), time per output token and peak memory per device, each
measured (bars) next to plan --inference's prediction (marks). Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from paratrain.bench.plot import DPI, FIGSIZE, load_matplotlib, plot_throughput, run_label, save_figure


def layout_lines(runs: list[dict]) -> list[dict]:
    """The measured rows as lines per layout: the one-device row heads each layout's line."""
    measured = [r for r in runs if "refused" not in r]
    base = [r for r in measured if r["world_size"] == 1]
    strategies = list(dict.fromkeys(r["strategy"] for r in measured if r["world_size"] > 1))
    lines = [{**b, "strategy": s} for s in strategies for b in base]
    return lines + [r for r in measured if r["world_size"] > 1] if strategies else base


def _measured_vs_predicted(ax, runs: list[dict], key: str, predicted: str, scale: float, ylabel: str, title: str,
                           calibrated: bool | None) -> None:
    xs = range(len(runs))
    ax.bar(xs, [(r.get(key) or 0.0) * scale for r in runs], color="C0", label="measured")
    marks = [(i, r[predicted] * scale) for i, r in enumerate(runs) if r.get(predicted)]
    if marks:
        ax.scatter([i for i, _ in marks], [v for _, v in marks], marker="_", s=400, color="k", zorder=3,
                   label="predicted" + (" (UNCALIBRATED)" if calibrated is False else ""))
    ax.set_xticks(list(xs), [run_label(r) for r in runs], fontsize=8)
    top = max([(r.get(key) or 0.0) * scale for r in runs] + [v for _, v in marks] + [1e-9])
    ax.set_ylim(0, top * 1.35)  # room for the legend
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def plot_inference_bench(doc: dict, path: str | Path) -> Path:
    plt = load_matplotlib()
    runs = [r for r in doc["runs"] if "refused" not in r]
    fig, axes = plt.subplots(1, 3, figsize=FIGSIZE, dpi=DPI)
    plot_throughput(axes[0], layout_lines(runs))
    axes[0].set_ylabel("output tokens / s")
    calibrated = doc.get("prediction_calibrated")
    _measured_vs_predicted(axes[1], runs, "tpot_s", "predicted_tpot_s", 1e3, "ms per output token",
                           "latency per output token", calibrated)
    _measured_vs_predicted(axes[2], runs, "peak_mem_gib", "predicted_mem_gib", 1024.0, "MiB per device (peak)",
                           "memory per device", None)
    refused = [f"{r['strategy']} N={r['world_size']}" for r in doc["runs"] if "refused" in r]
    fig.suptitle(f"paratrain bench --inference: {doc.get('model')} ({doc.get('dtype')}, batch "
                 f"{doc.get('batch_per_replica')} per replica, prompt {doc.get('prompt_len')} + "
                 f"{doc.get('max_new_tokens')} new)" + (f"; refused: {', '.join(refused)}" if refused else ""),
                 fontsize=10)
    return save_figure(plt, fig, path)


def write_inference_html(doc: dict, path: str) -> str:
    """--html: bench's page (bench/bench_html.py) of the measured rows, a decode step (one output token) as the
    step; refused layouts are named on the PNG and in the table on stderr."""
    from paratrain.bench.bench_html import write_bench_html

    page = {**doc, "runs": [r for r in doc["runs"] if "refused" not in r],
            "scaling": "inference: a step is one output token"}
    return write_bench_html(page, path)
