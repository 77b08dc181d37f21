"""The function every training process runs (spawned by our launcher, torchrun or srun)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from paratrain.errors import UserError

log = logging.getLogger("paratrain")

# Test-only fault injection: PARATRAIN_FAULT_KILL="RANK:STEP" SIGKILLs that rank right after that step,
# on the first attempt only (so an elastic restart can finish the run). See docs/reliability.md.
FAULT_ENV = "PARATRAIN_FAULT_KILL"


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="paratrain: %(message)s", stream=sys.stderr, force=True)


def _fault_hook():
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    rank, step = (int(x) for x in spec.split(":"))

    def hook(trainer, record):
        if trainer.rt.rank == rank and record["step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def train_worker(cfg_dict: dict, run_dir: str | None, quiet: bool) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(**cfg_dict)
    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime(cfg.device, cfg.timeout_s)
    try:
        trainer = Trainer(cfg, rt, Path(run_dir) if run_dir else None, quiet=quiet)
        summary = trainer.fit(on_step=_fault_hook())
    except UserError as exc:
        if rt.is_main:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        shutdown()
        sys.exit(2)
    shutdown()
    return summary if rt.is_main else None
