"""Lost replicas for train --heal-replicas and for the restart path it is compared with (tests/reliability/
test_replica_healing.py, benchmarks/goodput.py), attached through the after_step and wrap_step hooks:

    PARATRAIN_PLUGINS=support.replica_faults:plugin PARATRAIN_TEST_KILL_REPLICA=1:3 PARATRAIN_TEST_REPLICA_DIR=D
    paratrain train --heal-replicas ...
  PARATRAIN_TEST_KILL_REPLICA=INDEX[/RANK]:STEP[:compute]  SIGKILL that replica's first process (rank RANK of
                                          its first replica group under hsdp; default 0) right after that step (or
                                          inside it, in its first micro-batch's compute: the others then see that
                                          step fail and redo it);
  PARATRAIN_TEST_HOLD_AFTER=STEP          the replacement waits (before its torchft manager exists, right after
                                          its model is parallelized) until the others are past that step, and they
                                          wait after it until it asks for its first quorum (so the others train a
                                          few steps without it, and it rejoins before the run ends; 120 s at most).
                                          Held before its manager: torchft's lighthouse forms no quorum of half the
                                          replicas heartbeating, so with two replicas a replacement heartbeating
                                          without joining would hold the survivor too;
  PARATRAIN_TEST_PACE_UNTIL_JOINED=STEP   from that step on the others wait until the replacement's model is
                                          built, then pause 50 ms after each step until it took its first step
                                          (--semi-sync islands: it can join only at one of their syncs, which must
                                          not all pass before it is up, however slowly a loaded machine starts it;
                                          120 s at most);
  PARATRAIN_TEST_KILL_EVERY=N             after every Nth step but the last, SIGKILL replica (or rank) (step / N) %
                                          world, once per step value (a restart that redoes it does not die again);
  PARATRAIN_TEST_REPLICA_DIR=DIR          where the markers go; each process also appends "pid step" lines to
                                          DIR/steps-rINDEX.txt and, at the last step, saves its replica_state
                                          (train/recovery/replica_heal.py; a --semi-sync island's global copy
                                          too) to DIR/state-rINDEX-aATTEMPT.pt; a process it SIGKILLs first writes
                                          the TCP sockets it listens on to DIR/listening-PID.json ([[address, port]]:
                                          a watcher sampling from outside may never see a process that short-lived).
An hsdp replica group's rank R writes steps-rINDEX-sR.txt and state-rINDEX-aATTEMPT-sR.pt (its local shards).
The replica index comes from the supervisor's PARATRAIN_REPLICA_INDEX; outside --heal-replicas it is the rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from paratrain.train.recovery.replica_heal import ATTEMPT_ENV, COUNT_ENV, INDEX_ENV, group_identity

KILL_ENV, HOLD_ENV, EVERY_ENV, DIR_ENV = ("PARATRAIN_TEST_KILL_REPLICA", "PARATRAIN_TEST_HOLD_AFTER",
                                          "PARATRAIN_TEST_KILL_EVERY", "PARATRAIN_TEST_REPLICA_DIR")
PACE_ENV, PACE_S = "PARATRAIN_TEST_PACE_UNTIL_JOINED", 0.05
HOLD_LIMIT_S = 120.0


def identity(trainer) -> tuple[int, int, int]:
    """(index, count, attempt) of this process: its replica under --heal-replicas, else its rank."""
    if INDEX_ENV in os.environ:
        return int(os.environ[INDEX_ENV]), int(os.environ[COUNT_ENV]), int(os.environ.get(ATTEMPT_ENV, "0"))
    return trainer.rt.rank, trainer.rt.world_size, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def wait_for(marker: Path) -> None:
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def die(out: Path) -> None:
    """SIGKILL this process, its listening sockets recorded first (reliability/procnet.py reads them from /proc)."""
    import json

    from reliability.procnet import listening

    (out / f"listening-{os.getpid()}.json").write_text(json.dumps(sorted(listening(os.getpid()))))
    os.kill(os.getpid(), signal.SIGKILL)


def claim(marker: Path) -> bool:
    """True for the first process to claim this marker file (so one kill per step value, whoever retries)."""
    try:
        marker.touch(exist_ok=False)
        return True
    except FileExistsError:
        return False


def plugin(hooks) -> None:
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return
    out = Path(folder)
    spec = os.environ.get(KILL_ENV, "").split(":")
    kill = (int(spec[0].split("/")[0]), int(spec[1])) if len(spec) >= 2 else None
    kill_rank = int(spec[0].split("/")[1]) if "/" in spec[0] else 0
    rank, size = group_identity()  # in its hsdp replica group; (0, 1) otherwise
    mine = "" if size == 1 else f"-s{rank}"
    kill_inside = len(spec) == 3 and spec[2] == "compute"
    current = {"step": 0, "trainer": None}
    hold = int(os.environ.get(HOLD_ENV, "0"))
    pace_from = int(os.environ.get(PACE_ENV, "0"))
    paced = [0.0]  # seconds paused so far
    every = int(os.environ.get(EVERY_ENV, "0"))
    first_step = [True]

    @contextlib.contextmanager
    def around_compute(micro_index):
        index, _, attempt = identity(current["trainer"])
        if kill_inside and (index, current["step"]) == kill and attempt == 0 and rank == kill_rank:
            die(out)
        yield

    def wrap_step(trainer, micro_batches, step):
        index, _, attempt = identity(trainer)
        current.update(step=trainer.step + 1, trainer=trainer)
        if first_step[0] and attempt > 0:
            if hold:
                wait_for(out / f"held-at-{hold}")
            (out / f"joining-r{index}").touch()
        first_step[0] = False
        return step(micro_batches)

    def after_step(trainer, record) -> None:
        index, count, attempt = identity(trainer)
        with open(out / f"steps-r{index}{mine}.txt", "a") as f:
            f.write(f"{os.getpid()} {record['step']}\n")
        if record["step"] == trainer.cfg.steps:
            import torch

            from paratrain.train.recovery.replica_heal import replica_state

            state = replica_state(trainer)
            if getattr(trainer, "outer_sync", None) is not None:  # a --semi-sync island: its global copy too
                state["global"] = [g.clone() for g in trainer.outer_sync.global_copy]
            torch.save(state, out / f"state-r{index}-a{attempt}{mine}.pt")
        if kill is not None and not kill_inside and (index, record["step"]) == kill and attempt == 0 \
                and rank == kill_rank:
            die(out)
        step = record["step"]
        if every and step % every == 0 and step < trainer.cfg.steps and index == (step // every) % count \
                and claim(out / f"killed-at-{step}"):
            die(out)
        if hold and record["step"] == hold and kill is not None and index != kill[0]:
            (out / f"held-at-{hold}").touch()
            wait_for(out / f"joining-r{kill[0]}")
        if pace_from and record["step"] >= pace_from and kill is not None and index != kill[0] \
                and paced[0] < HOLD_LIMIT_S and not (out / f"joining-r{kill[0]}").exists():
            wait_for(out / f"built-r{kill[0]}")
            time.sleep(PACE_S)
            paced[0] += PACE_S

    def hold_replacement(module, layout) -> None:
        if int(os.environ.get(ATTEMPT_ENV, "0")) > 0:
            (out / f"built-r{os.environ.get(INDEX_ENV, '0')}").touch()  # for PACE_UNTIL_JOINED
        if hold and int(os.environ.get(ATTEMPT_ENV, "0")) > 0:
            wait_for(out / f"held-at-{hold}")

    hooks.wrap_step(wrap_step)
    hooks.after_parallelize(hold_replacement)
    hooks.around_compute(around_compute)
    hooks.after_step(after_step)
