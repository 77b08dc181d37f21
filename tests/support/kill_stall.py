"""Kill or stall one rank at one step, attached through paratrain's after_step hook (the reliability tests and
benchmarks/kill_soak.py). Each takes "RANK:STEP" and acts on the first attempt only, so an elastic restart can
finish the run:

    PARATRAIN_PLUGINS=support.kill_stall:plugin PARATRAIN_FAULT_KILL=1:3 paratrain train ...
  PARATRAIN_FAULT_KILL   SIGKILLs that rank right after that optimizer step (its metrics line written, its
                         checkpoint of that step not);
  PARATRAIN_FAULT_STALL  makes that rank sleep forever after that step, so its peers hit --timeout-s.
"""

from __future__ import annotations

import os
import signal
import time

from paratrain.errors import UserError

KILL_ENV = "PARATRAIN_FAULT_KILL"
STALL_ENV = "PARATRAIN_FAULT_STALL"


def fault_spec(var: str) -> tuple[int, int] | None:
    spec = os.environ.get(var)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    try:
        rank, step = (int(x) for x in spec.split(":"))
    except ValueError:
        raise UserError(f"{var} must look like RANK:STEP, got {spec!r}") from None
    return rank, step


def plugin(hooks) -> None:
    kill, stall = fault_spec(KILL_ENV), fault_spec(STALL_ENV)
    if kill is None and stall is None:
        return

    def after_step(trainer, record) -> None:
        here = (trainer.rt.rank, record["step"])
        if here == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if here == stall:
            while True:
                time.sleep(3600)

    hooks.after_step(after_step)
