"""A counter-based uniform hash: any sample of the synthetic data, any document's held-out draw or mixture
choice, drawn from (seed, index, stream) alone, without its neighbours."""

from __future__ import annotations

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a counter-based hash, so any sample can be drawn without its neighbours."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) & _MASK64


def uniform_hash(seed: int, index: np.ndarray, stream: int | np.ndarray) -> np.ndarray:
    """Uniform [0, 1) per (index, stream); `stream` may be an array that broadcasts against `index`."""
    with np.errstate(over="ignore"):
        key = (index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
               + (np.uint64(seed * 1000003) + np.asarray(stream, dtype=np.uint64)))
    return (_mix(_mix(key)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
