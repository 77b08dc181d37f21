"""A throw-away parallel dimension, whole in this one package: its technique's apply records that it ran, and
its cost term adds a fixed exposed time per step for each degree above 1. Registered through
paratrain.parallel.dims.register_dim alone (tests/parallel/test_dims_registry.py)."""

from __future__ import annotations

import os

from paratrain.parallel.dims import Dim
from paratrain.parallel.technique import Technique

SECONDS_PER_DEGREE = 0.25
APPLIED: list[int] = []  # the degree of every model this process's parallelize() handed the technique
RECORD_ENV = "PARATRAIN_THROWAWAY_RECORD"  # a file each process appends "apply xx=<degree>" to (forwarded to workers)


class ThrowAway(Technique):
    apply_order = 25  # between CP and EP

    def enabled(self, layout) -> bool:
        return layout.xx > 1

    def apply(self, model, layout, tp_plan=None):
        APPLIED.append(layout.xx)
        if os.environ.get(RECORD_ENV):
            with open(os.environ[RECORD_ENV], "a") as out:
                out.write(f"apply xx={layout.xx} world={layout.world}\n")
        return model

    def step_cost(self, p, chunks, busy) -> dict[str, float]:
        return {"xx_comm_s": SECONDS_PER_DEGREE * (p.layout.xx - 1)} if self.enabled(p.layout) else {}


DIM = Dim("xx", "a throw-away dimension", mesh_order=35, technique=ThrowAway())
