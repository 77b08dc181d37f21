"""Start N local worker processes through torch elastic, or run inline when already launched.

Single-node runs host the rendezvous store in this process on a socket bound to 127.0.0.1, so nothing
listens on an external interface (c10d's TCPStore has no authentication).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta

from paratrain.errors import CheckFailed, UserError
from paratrain.train.runtime import in_launched_process

log = logging.getLogger("paratrain")


def _loopback_store(timeout_s: float):
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.fileno(), wait_for_workers=False,
                          multi_tenant=True, timeout=timedelta(seconds=max(timeout_s, 30)))
    return store, sock, port


def run_workers(entry: Callable, args: tuple, nproc: int, max_restarts: int = 0, timeout_s: float = 60.0) -> dict:
    """Run entry(*args) on nproc local ranks; returns {rank: return value}.

    Already inside torchrun/srun (RANK and WORLD_SIZE set): run entry once, in this process.
    """
    if in_launched_process():
        return {int(os.environ["RANK"]): entry(*args)}
    if nproc == 1 and max_restarts == 0:
        return {0: entry(*args)}
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    store, sock, port = _loopback_store(timeout_s)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:12],
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_configs={"is_host": False, "timeout": int(max(timeout_s, 30))},
                          max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        return elastic_launch(config, entry)(*args)
    except ChildFailedError as exc:
        raise CheckFailed(_summarise_failure(exc)) from None
    finally:
        del store, sock  # the store owns the listening socket's fd from here on


def _summarise_failure(exc) -> str:
    rank, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
    reason = lines[-1] if lines else f"exit code {failure.exitcode}"
    if failure.exitcode == 2 or reason.startswith("paratrain.errors.UserError"):
        raise UserError(reason.split(": ", 1)[-1]) from None
    return f"rank {rank} failed: {reason}"
