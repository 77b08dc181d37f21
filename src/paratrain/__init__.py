"""paratrain: make the right parallel strategy easy, provable and fast."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "parallelize", "Layout", "fit"]


def __getattr__(name: str):
    # Lazy so that `paratrain --help` does not pay for importing torch.distributed.
    if name == "parallelize":
        from paratrain.parallel.parallelize import parallelize

        return parallelize
    if name == "Layout":
        from paratrain.parallel.layout import Layout

        return Layout
    if name == "fit":
        from paratrain.api import fit

        return fit
    raise AttributeError(name)
