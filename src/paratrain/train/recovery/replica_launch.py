"""train --heal-replicas: start N replicas as separate processes around one torchft lighthouse, and replace a
replica that dies (up to --max-restarts times) while the others keep training. Unlike the elastic launcher
(train/launch.py), a lost process stops nobody: no gang restart, no checkpoint reload."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from paratrain.errors import CheckFailed, UserError
from paratrain.parallel.layout import DEGREE_DIMS
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.recovery.replica_heal import ATTEMPT_ENV, COUNT_ENV, INDEX_ENV, LIGHTHOUSE_ENV

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
    # each replica is one process of world size 1: a degree (even --dp-replicate N) would be refused by every one
    degrees = [f"{d.flag} {getattr(cfg, d.name)}" for d in DEGREE_DIMS if getattr(cfg, d.name) not in (None, 1)]
    if cfg.strategy != "ddp" or degrees:
        got = " ".join(([] if cfg.strategy == "ddp" else [f"--strategy {cfg.strategy}"]) + degrees)
        replicas = cfg.dp_replicate if (cfg.dp_replicate or 1) > 1 else max(world, cfg.nproc, 2)
        raise UserError(f"--heal-replicas runs whole-model replicas, one device each, and takes no parallel degree "
                        f"(got {got}): ask for {replicas} replicas with --strategy ddp --nproc {replicas}")
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
    """Replica 0's first process writes the run's own metrics.jsonl; the others each a directory of their own."""
    return run_dir if (index, attempt) == (0, 0) else run_dir / "replicas" / f"r{index}-a{attempt}"


class _Replica:
    def __init__(self, index: int, attempt: int, proc, summary: Path):
        self.index, self.attempt, self.proc, self.summary = index, attempt, proc, summary

    def poll(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()


def _forkserver():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def run_replicas(cfg, run_dir: Path, count: int) -> dict:
    """Train `count` replicas to cfg.steps; returns the summary of the lowest-numbered replica that finished,
    with the run's replica fields (replica_restarts, replicas_finished) added."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    # the address it reports names the host; the replicas reach it on loopback, where it listens
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    state_dir = run_dir / "replicas"
    state_dir.mkdir(parents=True, exist_ok=True)
    for stale in (*state_dir.glob("barrier/up-*"), *state_dir.glob("joined-*"), *state_dir.glob("summary-*")):
        stale.unlink()  # left by an earlier run in this run directory (a resumed one)
    cfg_path = state_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg.model_dump()))

    ctx = _forkserver()

    def start(index: int, attempt: int) -> _Replica:
        out = _replica_dir(run_dir, index, attempt)
        out.mkdir(parents=True, exist_ok=True)
        summary = state_dir / f"summary-r{index}-a{attempt}.json"
        env = {INDEX_ENV: str(index), COUNT_ENV: str(count), ATTEMPT_ENV: str(attempt), LIGHTHOUSE_ENV: address,
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // count)),
               **{k: v for k, v in os.environ.items() if k.startswith("PARATRAIN_") or k == "PYTHONPATH"}}
        if cfg.device != "cpu" and os.environ.get("CUDA_VISIBLE_DEVICES") is None:
            import torch

            if torch.cuda.is_available():
                env["CUDA_VISIBLE_DEVICES"] = str(index % torch.cuda.device_count())
        from paratrain.train.recovery.replica_worker import run_replica_process

        proc = ctx.Process(target=run_replica_process, args=(env, str(cfg_path), str(out), str(summary)))
        proc.start()
        return _Replica(index, attempt, proc, summary)

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
                if code == EXIT_NO_PEER:
                    continue
                log.warning("replica %d (pid %d) exited with %s; the other replicas go on", rep.index,
                            rep.proc.pid, _exit_text(code))
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
    layout = resolve_layout(cfg, count)  # the run as a whole: ddp over the replicas, where each one saw world 1
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
