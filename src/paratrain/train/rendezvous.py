"""Where a worker process finds its peers: whether it was launched (torchrun, srun, our launcher), and the
store its process group is built on."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

# The workers of our own single-node launcher find the loopback store here ("127.0.0.1:PORT").
STORE_ENV = "PARATRAIN_STORE"


def loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def pin_to_loopback() -> None:
    """Single node: gloo and NCCL bind to the loopback interface (unless the user chose one). Left alone,
    gloo binds to whatever the host name resolves to, which may be a public address."""
    lo = loopback_interface()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if lo and not os.environ.get(var):
            os.environ[var] = lo


def in_launched_process() -> bool:
    """True when started by torchrun / srun / our own launcher (the rendezvous env is set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def worker_store(timeout_s: float):
    """The store this worker builds its process group on, under a key prefix for this attempt; or None
    to let torch decide (outside torch elastic, or when each attempt gets a fresh store anyway).

    The prefix matters after an elastic restart: keys left by the killed attempt (gloo/NCCL addresses)
    would otherwise be read by the new one (pytorch/pytorch#135712). One agent restarts all its workers
    together, so TORCHELASTIC_RESTART_COUNT agrees across them; so it does across nodes with a static
    rendezvous, where every agent sees the failure. With c10d across nodes a healthy agent restarts without
    counting, so generated multi-node scripts set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a new store each
    round) and this returns None.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    endpoint = os.environ.get(STORE_ENV)  # our own single-node launcher: its loopback store
    if not endpoint and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's shared store
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if not endpoint:
        return None
    import torch.distributed as dist

    host, port = endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"paratrain/{os.environ['TORCHELASTIC_RUN_ID']}/attempt-{attempt}", store)
