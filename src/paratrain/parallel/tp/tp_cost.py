"""Tensor parallelism's step-time terms. Its collectives are traced per block and priced in plan/costing/time.py
(`chunk_time`: fully exposed, on the critical path); with async TP they hide under the partial matmuls."""

from __future__ import annotations


def async_tp_exposed(c, layout, overlap: float) -> float:
    """TP time left exposed per micro-batch when each all-gather / reduce-scatter is split into tp steps that
    run under the partial matmuls (async TP): the first step's transfer, and what exceeds the compute."""
    first = c.tp_exposed / layout.tp
    return first + max(0.0, c.tp_exposed - first - overlap * (c.fwd + c.bwd))
