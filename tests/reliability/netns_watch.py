"""Run inside a private UTS + network + mount namespace (see test_loopback_netns.py): check the host name
resolves to a non-loopback address, join a lone process group the way `paratrain train` on one process
does (runtime.init_runtime), run a collective, and print as JSON every TCP socket this process listens on."""

from __future__ import annotations

import json
import os
import socket

import torch
import torch.distributed as dist

from paratrain.train.runtime import init_runtime, shutdown
from reliability.procnet import listening


def main() -> None:
    resolved = socket.gethostbyname(socket.gethostname())
    for var in ("RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.pop(var, None)
    init_runtime("cpu", 30)
    dist.all_reduce(torch.ones(1))
    seen = sorted(listening(os.getpid()))
    shutdown()
    print(json.dumps({"hostname": socket.gethostname(), "resolved": resolved, "listeners": seen}))


if __name__ == "__main__":
    main()
