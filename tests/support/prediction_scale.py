"""A deliberately wrong planner, attached through paratrain's auto_candidates hook: the predicted step time of
the named strategies' candidates is multiplied by FACTOR, then they are re-ranked, for `--probe` to overturn
(tests/plan/test_probe.py).

    PARATRAIN_PLUGINS=support.prediction_scale:plugin PARATRAIN_TEST_PREDICTION_SCALE=zero3:0.01 paratrain train ...
"""

from __future__ import annotations

import logging
import os

from paratrain.errors import UserError

SCALE_ENV = "PARATRAIN_TEST_PREDICTION_SCALE"
log = logging.getLogger("paratrain")


def parse_scale(text: str) -> dict[str, float]:
    factors = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, factor = item.partition(":")
        try:
            factors[name.strip()] = float(factor)
        except ValueError:
            raise UserError(f"{SCALE_ENV}: expected STRATEGY:FACTOR, got {item!r}") from None
    return factors


def scaled(factors: dict[str, float]):
    def auto_candidates(feasible: list) -> list:
        for cand in feasible:
            if cand.layout.strategy in factors:
                cand.time.step_s *= factors[cand.layout.strategy]
                log.warning("test hook: predicted step time of %s scaled by %g", cand.layout.label(),
                            factors[cand.layout.strategy])
        return sorted(feasible, key=lambda c: c.time.step_s)

    return auto_candidates


def plugin(hooks) -> None:
    factors = parse_scale(os.environ.get(SCALE_ENV, ""))
    if factors:
        hooks.auto_candidates(scaled(factors))
