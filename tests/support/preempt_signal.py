"""A preemption signal that reaches one rank only, at one step: PARATRAIN_TEST_PREEMPT_AT=RANK:STEP makes that
rank send its preemption signal (--preempt-signal, default USR1) to itself after that step (through the
after_step hook), as a scheduler's signal that reaches the ranks at different steps would
(tests/launchers/test_preemption.py). STEP 0: while the trainer is still being built (the after_parallelize
hook), before it installs its own handler, as a signal that comes while a large model loads would.

    PARATRAIN_PLUGINS=support.preempt_signal:plugin PARATRAIN_TEST_PREEMPT_AT=1:3 paratrain train --nproc 2 ...
"""

from __future__ import annotations

import os
import signal

from paratrain.errors import UserError

AT_ENV = "PARATRAIN_TEST_PREEMPT_AT"
SIGNAL_ENV = "PARATRAIN_TEST_PREEMPT_SIGNAL"  # STEP 0 only: the trainer's config is not at hand yet (default USR1)


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

    def while_building(module, layout) -> None:
        if int(os.environ.get("RANK", "0")) == rank:
            os.kill(os.getpid(), getattr(signal, f"SIG{os.environ.get(SIGNAL_ENV, 'USR1')}"))

    if step == 0:
        hooks.after_parallelize(while_building)
    else:
        hooks.after_step(after_step)
