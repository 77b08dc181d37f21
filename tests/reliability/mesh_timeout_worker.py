"""4 gloo ranks on a 2 x 2 mesh (dp_shard x tp): every mesh group must carry the run's timeout, and a
collective on a sub-mesh group whose peer sleeps must fail within it. Run by test_mesh_timeouts.py."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT_S = 3


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    from paratrain.parallel.layout import Layout

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    layout = Layout(dp_shard=2, tp=2).with_mesh("cpu")  # default: the default group's timeout
    groups = {name: layout.submesh(name).get_group() for name in ("tp", "dp_shard", "dp", "dp_shard_cp")
              if layout.submesh(name) is not None}
    timeouts = {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for name, g in groups.items()}
    report = {"timeouts": timeouts}
    dist.barrier()
    if timeouts and all(t == TIMEOUT_S for t in timeouts.values()):
        # rank 1 sleeps; rank 0 (its tp peer) all-reduces on the tp group and must give up in time
        if rank == 0:
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=groups["tp"])
                report["stall"] = "completed"
            except RuntimeError as exc:
                report["stall"] = "raised"
                report["message"] = str(exc).splitlines()[0][:200]
            report["waited_s"] = time.monotonic() - start
        elif rank == 1:  # sleep until rank 0 has given up (at most a while)
            deadline = time.monotonic() + TIMEOUT_S + 20
            while not os.path.exists(os.path.join(out_dir, "rank0.json")) and time.monotonic() < deadline:
                time.sleep(0.1)
    tmp = os.path.join(out_dir, f"rank{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    os._exit(0)  # no teardown: the stalled group is broken on purpose


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
