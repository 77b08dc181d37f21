"""The three ways a test plants a named fault, shared by the fault modules here (faults.py, moe_faults.py):
plant() on a hook registry, planted() for the length of a block, plugin() for PARATRAIN_PLUGINS (the name read
from an environment variable, so a launched worker plants it too)."""

from __future__ import annotations

import contextlib
import os

from paratrain.train.hooks import Hooks, default_hooks


class FaultSet:
    def __init__(self, planters: dict, env: str, kind: str, error: type[Exception] = ValueError):
        self.planters, self.env, self.kind, self.error = planters, env, kind, error

    def plant(self, name: str, hooks: Hooks) -> list:
        """Register fault `name` on `hooks`; returns the handles (remove() them to take it out)."""
        if name not in self.planters:
            raise self.error(f"{name!r} is not a known {self.kind}; known: {', '.join(self.planters)}")
        return self.planters[name](hooks)

    @contextlib.contextmanager
    def planted(self, name: str | None, hooks: Hooks | None = None):
        """Fault `name` (None: none) on `hooks` (default: this process's registry) while the block runs."""
        handles = self.plant(name, hooks or default_hooks()) if name else []
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def plugin(self, hooks: Hooks) -> None:
        """PARATRAIN_PLUGINS entry: plants the fault the environment variable names."""
        name = os.environ.get(self.env, "")
        if name:
            self.plant(name, hooks)
