"""The memory truth of generation on CPU: one rank's peak live tensor bytes while it generates (the live-tensor
tracker calibrate/harness.py measures training with), its model's parameters and buffers counted from the start.
What `plan --inference` predicts per device (plan/inference_cost.py) is checked against it."""

from __future__ import annotations

from collections.abc import Callable


def generate_peak_bytes(parts: list, generate: Callable[[], object]) -> int:
    """Peak bytes of this rank while `generate()` runs (for example infer/generate_run.py generate_rank: a
    collective, so every rank of the layout measures at once), its model `parts`' weights included."""
    from paratrain.plan.tracing.tracker import LiveTensorTracker

    with LiveTensorTracker() as tracker:
        for part in parts:
            tracker.track_module(part)
        generate()
    return tracker.peak
