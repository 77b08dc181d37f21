"""Draw a bench result as one PNG with three panels: throughput vs devices (with ideal lines), per-device
memory as stacked bars, and where each step's time goes. Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import UserError

FIGSIZE = (15.0, 4.8)  # inches
DPI = 100  # so the PNG is 1500 x 480 pixels
PHASE_LABELS = {"forward": "forward", "backward": "backward (+ grad sync)", "optimizer": "optimizer",
                "loss_sync": "loss all-reduce", "data_wait": "data wait", "other": "other"}


def load_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib (or paratrain[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_label(run: dict) -> str:
    return f"{run['strategy']}\nN={run['world_size']}"


def plot_throughput(ax, runs: list[dict]) -> None:
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}
    for s in strategies:
        cells = sorted((r for r in runs if r["strategy"] == s), key=lambda r: r["world_size"])
        xs = [r["world_size"] for r in cells]
        ax.plot(xs, [r["tokens_per_s"] for r in cells], "o-", color=colors[s], label=s)
        for r in cells[1:]:
            if r.get("scaling_efficiency") is not None:
                ax.annotate(f"{r['scaling_efficiency']:.0%}", (r["world_size"], r["tokens_per_s"]), fontsize=7,
                            color=colors[s], textcoords="offset points", xytext=(4, 4))
        ax.plot(xs, [r.get("ideal_tokens_per_s") or 0 for r in cells], "--", color=colors[s], alpha=0.5)
    ax.plot([], [], "--", color="gray", alpha=0.6, label="ideal (linear)")
    worlds = sorted({r["world_size"] for r in runs})
    ax.set_xticks(worlds)
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens / s")
    ax.set_title("throughput vs devices")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_memory(ax, runs: list[dict]) -> None:
    """Per-device peak above the process baseline (the runtime, before the model existed) as stacked bars."""
    xs = range(len(runs))
    scale, unit = (1024.0, "MiB") if max(r["peak_mem_gib"] - r.get("baseline_mem_gib", 0.0) for r in runs) < 1 \
        else (1.0, "GiB")
    bottoms = [0.0] * len(runs)
    for key, color in (("params", "C0"), ("grads", "C1"), ("optimizer", "C2")):
        heights = [r["model_state_gib"][key] * scale for r in runs]
        ax.bar(xs, heights, bottom=bottoms, color=color, label=key)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    rest = [max(0.0, (r["peak_mem_gib"] - r.get("baseline_mem_gib", 0.0)) * scale - b) for r, b in zip(runs, bottoms)]
    ax.bar(xs, rest, bottom=bottoms, color="C7", alpha=0.6, label="activations + temporaries")
    predicted = [(i, r["predicted_mem_gib"] * scale) for i, r in enumerate(runs) if r.get("predicted_mem_gib")]
    if predicted:
        ax.scatter([i for i, _ in predicted], [v for _, v in predicted], marker="_", s=400, color="k",
                   label="predicted (tensor bytes, not RSS)", zorder=3)
    ax.set_xticks(list(xs), [run_label(r) for r in runs], fontsize=8)
    baseline = max(r.get("baseline_mem_gib", 0.0) for r in runs)
    ax.set_ylim(0, max(max(bottoms[i] + rest[i] for i in xs), 1e-9) * 1.45)  # room for the legend
    ax.set_ylabel(f"{unit} per device (peak)")
    title = "memory per device"
    if baseline:
        title += f" (above a {baseline:.2f} GiB runtime baseline)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper left")


def plot_breakdown(ax, runs: list[dict], calibrated: bool | None = None) -> None:
    xs = range(len(runs))
    bottoms = [0.0] * len(runs)
    for i, (key, label) in enumerate(PHASE_LABELS.items()):
        heights = [r["phases_s"].get(key, 0.0) * 1e3 for r in runs]
        ax.bar(xs, heights, bottom=bottoms, color=f"C{i}", label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    predicted = [(i, r["predicted_step_time_s"] * 1e3) for i, r in enumerate(runs) if r.get("predicted_step_time_s")]
    if predicted:
        ax.scatter([i for i, _ in predicted], [v for _, v in predicted], marker="_", s=400, color="k",
                   label="predicted step" + (" (UNCALIBRATED)" if calibrated is False else ""), zorder=3)
    ax.set_xticks(list(xs), [run_label(r) for r in runs], fontsize=8)
    tops = bottoms + [v for _, v in predicted]
    ax.set_ylim(0, max(max(tops), 1e-9) * 1.45)  # room for the legend
    ax.set_ylabel("ms per step")
    ax.set_title("time breakdown per step")
    ax.legend(fontsize=7, ncol=2, loc="upper left")


def plot_bench(doc: dict, path: str | Path) -> Path:
    plt = load_matplotlib()
    runs = doc["runs"]
    fig, axes = plt.subplots(1, 3, figsize=FIGSIZE, dpi=DPI)
    plot_throughput(axes[0], runs)
    plot_memory(axes[1], runs)
    plot_breakdown(axes[2], runs, doc.get("prediction_calibrated"))
    fig.suptitle(f"paratrain bench: {doc.get('model')} ({doc.get('scaling')} scaling, seq {doc.get('seq_len')})")
    return save_figure(plt, fig, path)


def save_figure(plt, fig, path: str | Path) -> Path:
    """Lay the panels out and write the PNG (its folder made)."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
