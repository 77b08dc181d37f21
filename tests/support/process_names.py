"""Record what `ps -o comm` shows for each rank (tests/reliability/test_hang_report.py): loaded in every rank, it
writes /proc/PID/comm of its own process to $PARATRAIN_NAMES_DIR/rank-N.

    PARATRAIN_PLUGINS=support.process_names:plugin PARATRAIN_NAMES_DIR=DIR paratrain train --nproc 4 ...
"""

from __future__ import annotations

import os
from pathlib import Path

NAMES_ENV = "PARATRAIN_NAMES_DIR"


def plugin(hooks) -> None:
    out, rank = os.environ.get(NAMES_ENV), os.environ.get("RANK")
    if not out or rank is None or "LOCAL_RANK" not in os.environ:  # the launcher loads plugins too: not a rank
        return
    name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank-{rank}").write_text(name)
