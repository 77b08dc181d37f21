"""A layout whose generation drifts from one device's, for verify --generate to catch: at the STEP-th decoding step
of a layout over more than one rank (one device's runs are the reference, untouched), row 0's runner-up token is
lifted a logit above the leader, so another token wins there (a real mismatch: the gap is a whole logit).

Plugin: PARATRAIN_PLUGINS=support.generate_faults:plugin PARATRAIN_TEST_GENERATE_FAULT=STEP; or register
flip_runner_up(STEP) on a registry's next_token_logits yourself (tests/infer/generate_worker.py)."""

from __future__ import annotations

import os

FAULT_ENV = "PARATRAIN_TEST_GENERATE_FAULT"
FAULT_STEP = 5  # under one batch of the default prompts: prompt 0's new token 4


def flip_runner_up(step: int):
    seen = [0]

    def flip(logits, layout):
        if layout.world == 1:
            return logits
        seen[0] += 1
        if seen[0] != step:
            return logits
        logits = logits.clone()
        top = logits[0].topk(2).indices
        logits[0, top[1]] = logits[0, top[0]] + 1.0
        return logits

    return flip


def plugin(hooks) -> None:
    step = os.environ.get(FAULT_ENV)
    if step:
        hooks.next_token_logits(flip_runner_up(int(step)))
