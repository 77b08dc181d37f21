"""One line when the elastic agent restarts the ranks (--max-restarts): which rank failed, how, and which restart
this is. The agent says so only in its own log records, which the launcher otherwise silences; this handler reads
the two it needs. It also clears the failed attempt's flight-recorder files, so the next attempt's diagnosis
reads only its own."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

log = logging.getLogger("paratrain")

FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # "failed (exitcode: ...) local_rank: ..."
AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"  # "... attempts left; will restart worker group"


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class RestartReporter(logging.Handler):
    """Attach to FAILURE_LOGGER and AGENT_LOGGER (at INFO) for the length of one launch."""

    def __init__(self, hang_dir: Path | None, max_restarts: int):
        super().__init__(logging.INFO)
        self.hang_dir, self.max_restarts = hang_dir, max_restarts
        self.failed: tuple[int, int] | None = None  # (rank, exit code) of the attempt's first failure
        self.restarts = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        if message.startswith("failed (exitcode") and len(record.args or ()) >= 2:
            code, local_rank = record.args[0], record.args[1]
            self.failed = (int(local_rank), int(code) if code is not None else None)
        elif "will restart worker group" in message and self.failed is not None:
            self.restarts += 1
            log.warning("%s: restarting every rank from the newest checkpoint (restart %d of --max-restarts %d)",
                        self.describe_failure(), self.restarts, self.max_restarts)
            self.failed = None
            self.clear_records()

    def describe_failure(self) -> str:
        from paratrain.train.recovery.hang_report import hang_line

        rank, code = self.failed
        # one node: the local rank is the rank
        culprit = hang_line(self.hang_dir, {rank: code})
        if culprit:
            return culprit
        return f"rank {rank} died ({exit_text(code)})" if code is not None and code < 0 else \
            f"rank {rank} failed ({exit_text(code)})"

    def clear_records(self) -> None:
        if self.hang_dir is None or not self.hang_dir.is_dir():
            return
        for path in self.hang_dir.glob("rank-*.*"):  # records (.json) and completed steps (.step)
            path.unlink(missing_ok=True)


def attach(reporter: RestartReporter, quiet_others: bool) -> list[tuple[logging.Logger, int, bool]]:
    """Route the two loggers' records to `reporter` (and, unless quiet_others is False, nowhere else); returns
    what detach() restores."""
    saved = []
    for name in (FAILURE_LOGGER, AGENT_LOGGER):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.setLevel(logging.INFO)
        logger.propagate = not quiet_others
        logger.addHandler(reporter)
    return saved


def detach(reporter: RestartReporter, saved: list[tuple[logging.Logger, int, bool]]) -> None:
    for logger, level, propagate in saved:
        logger.removeHandler(reporter)
        logger.setLevel(level)
        logger.propagate = propagate
