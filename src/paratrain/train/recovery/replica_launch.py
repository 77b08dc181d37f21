"""train --heal-replicas: start N replicas as separate processes around one torchft lighthouse, and replace a
replica that dies (up to --max-restarts times) while the others keep training. A replica is one process (ddp), or
one of hsdp's replicate groups of --dp-shard processes: a process lost in a group takes its group down (its other
members are stopped, the whole group is restarted and heals on rejoining). Unlike the elastic launcher
(train/launch.py), a lost replica stops no other replica: no gang restart, no checkpoint reload."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from paratrain.errors import CheckFailed, UserError
from paratrain.parallel.layout import DEGREE_DIMS
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.recovery.replica_groups import GROUP_DIMS, heal_groups
from paratrain.train.recovery.replica_heal import (
    ATTEMPT_ENV,
    COUNT_ENV,
    GROUP_RANK_ENV,
    GROUP_SIZE_ENV,
    INDEX_ENV,
    LIGHTHOUSE_ENV,
)

log = logging.getLogger("paratrain")

EXIT_USER_ERROR, EXIT_NO_PEER = 2, 3  # train/recovery/replica_worker.py
# replicas fork from one server that imported these once: a replacement is up in about a second, not after
# the several-second import of a fresh interpreter (torchft is left out: it starts threads)
PRELOAD = ("torch", "torch.distributed", "paratrain.train.trainer", "paratrain.train.recovery.replica_worker")
# a replica absent this long is dropped from the quorum; one that has not asked for this step's quorum within
# JOIN_MS is left out of it (so a replacement joins at the next step boundary after it is up)
HEARTBEAT_TIMEOUT_MS = 1500
JOIN_TIMEOUT_MS = 1000
FINISH_GRACE_S = 30.0  # after a replica finished, how long those that trained with it may take to exit


def check_heal_run(cfg, world: int, script) -> None:
    """UserError, in one line, for what --heal-replicas cannot run."""
    # a ddp replica is one process of world size 1 (a degree, even --dp-replicate N, would be refused by every one);
    # an hsdp replicate group runs FSDP over --dp-shard ranks and nothing else
    degrees = [f"{d.flag} {getattr(cfg, d.name)}" for d in DEGREE_DIMS if getattr(cfg, d.name) not in (None, 1)
               and (cfg.strategy != "hsdp" or d not in GROUP_DIMS)]
    if cfg.strategy == "hsdp" and degrees:
        raise UserError(f"--heal-replicas heals hsdp's replicate groups, each FSDP over --dp-shard ranks and no other "
                        f"degree (got {' '.join(degrees)}): drop it, or heal whole replicas with --strategy ddp")
    if cfg.strategy not in ("ddp", "hsdp") or degrees:
        got = " ".join(([] if cfg.strategy == "ddp" else [f"--strategy {cfg.strategy}"]) + degrees)
        replicas = cfg.dp_replicate if (cfg.dp_replicate or 1) > 1 else max(world, cfg.nproc, 2)
        raise UserError(f"--heal-replicas runs whole-model replicas, one device each, or hsdp's replicate groups, and "
                        f"takes no other parallel degree (got {got}): ask for {replicas} replicas with --strategy ddp "
                        f"--nproc {replicas}")
    if cfg.strategy == "hsdp":
        heal_groups(cfg, world)  # hsdp's own degrees: two groups or more, of two ranks or more
        if cfg.semi_sync:
            raise UserError("--heal-replicas --semi-sync heals one-process islands (--strategy ddp), not hsdp's "
                            "replicate groups")
    if cfg.ddp_comm_hook != "none" or cfg.local_sgd_period:
        raise UserError("--heal-replicas averages plain gradients over the replicas alive: it takes no "
                        "--ddp-comm-hook or --local-sgd-period")
    from paratrain.train.rendezvous import in_launched_process

    if in_launched_process():
        raise UserError("--heal-replicas starts its own replica processes on this node: run it without "
                        "torchrun / srun")
    if world < 2:
        raise UserError("--heal-replicas needs --nproc 2 or more: the replicas that can stand in for each other")
    if script:
        raise UserError("--heal-replicas trains the presets (--model), not a --script model")
    from paratrain.train.data.source import uses_documents

    if uses_documents(cfg):
        raise UserError("--heal-replicas reads synthetic data or a token file: a document stream's position "
                        "cannot be handed to a replacement replica")
    if cfg.global_batch % world:
        raise UserError(f"--global-batch {cfg.global_batch} must be divisible by the {world} replicas")
    if cfg.micro_batch and (cfg.global_batch // world) % cfg.micro_batch:
        raise UserError(f"each replica's batch ({cfg.global_batch // world}) is not divisible by --micro-batch "
                        f"{cfg.micro_batch}")
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its lighthouse logs every quorum at info
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise UserError("--heal-replicas needs torchft: pip install -e '.[heal]'") from None


def _replica_dir(run_dir: Path, index: int, attempt: int) -> Path:
    """Replica 0's first process (group) writes the run's own metrics.jsonl; the others each a directory of their
    own (a group's ranks share it: rank 0 writes the metrics, each rank its own hang/rank-N files)."""
    return run_dir if (index, attempt) == (0, 0) else run_dir / "replicas" / f"r{index}-a{attempt}"


class _Replica:
    """One replica's processes (one, or a replicate group's ranks), started and stopped together."""

    def __init__(self, index: int, attempt: int, procs: list, summary: Path):
        self.index, self.attempt, self.procs, self.summary = index, attempt, procs, summary

    def poll(self) -> int | None:
        """0 once every process exited 0; a failed process's exit code as soon as one failed; None while running."""
        failed = self.failed()
        if failed is not None:
            return failed.exitcode
        return None if any(proc.exitcode is None for proc in self.procs) else 0

    def failed(self):
        """The process that failed, if one did: one killed by a signal first (the cause, where its group's other
        ranks then fail on it)."""
        failed = [proc for proc in self.procs if proc.exitcode not in (None, 0)]
        return min(failed, key=lambda proc: proc.exitcode >= 0) if failed else None

    def kill(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join()


def _forkserver():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def run_replicas(cfg, run_dir: Path, world: int) -> dict:
    """Train the replicas of a run of `world` processes (heal_groups) to cfg.steps; returns the summary of the
    lowest-numbered replica that finished, with the run's replica fields (replica_restarts, replicas_finished)
    added."""
    count, size = heal_groups(cfg, world)
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    # the address it reports names the host; the replicas reach it on loopback, where it listens
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    state_dir = run_dir / "replicas"
    state_dir.mkdir(parents=True, exist_ok=True)
    for stale in (*state_dir.glob("barrier/up-*"), *state_dir.glob("joined-*"), *state_dir.glob("summary-*"),
                  *state_dir.glob("store-*")):
        stale.unlink()  # left by an earlier run in this run directory (a resumed one)
    cfg_path = state_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg.model_dump()))

    ctx = _forkserver()

    def start(index: int, attempt: int) -> _Replica:
        out = _replica_dir(run_dir, index, attempt)
        out.mkdir(parents=True, exist_ok=True)
        summary = state_dir / f"summary-r{index}-a{attempt}.json"
        from paratrain.train.recovery.replica_worker import run_replica_process

        procs = []
        for rank in range(size):
            env = {INDEX_ENV: str(index), COUNT_ENV: str(count), ATTEMPT_ENV: str(attempt), LIGHTHOUSE_ENV: address,
                   GROUP_RANK_ENV: str(rank), GROUP_SIZE_ENV: str(size),
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world)),
                   **{k: v for k, v in os.environ.items() if k.startswith("PARATRAIN_") or k == "PYTHONPATH"}}
            if size > 1:  # the group's own process group (its store: replica_worker.py)
                env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK="0")
            if cfg.device != "cpu" and os.environ.get("CUDA_VISIBLE_DEVICES") is None:
                import torch

                if torch.cuda.is_available():
                    env["CUDA_VISIBLE_DEVICES"] = str((index * size + rank) % torch.cuda.device_count())
            proc = ctx.Process(target=run_replica_process, args=(env, str(cfg_path), str(out), str(summary)))
            proc.start()
            procs.append(proc)
        return _Replica(index, attempt, procs, summary)

    running = [start(i, 0) for i in range(count)]
    finished: dict[int, dict] = {}
    restarts, user_error, finish_deadline = 0, False, None
    try:
        while running:
            time.sleep(0.05)
            for rep in list(running):
                code = rep.poll()
                if code is None:
                    continue
                running.remove(rep)
                if code == 0 and rep.summary.exists():
                    finished.setdefault(rep.index, json.loads(rep.summary.read_text()))
                    finish_deadline = finish_deadline or time.monotonic() + FINISH_GRACE_S
                    continue
                user_error = user_error or code == EXIT_USER_ERROR
                pid = rep.failed().pid
                rep.kill()  # the rest of its group: a replica group trains and heals whole
                if code == EXIT_NO_PEER:
                    continue
                log.warning("replica %d (pid %d) exited with %s; the other replicas go on", rep.index, pid,
                            _exit_text(code))
                if not finished and not user_error and restarts < cfg.max_restarts and running:
                    restarts += 1
                    running.append(start(rep.index, rep.attempt + 1))
                    log.warning("replica %d restarted (%d of --max-restarts %d): it copies its state from a live "
                                "replica", rep.index, restarts, cfg.max_restarts)
            if finish_deadline:  # a replacement that never joined has nobody left to join: stop it now
                late = [rep for rep in running if time.monotonic() > finish_deadline or
                        (rep.attempt > 0 and not (state_dir / f"joined-r{rep.index}-a{rep.attempt}.json").exists())]
                for rep in late:
                    log.warning("replica %d did not finish with the others; stopping it", rep.index)
                    rep.kill()
                    running.remove(rep)
    finally:
        for rep in running:
            rep.kill()
        lighthouse.shutdown()
    if not finished:
        if user_error:
            raise UserError("no replica could start (see the replicas' errors above)")
        raise CheckFailed(f"no replica finished the run ({restarts} restarts of --max-restarts "
                          f"{cfg.max_restarts})")
    summary = finished[min(finished)]
    layout = resolve_layout(cfg, world)  # the run as a whole (ddp over the replicas, where each one saw world 1)
    summary.update(world_size=layout.world, dims=layout.degrees(), layout=layout.to_dict(),
                   replica_restarts=restarts, replicas_finished=sorted(finished), healed_at=heals_of(state_dir))
    return summary


def heals_of(state_dir: Path) -> list[dict]:
    """Every replacement that copied a live replica's state in this run, in step order: {"replica", "attempt",
    "step", "from_replica"} (train/recovery/replica_worker.py writes one file each, even for a process lost later)."""
    heals = [json.loads(p.read_text()) for p in state_dir.glob("joined-*.json")]
    return sorted(heals, key=lambda h: (h["step"], h["replica"], h["attempt"]))


def _exit_text(code: int) -> str:
    if code < 0:
        import signal

        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
