"""A preemption signal that reaches one rank only, at one step: PARATRAIN_TEST_PREEMPT_AT=RANK:STEP makes that
rank send its preemption signal (--preempt-signal, default USR1) to itself after that step (through the
after_step hook), as a scheduler's signal that reaches the ranks at different steps would
(tests/launchers/test_preemption.py).

    PARATRAIN_PLUGINS=support.preempt_signal:plugin PARATRAIN_TEST_PREEMPT_AT=1:3 paratrain train --nproc 2 ...
"""

from __future__ import annotations

import os
import signal

from paratrain.errors import UserError

AT_ENV = "PARATRAIN_TEST_PREEMPT_AT"


def plugin(hooks) -> None:
    text = os.environ.get(AT_ENV, "")
    if not text:
        return
    try:
        rank, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise UserError(f"{AT_ENV}={text!r}: give RANK:STEP, e.g. 1:3") from None

    def after_step(trainer, record) -> None:
        if trainer.rt.rank == rank and record["step"] == step:
            os.kill(os.getpid(), getattr(signal, f"SIG{trainer.cfg.preempt_signal}"))

    hooks.after_step(after_step)
