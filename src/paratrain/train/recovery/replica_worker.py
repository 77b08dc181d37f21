"""One process of train --heal-replicas, forked by train/recovery/replica_launch.py (or python -m
paratrain.train.recovery.replica_worker CONFIG RUNDIR SUMMARY): a whole replica (ddp), or one rank of an hsdp replicate
group (FSDP2 over the group's ranks, which meet on the group's own loopback store). It trains on its slice of each
global batch, with its gradients averaged over the replicas alive (train/recovery/replica_heal.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from paratrain.errors import UserError

log = logging.getLogger("paratrain")
EXIT_USER_ERROR = 2
EXIT_NO_PEER = 3  # a replacement that found nobody to copy: not a failure of the run


def wait_for_peers(barrier_dir: Path, me: str, count: int, timeout_s: float) -> None:
    """The first replicas' `count` processes start their first step together, so none starts a quorum alone and is
    then healed. A file per process (`me`: "INDEX" or "INDEX-RANK") in the run directory: no socket beyond torchft's."""
    barrier_dir.mkdir(parents=True, exist_ok=True)
    (barrier_dir / f"up-{me}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(barrier_dir.glob("up-*"))) < count:
        if time.monotonic() > deadline:
            raise UserError(f"replica {me}: the other replicas did not start within {timeout_s:g} s")
        time.sleep(0.05)


def run_replica(cfg_path: str, run_dir: str, summary_path: str) -> int:
    import torch.distributed as dist

    from paratrain.config import TrainConfig
    from paratrain.parallel.collective_hooks import collective
    from paratrain.train.recovery.replica_groups import group_layout
    from paratrain.train.recovery.replica_heal import (
        LIGHTHOUSE_ENV,
        NoPeerToJoin,
        ReplicaHealer,
        group_identity,
        group_store,
        make_manager,
        replica_identity,
    )
    from paratrain.train.rendezvous import pin_to_loopback
    from paratrain.train.runtime import init_runtime
    from paratrain.train.trainer import Trainer
    from paratrain.train.worker import start_flight_recorder

    index, count, attempt = replica_identity()
    rank, size = group_identity()  # (0, 1): a whole-model replica
    cfg = TrainConfig(**json.loads(Path(cfg_path).read_text()))
    if attempt > 0:  # a replacement copies a live peer; an older checkpoint on disk would be the wrong state
        cfg = cfg.model_copy(update={"resume": "never"})
    if index != 0 and (cfg.ckpt_dir or cfg.ckpt_every):  # all resume from the run's checkpoints; replica 0 saves
        run_checkpoints = cfg.ckpt_dir or str(Path(summary_path).parent.parent / "checkpoints")
        cfg = cfg.model_copy(update={"ckpt_every": 0, "ckpt_dir": run_checkpoints})
    # this process's black box (train/recovery/flight_recorder.py), before any process group exists: under its own
    # output directory (RUNDIR for replica 0's first process, else RUNDIR/replicas/rI-aA), hang/rank-INDEX.json
    # (rank-N: N the process's place in the run, INDEX * group size + rank)
    recorder = start_flight_recorder(index * size + rank, run_dir, cfg.timeout_s, torch_dumps=False) \
        if cfg.flight_recorder else None
    state_dir = Path(summary_path).parent
    pin_to_loopback()  # the group's gloo/NCCL listeners, the replicas' torchft group's too
    # a replica group's ranks meet on its own loopback store (rank 0 serves it): FSDP's group and torchft's manager
    store = group_store(cfg.timeout_s, rank, state_dir / f"store-r{index}-a{attempt}.port" if size > 1 else None)
    rt = init_runtime(cfg.device, cfg.timeout_s, store=dist.PrefixStore("group", store[0]) if size > 1 else None)
    out = Path(run_dir)
    trainer = Trainer(cfg, rt, out, quiet=(index, rank) != (0, 0), data_shard=(index * size + rank, count * size),
                      layout=group_layout(cfg, size) if size > 1 else None)
    manager, store = make_manager(rt.device_type, index, os.environ[LIGHTHOUSE_ENV], cfg.timeout_s, store,
                                  (rank, size))
    joined = state_dir / f"joined-r{index}-a{attempt}.json"  # the supervisor reads it (replica_launch.py)

    def record_heal(healed_at: dict) -> None:
        if rank == 0:  # one record a replica group: its ranks all copy from the same live group
            write_json(joined, {"replica": index, "attempt": attempt, **healed_at})

    me = str(index) if size == 1 else f"{index}-{rank}"
    together = None if attempt else (lambda: wait_for_peers(state_dir / "barrier", me, count * size, cfg.timeout_s))
    try:
        if cfg.semi_sync:  # an island: it meets the others only at its syncs (island_heal.py)
            from paratrain.train.recovery.island_heal import IslandHealer

            healer = IslandHealer(trainer, manager, index, count, on_heal=record_heal)
            if attempt:
                healer.join()
            else:
                together()
        else:
            healer = ReplicaHealer(trainer, manager, index, count, on_heal=record_heal, replacement=attempt > 0,
                                   before_first_step=together, group=(rank, size))
        summary = trainer.fit()
        if size > 1:  # rank 0 serves the group's store and torchft's manager: it leaves last
            collective("replica_group_exit", "world", "barrier", None, dist.barrier)
    except NoPeerToJoin as exc:
        log.warning("%s; this replacement stops", exc)
        return EXIT_NO_PEER
    except BaseException:
        if recorder is not None:  # what it wrote stays, for `paratrain doctor --hang`
            recorder.detach()
        raise
    finally:
        manager.shutdown(wait=False)
    if recorder is not None:
        recorder.close()
    summary.update(healer.summary(), replica=index, attempt=attempt, pid=os.getpid())
    if rank == 0:  # the replica's summary (a group's ranks all end at the same step, with the same heals)
        write_json(Path(summary_path), summary)
    del store
    return 0


def write_json(path: Path, data: dict) -> None:
    """Whole or not at all: the supervisor may read it the moment it exists, or after this process was killed."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)


def run_replica_process(env: dict[str, str], *argv: str) -> None:
    """The forked process's entry: this replica's environment, then main(); its exit code is the process's."""
    os.environ.update(env)
    sys.exit(main(list(argv)))


def main(argv: list[str]) -> int:
    from paratrain.train.recovery.replica_heal import INDEX_ENV, group_identity

    first = int(os.environ.get(INDEX_ENV, "0")) == 0 and group_identity()[0] == 0  # replica 0's (first) rank
    logging.basicConfig(level=logging.INFO if first else logging.WARNING, format="paratrain: %(message)s",
                        stream=sys.stderr, force=True)
    # a healing replica's copy arrives in a read-only buffer that torch wraps, warning once; it is copied in
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    # torchft's transport rebuilds the state's tree through torch's pytree, which warns on the LeafSpec name it uses
    warnings.filterwarnings("ignore", message=".*LeafSpec.* is deprecated", category=FutureWarning)
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):  # their per-step lines
        logging.getLogger(name).setLevel(logging.CRITICAL)  # a failed step is reported by replica_heal.py
    try:
        return run_replica(*argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
