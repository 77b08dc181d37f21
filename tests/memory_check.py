"""The planner's per-rank peak against the peak measured by calibrate/harness.py, for a list of runs."""

from __future__ import annotations


def predicted_vs_measured(measured: list, tolerance: float, label=lambda cfg: cfg.model) -> tuple[list, list]:
    """(a row per run, the rows outside `tolerance`) for [(TrainConfig, measure() result), ...]."""
    from paratrain.models.presets import model_args_for
    from paratrain.parallel.layout import Layout
    from paratrain.plan.costing.memory import estimate_memory

    rows, misses = [], []
    for cfg, result in measured:
        assert result["error"] is None, f"{cfg.model}/{cfg.strategy}: {result['error']}"
        layout = Layout.from_dict(result["layout"])  # exactly what the trainer ran
        predicted = estimate_memory(model_args_for(cfg), layout, cfg.seq_len, cfg.dtype, "cpu").total
        actual = max(result["peak_bytes"])
        ratio = predicted / actual
        rows.append(f"{label(cfg):>8} {cfg.strategy:<10} predicted {predicted / 2**20:8.2f} MiB, measured "
                    f"{actual / 2**20:8.2f} MiB, ratio {ratio:.3f}")
        if abs(ratio - 1) > tolerance:
            misses.append(rows[-1])
    return rows, misses
