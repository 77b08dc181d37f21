"""Defect 6 (issue 19): --timeout-s reaches every sub-mesh group, and the prefetcher's wait is bounded."""

from __future__ import annotations

import json
import multiprocessing
import socket
import threading
import time

import numpy as np
import pytest

from paratrain.train.data.indexed_sets import BatchSource, Prefetcher
from paratrain.train.recovery.run_failures import RunFailed
from reliability import mesh_timeout_worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_every_mesh_group_times_out_with_the_run(tmp_path):
    port, world = free_port(), 4
    # forked from this process (torch already imported): four fresh interpreters would take ~25 s on 2 cores
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=mesh_timeout_worker.main, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(75)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    errs = [p.exitcode for p in procs]
    reports = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)
               if (tmp_path / f"rank{r}.json").exists()}
    assert len(reports) == world, errs
    for rank, rep in reports.items():
        # torch's default for a sub-mesh group is 1800 s (gloo): every group must carry the 3 s instead
        assert rep["timeouts"] and set(rep["timeouts"].values()) == {3.0}, (rank, rep)
    stall = reports[0]
    assert stall["stall"] == "raised" and stall["waited_s"] < 3 + 4, stall


class StuckDataset:
    """A data set whose reads hang (a dead network filesystem)."""

    path = "/mnt/stuck/tokens.bin"

    def __init__(self):
        self.release = threading.Event()

    def samples(self, indices):
        self.release.wait(30)
        return np.zeros((len(indices), 9), dtype=np.int64)


def test_prefetcher_wait_is_bounded_and_names_the_stall():
    data = StuckDataset()
    pf = Prefetcher(BatchSource(data, 2, 0, 1, 2), timeout_s=0.5)
    start = time.monotonic()
    try:
        with pytest.raises(RunFailed, match=r"data loader produced no batch for step 1 within 0.5 s .*stuck"):
            pf.next_step()
        assert time.monotonic() - start < 3
    finally:
        pf.close()
        data.release.set()
