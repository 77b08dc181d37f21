"""The planner's prediction for the Layout a run executed, for bench and doctor to show next to measurements.

plan/costing/memory.py and plan/costing/time.py evaluate that exact Layout (the one the trainer ran, as its fit summary
reports it) on this machine's hardware profile: the calibrated one when `paratrain plan --calibrate` has
saved it, else the catalog entry (a rough placeholder on CPU).
"""

from __future__ import annotations

import logging

from paratrain.parallel.layout import Layout

log = logging.getLogger("paratrain")


def predict_layout(layout: Layout, args, seq_len: int, device: str) -> dict | None:
    """{"step_time_s", "mem_gib", "comm_bytes", "hardware", "layout"} the planner predicts for `layout`, or
    None when the planner cannot evaluate it (then bench and doctor show measurements only)."""
    try:
        from paratrain.plan.auto import auto_hardware
        from paratrain.plan.costing.memory import estimate_memory
        from paratrain.plan.costing.time import estimate_time
        from paratrain.train.runtime import pick_device_type

        device_type = pick_device_type(device)
        profile, where = auto_hardware(device)
        memory = estimate_memory(args, layout, seq_len, layout.dtype, device_type)
        time = estimate_time(profile, args, layout, seq_len, layout.dtype, device_type)
    except Exception as exc:  # noqa: BLE001 - a prediction is optional; measurements still stand
        log.debug("no planner prediction for %s: %s", layout.label(), exc)
        return None
    return {"step_time_s": time.step_s, "mem_gib": memory.total / 2**30, "comm_bytes": time.comm_bytes,
            "hardware": where, "layout": layout.label(), "layout_fields": layout.to_dict()}
