"""Keep training through a lost replica (train --heal-replicas): one replica's side, on torchft.

Each replica is a process of its own with a whole copy of the model (ddp), or one of hsdp's replicate groups: --dp-shard
processes running FSDP2 over their own shard group, each with a torchft Manager of that group's rank and size, as
torchtitan joins replicate groups. Every step a replica asks torchft's lighthouse for a quorum (the replicas alive now),
averages its gradients over that quorum (rank i of each group with rank i of the others: the local shards of the same
parameters), and commits the optimizer step only if every member finished the step. A replica that is behind the
quorum (a replacement that just started) receives the weights, the optimizer state, the step and the skipped-sample
count from a live peer over torchft's checkpoint transport (over the replicas' process group: replica_transport.py;
each joiner rank from the same rank of a live group: replica_shards.py), never from disk, and reads its data from the
step it joined at.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch

from paratrain.parallel.collective_hooks import collective
from paratrain.train.recovery.replica_shards import (
    local,
    local_state,
    module_state_like,
    optimizer_state_like,
)

log = logging.getLogger("paratrain")

# set by the supervisor (train/recovery/replica_launch.py) in each replica's environment
INDEX_ENV = "PARATRAIN_REPLICA_INDEX"
COUNT_ENV = "PARATRAIN_REPLICA_COUNT"
ATTEMPT_ENV = "PARATRAIN_REPLICA_ATTEMPT"
LIGHTHOUSE_ENV = "PARATRAIN_REPLICA_LIGHTHOUSE"
GROUP_RANK_ENV = "PARATRAIN_REPLICA_GROUP_RANK"  # this process's rank in its replica group (hsdp), and the group's size
GROUP_SIZE_ENV = "PARATRAIN_REPLICA_GROUP_SIZE"


def replica_state(trainer, extra: dict | None = None) -> dict:
    """What a joining replica copies: weights, optimizer states and the step (plus `extra`); sharded ones as this
    rank's local shards (replica_shards.py)."""
    return {"model": [local_state(part.state_dict()) for part in trainer.step_runner.model_parts],
            "optimizers": [local_state(opt.state_dict()) for opt in trainer.optimizers], "step": trainer.step,
            **(extra or {})}


def load_replica_state(trainer, state: dict) -> None:
    for part, saved in zip(trainer.step_runner.model_parts, state["model"], strict=True):
        part.load_state_dict(module_state_like(part, saved))
    for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(optimizer_state_like(opt, saved))
    trainer.step = state["step"]


def state_differences(a: dict, b: dict, where: str = "") -> list[str]:
    """The paths at which two nested states (replica_state()) differ in any bit; empty: identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}{{keys}}"]
        return [d for k in a for d in state_differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}[len]"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in state_differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


class NoPeerToJoin(RuntimeError):
    """A replacement replica found no live replica to copy (the others finished or are gone)."""


class ReplicaHealer:
    """Attaches one replica's trainer to a torchft Manager through the trainer's hooks (docs/hooks.md):
    wrap_step (quorum, healing, a rejected step's redo) and on_gradients (average over the quorum, commit)."""

    def __init__(self, trainer, manager, index: int, count: int, on_heal=None, replacement: bool = False,
                 before_first_step=None, group: tuple[int, int] = (0, 1)):
        """`on_heal(healed_at)`: called once this replica holds a peer's state (the supervisor learns it joined).
        `replacement`: this process replaces a lost one; it trains only once it found a live peer.
        `before_first_step()`: called once, after any resume, before the first quorum (the first replicas'
        barrier, so none starts a quorum alone). `group`: (this process's rank in its replica group, the group's
        size): (0, 1) for a whole-model replica."""
        self.trainer, self.manager, self.index, self.count = trainer, manager, index, count
        self.group_size = group[1]
        self.name = f"replica {index}" if group[1] == 1 else f"replica {index} rank {group[0]}"
        self.on_heal, self.must_join, self.before_first_step = on_heal, replacement, before_first_step
        self.samples_skipped = 0  # over the run: the samples of replicas missing from a committed step
        self.short_steps: list[list[int]] = []  # [step, replicas] of each committed step short of replicas
        self.healed_at: dict | None = None  # {"step", "from_replica"} once this replica copied a peer's state
        self.committed = False
        self._moved = False
        manager.register_state_dict_fn("paratrain", self._load, self._state)
        self.handles = [trainer.hooks.wrap_step(self._wrap_step), trainer.hooks.on_gradients(self._average)]

    @property
    def replica_batch(self) -> int:
        """The samples one replica (all its group's ranks) reads per step."""
        return self.trainer.source.local * self.group_size

    def _state(self) -> dict:
        return replica_state(self.trainer, {"samples_skipped": self.samples_skipped, "replica": self.index,
                                            "short_steps": list(self.short_steps)})

    def _load(self, state: dict) -> None:
        load_replica_state(self.trainer, state)
        self.samples_skipped, self.short_steps = state["samples_skipped"], [list(s) for s in state["short_steps"]]
        self.healed_at = {"step": state["step"], "from_replica": state["replica"]}
        self._moved = True
        if self.on_heal is not None:
            self.on_heal(self.healed_at)
        log.warning("%s: copied the weights, optimizer state and step %d from replica %d (no checkpoint)",
                    self.name, state["step"], state["replica"])

    def _wrap_step(self, trainer, micro_batches, step):
        manager, source = self.manager, trainer.source
        if self.before_first_step is not None:
            self.before_first_step()
            self.before_first_step = None
        manager.load_state_dict({"step": trainer.step, "batches_committed": manager.batches_committed()})
        self._moved = False
        manager.start_quorum()  # synchronous: a replica behind the quorum heals here (self._load)
        if self.must_join:
            self._join()
        if self._moved:  # this step's batch is the one of the step it joined at, and the stream goes on from there
            batch = source.rank_batch(trainer.step)
            micro_batches = [type(batch)(i, t) for i, t in zip(batch.inputs.split(source.micro_batch),
                                                                batch.targets.split(source.micro_batch))]
            source.step = trainer.step + 1
        out = step(micro_batches)
        if not self.committed:  # a member failed mid-step: the step did not happen; redo it with the same batch
            error = manager.errored()
            log.warning("%s: step %d not committed (%s); redoing it with the replicas alive", self.name,
                        trainer.step, str(error.original_exception).splitlines()[0][:200] if error else
                        "a replica failed during it")
            trainer.step -= 1
            source.step = trainer.step
            return out
        missing = self.count - manager.num_participants()
        if missing > 0:
            self.samples_skipped += missing * self.replica_batch
            self.short_steps.append([trainer.step, self.count - missing])
        return out

    def _join(self) -> None:
        """A replacement alone in its quorum asks again until the live replicas' next step takes it in: trained
        alone from its fresh weights, it would be a second, diverging run."""
        deadline = time.monotonic() + self.trainer.cfg.timeout_s
        while not self._moved and self.manager.num_participants() < 2:
            if time.monotonic() > deadline:
                raise NoPeerToJoin(f"{self.name}: no live replica to copy within "
                                   f"{self.trainer.cfg.timeout_s:g} s (--timeout-s)")
            time.sleep(0.05)
            self.manager.start_quorum()
        self.must_join = False

    def _average(self, trainer) -> None:
        """Sum the gradients (this rank's local shards of them) over the quorum in one flat buffer, divide by its
        size, then ask to commit; a rejected step leaves no gradient, so the optimizers' step is a no-op."""
        grads = [local(p.grad) for p in trainer.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(1, device=trainer.rt.device)
        from torch.distributed import ReduceOp

        collective("replica_grads", "replicas", "all_reduce", None,
                   lambda: self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait(), (flat,))
        flat /= max(1, self.manager.num_participants())
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        self.committed = self.manager.should_commit()
        if not self.committed:
            for p in trainer.params:
                p.grad = None

    def summary(self) -> dict:
        return {"replicas": self.count, "samples_skipped": self.samples_skipped, "short_steps": self.short_steps,
                "healed_at": self.healed_at}


def group_store(timeout_s: float, rank: int = 0, port_file: Path | None = None):
    """The replica group's TCPStore, on loopback only (c10d stores have no authentication): its rank 0 serves it
    (and writes its port to `port_file` for the others), the other ranks join it. Returns the store and what must
    stay alive as long as it does."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.fileno(),
                              wait_for_workers=False, timeout=timeout)
        if port_file is not None:
            tmp = port_file.with_name(port_file.name + ".tmp")
            tmp.write_text(str(port))
            tmp.replace(port_file)
        return store, sock
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 of this replica group published no store within {timeout_s:g} s")
        time.sleep(0.02)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), is_master=False, timeout=timeout), None


def make_manager(device_type: str, index: int, lighthouse: str, timeout_s: float, store=None,
                 group: tuple[int, int] = (0, 1)):
    """This process's torchft Manager: rank group[0] of replica `index` (a group of group[1] ranks; a whole-model
    replica is a group of one), on the group's loopback store (what group_store returned; default: a new one).
    Returns it and that store, which must stay alive as long as it does."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    from paratrain.train.recovery.replica_transport import peer_checkpoint_transport

    store = store or group_store(timeout_s)
    timeout = timedelta(seconds=timeout_s)
    # the replicas' group (rank i of each replica group meets rank i of the others in it): torchft reconfigures it
    # at every quorum
    replicas = ProcessGroupNCCL(timeout=timeout) if device_type == "cuda" else ProcessGroupGloo(timeout=timeout)
    # a joiner receives its peer's state over this same group (torchft's process-group transport): no server of its
    # own, where torchft's default HTTP transport would listen on every interface
    transport = peer_checkpoint_transport(replicas, timeout, torch.device(device_type))
    manager = Manager(pg=replicas, load_state_dict=None, state_dict=None, min_replica_size=1, use_async_quorum=False,
                      checkpoint_transport=transport,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=group[0],
                      world_size=group[1], store_addr="127.0.0.1", store_port=store[0].port,
                      lighthouse_addr=lighthouse, replica_id=f"replica{index}", hostname="127.0.0.1", init_sync=False)
    return manager, store


def replica_identity() -> tuple[int, int, int]:
    """(index, count, attempt) of this replica process, from its supervisor's environment."""
    return int(os.environ[INDEX_ENV]), int(os.environ[COUNT_ENV]), int(os.environ.get(ATTEMPT_ENV, "0"))


def group_identity() -> tuple[int, int]:
    """(rank in its replica group, the group's size) of this replica process: (0, 1) for a whole-model replica."""
    return int(os.environ.get(GROUP_RANK_ENV, "0")), int(os.environ.get(GROUP_SIZE_ENV, "1"))
