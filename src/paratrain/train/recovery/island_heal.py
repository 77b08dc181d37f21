"""Keep --semi-sync training through a lost island (train --heal-replicas --semi-sync ...): one island's side.

Each island is one replica process (train/recovery/replica_launch.py starts and replaces them) with a whole copy of
the model. Between syncs nothing is exchanged. At each fragment sync the island asks torchft's lighthouse for a
quorum (the islands alive now), averages its outer gradient over it through torchft's managed process group (fp32:
its fault-tolerant all-reduce; bf16, int8, int4: an all-gather of outer_codec.py's encodings), and applies the
outer step only if every member committed; otherwise it asks again, with the islands still alive. An
island that died between two syncs is simply missing from the next one (its inner steps since the last sync are
lost). Its replacement waits for the live islands' next sync, receives one's state there over torchft's
process-group transport (replica_transport.py), never from disk: the step, the island's parameters and inner
optimizer, the global copy, the outer momentum and the inner step; takes part in that sync contributing nothing
(its outer gradient would repeat its source's) and trains on from it, so the islands' global copies stay
bit-identical. With --fragment-delay T the sync is where a fragment's all-reduce starts: the committed mean waits
T inner steps to be applied, as without healing (the exchange itself is not overlapped here).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from paratrain.parallel.collective_hooks import collective
from paratrain.parallel.semi_sync.fragments import FragmentSchedule
from paratrain.parallel.semi_sync.outer_codec import PendingMean, mean_of_contributions, pack_contribution
from paratrain.parallel.semi_sync.outer_sync import OuterSync
from paratrain.train.recovery.replica_heal import NoPeerToJoin, load_replica_state, replica_state

log = logging.getLogger("paratrain")


class IslandHealer:
    def __init__(self, trainer, manager, index: int, count: int, on_heal=None):
        """Builds this island's outer loop (trainer.outer_sync) with its average taken through `manager`.
        `on_heal(healed_at)`: called once this island holds a peer's state."""
        cfg = trainer.cfg
        self.trainer, self.manager, self.index, self.count, self.on_heal = trainer, manager, index, count, on_heal
        self.healed_at: dict | None = None
        self.syncs_short: list[list[int]] = []  # [step, islands] of each committed sync short of islands
        self._in_quorum = False  # a joiner healed inside a quorum its peers are still in
        self._contributes = True  # False for a joiner's first sync: its outer gradient is its source's
        params = [p for part in trainer.step_runner.model_parts for p in part.parameters() if p.requires_grad]
        schedule = FragmentSchedule(cfg.fragments, cfg.sync_every, cfg.fragment_delay)
        self.outer = OuterSync(params, None, schedule, cfg.outer_lr, cfg.outer_momentum, cfg.outer_dtype,
                               island=index, islands=count, averager=self._average)
        trainer.outer_sync = self.outer
        trainer.state.islands = self.outer.checkpoint_view()
        manager.register_state_dict_fn("paratrain", self._load, self._state)
        log.info("%s: %d one-process islands, --heal-replicas; sync every %d inner steps (%d fragment(s)), outer lr "
                 "%g, Nesterov momentum %g", cfg.semi_sync, count, cfg.sync_every, cfg.fragments, cfg.outer_lr,
                 cfg.outer_momentum)

    # -- the state a joiner copies --------------------------------------------------------------------------------
    def _state(self) -> dict:
        # served inside a sync, from after_inner_step: the inner step being synced is done, the trainer counts it
        # once that call returns
        outer = self.outer
        return replica_state(self.trainer, {
            "step": self.trainer.step + 1, "replica": self.index, "inner_steps": outer.inner_steps,
            "global": list(outer.global_copy), "momentum": outer.momentum_buffers()})

    @torch.no_grad()
    def _load(self, state: dict) -> None:
        outer = self.outer
        load_replica_state(self.trainer, state)
        for mine, theirs in zip([*outer.global_copy, *outer.momentum_buffers()],
                                [*state["global"], *state["momentum"]], strict=True):
            mine.copy_(theirs)
        outer.inner_steps = state["inner_steps"]
        self.healed_at = {"step": state["step"], "from_replica": state["replica"]}
        if self.on_heal is not None:
            self.on_heal(self.healed_at)
        log.warning("island %d: copied the parameters, the inner optimizer state, the global copy, the outer "
                    "momentum and step %d from island %d (no checkpoint)", self.index, state["step"],
                    state["replica"])

    # -- the sync -------------------------------------------------------------------------------------------------
    def _average(self, flat: torch.Tensor) -> PendingMean:
        """The islands' mean of `flat` through torchft: quorum, exchange, commit; asked again until committed.
        A joiner, whose outer gradient would repeat the one of the island it copied, is not counted (torchft, with
        synchronous quorums, counts it as a participant)."""
        manager = self.manager
        while True:
            if not self._in_quorum:
                # the global step as torchft's: a replacement (at 0) is always behind the quorum, so it heals
                manager.load_state_dict({"step": self.trainer.step + 1, "batches_committed": 0})
                manager.start_quorum()
            self._in_quorum = False
            finish = exchange_over_quorum(manager, flat, self.outer.outer_dtype, self.index, self._contributes)
            if manager.should_commit():
                self._contributes = True
                mean, contributed = finish()
                if contributed < self.count:
                    self.syncs_short.append([self.trainer.step + 1, contributed])
                return PendingMean.known(mean)
            error = manager.errored()
            log.warning("island %d: the sync after step %d was not committed (%s); syncing again with the islands "
                        "alive", self.index, self.trainer.step + 1,
                        str(error.original_exception).splitlines()[0][:200] if error else "an island failed in it")

    def join(self) -> None:
        """A replacement: ask for quorums until the live islands' next sync takes it in and it holds a peer's
        state, then finish that sync with them. Alone, from fresh weights, it would be a second, diverging run."""
        manager, deadline = self.manager, time.monotonic() + self.trainer.cfg.timeout_s * 4
        manager.load_state_dict({"step": 0, "batches_committed": 0})
        while self.healed_at is None:
            if time.monotonic() > deadline:
                raise NoPeerToJoin(f"island {self.index}: no live island reached a sync within "
                                   f"{self.trainer.cfg.timeout_s * 4:g} s (4 x --timeout-s)")
            manager.start_quorum()
            if self.healed_at is None:
                time.sleep(0.05)
        self._in_quorum, self._contributes = True, False
        self.outer.sync_due()  # with --fragment-delay, the sync it joined starts an all-reduce applied T steps on
        self.trainer.source.step = self.trainer.step  # its data goes on from the step it joined at

    def summary(self) -> dict:
        return {"replicas": self.count, "healed_at": self.healed_at, "short_syncs": self.syncs_short}


def exchange_over_quorum(manager, flat: torch.Tensor, dtype: str, island: int, contributes: bool):
    """This island's side of one sync's exchange over torchft's quorum; returns finish() -> (the mean, the islands
    counted), to be called once the sync is committed (before, a failed exchange may have left anything).
    fp32: one all-reduce of `flat` and a count (a joiner adds zeros and 0). bf16, int8, int4: an all-gather of every
    member's encoded bytes (outer_codec.py), each then decoding and summing them in island order, so every island
    gets the same bits, those start_mean gets without --heal-replicas."""
    if dtype == "fp32":
        weight = 1.0 if contributes else 0.0
        total = torch.cat([flat * weight, flat.new_full((1,), weight)])
        collective("outer_sync", "replicas", "all_reduce", None,
                   functools.partial(_sum_over_quorum, manager, total), (total,))
        return lambda: (total[:-1] / total[-1], int(total[-1].item()))
    payload = pack_contribution(flat, dtype, island, contributes)
    parts = [torch.zeros_like(payload) for _ in range(max(1, manager.num_participants()))]
    collective("outer_sync", "replicas", "all_gather", None,
               functools.partial(_gather_over_quorum, manager, parts, payload), (*parts, payload))
    return lambda: mean_of_contributions(parts, dtype, flat.numel())


def _sum_over_quorum(manager, tensor: torch.Tensor) -> None:
    from torch.distributed import ReduceOp

    manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()


def _gather_over_quorum(manager, parts: list[torch.Tensor], payload: torch.Tensor) -> None:
    """An all-gather over the quorum's process group; a failure is reported to the manager, as its own all-reduce
    reports one, so the sync is not committed anywhere."""
    from torch.distributed.distributed_c10d import AllgatherOptions
    from torchft.process_group import ManagedProcessGroup

    if manager.errored():
        return
    try:
        ManagedProcessGroup(manager).allgather([parts], [payload], AllgatherOptions()).wait()
    except Exception as exc:  # a peer lost mid-collective, as torchft treats it in its own all-reduce
        manager.report_error(exc)
