"""One island's side of DiLoCo and Streaming DiLoCo: the global copy of the parameters, the outer optimizer, and
the outer step after the inner optimizer's (the trainer calls after_inner_step() after each optimizer step).

At a fragment's sync its outer gradient, the global copy minus the island's parameters, is averaged over the
islands (outer_codec.py) and handed to the outer optimizer, torch's SGD with Nesterov momentum, which steps the
global copy; the island's parameters then restart from it. With --fragment-delay T the average is started T
inner steps earlier and the island keeps training meanwhile: at the sync its parameters become the mean of the
new global copy and where they got to (Streaming DiLoCo's merge, alpha = 0.5). Everything works on this rank's
local shard (FSDP and tensor-parallel DTensors alike): the islands' ranks at the same inner coordinates hold the
same shards, and average those over the cross-island group.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from paratrain.parallel.semi_sync.fragments import FragmentSchedule, split_into_fragments
from paratrain.parallel.semi_sync.outer_codec import PendingMean, start_mean

log = logging.getLogger("paratrain")

# Streaming DiLoCo's merge of an overlapped fragment (Douillard et al. 2025, section 2.3): half the new global
# parameters, half the island's, which went on training while the average travelled
MERGE_ALPHA = 0.5


def local_view(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of a parameter (a DTensor's local shard), sharing its storage: call under
    no_grad (to_local() is then the shard itself)."""
    return p.to_local() if hasattr(p, "to_local") else p.data


class OuterSync:
    def __init__(self, params: list[torch.Tensor], group, schedule: FragmentSchedule,
                 outer_lr: float, outer_momentum: float, outer_dtype: str, island: int, islands: int,
                 rank_in_island: int = 0, island_size: int = 1, averager=None):
        """`averager(flat) -> PendingMean`: how an outer gradient is averaged over the islands (default: over
        `group` in `outer_dtype`, outer_codec.py; --heal-replicas: through torchft's quorum, island_heal.py)."""
        self.params = list(params)  # the trained parameters of this rank's model parts, in model order
        self.group, self.schedule, self.outer_dtype = group, schedule, outer_dtype
        self.island, self.islands = island, islands
        self.rank_in_island, self.island_size = rank_in_island, island_size
        self.fragments = split_into_fragments([p.numel() for p in self.params], schedule.fragments)
        with torch.no_grad():
            self.global_copy = [local_view(p).detach().clone() for p in self.params]
        self.outer_optimizer = torch.optim.SGD(self.global_copy, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=outer_momentum > 0)
        self.inner_steps = 0  # since semi-sync training began: it places every fragment's sync
        self.pending: dict[int, PendingMean] = {}  # fragment -> its outer all-reduce under way
        self.averager = averager or (lambda flat: start_mean(flat, self.group, self.outer_dtype))

    # -- the step ---------------------------------------------------------------------------------------------
    def after_inner_step(self) -> None:
        self.inner_steps += 1
        self.sync_due()

    def sync_due(self) -> None:
        """Start the outer all-reduce and apply the outer step the schedule places after the inner step reached
        (also: a healed island, at its peers' inner step, finishing the sync they are in)."""
        started = self.schedule.started_after(self.inner_steps)
        if started is not None:
            self.pending[started] = self._start(started)
        applied = self.schedule.applied_after(self.inner_steps)
        if applied is not None:
            self._apply(applied, self.pending.pop(applied))

    @torch.no_grad()
    def _start(self, fragment: int) -> PendingMean:
        members = self.fragments[fragment]
        flat = torch.cat([(self.global_copy[i] - local_view(self.params[i])).flatten() for i in members])
        return self.averager(flat.float())

    @torch.no_grad()
    def _apply(self, fragment: int, pending: PendingMean) -> None:
        members = self.fragments[fragment]
        mean = pending.mean()
        offset = 0
        for i in members:
            g = self.global_copy[i]
            g.grad = mean[offset:offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()
        self.outer_optimizer.step()
        overlapped = self.schedule.delay > 0
        for i in members:
            self.global_copy[i].grad = None
            local = local_view(self.params[i])
            if overlapped:
                local.lerp_(self.global_copy[i], 1 - MERGE_ALPHA)
            else:
                local.copy_(self.global_copy[i])

    # -- the global parameters, for evaluation and checkpoints ----------------------------------------------------
    @contextlib.contextmanager
    def global_parameters(self):
        """The model holds the global copy inside the block (in-training validation), its island's own parameters
        again after it."""
        with torch.no_grad():
            kept = [local_view(p).clone() for p in self.params]
            for p, g in zip(self.params, self.global_copy):
                local_view(p).copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, own in zip(self.params, kept):
                    local_view(p).copy_(own)

    def settle_pending(self) -> dict[int, torch.Tensor]:
        """The means of the all-reduces under way (waited for): a checkpoint saves them, so a resume applies them
        at the same step."""
        return {fragment: pending.mean() for fragment, pending in self.pending.items()}

    def restore_pending(self, means: dict[int, torch.Tensor]) -> None:
        self.pending = {fragment: PendingMean.known(mean) for fragment, mean in means.items()}

    def pending_lengths(self) -> dict[int, int]:
        """The values of each fragment's outer gradient on this rank."""
        return {f: sum(self.global_copy[i].numel() for i in members) for f, members in enumerate(self.fragments)}

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def checkpoint_view(self):
        """What a checkpoint saves of this outer loop and how it reads it back (checkpoint_state.py)."""
        from paratrain.parallel.semi_sync.checkpoint_state import IslandCheckpoint

        return IslandCheckpoint(self)

    def index_by_storage(self) -> dict[tuple[int, int], int]:
        """(data pointer, elements) of each parameter's local tensor -> its index: how a state dict's entry (which
        shares the parameter's storage) is matched to its global copy."""
        with torch.no_grad():
            return {(local_view(p).data_ptr(), local_view(p).numel()): i for i, p in enumerate(self.params)}

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The outer optimizer's momentum, one per global copy (zeros where no outer step has made one yet: SGD's
        first step from zeros equals its first step from none)."""
        state = self.outer_optimizer.state
        for g in self.global_copy:
            if state[g].get("momentum_buffer") is None:
                state[g]["momentum_buffer"] = torch.zeros_like(g)
        return [state[g]["momentum_buffer"] for g in self.global_copy]

    @torch.no_grad()
    def restart_from_parameters(self) -> None:
        """A fresh start of the outer loop from the parameters as they are (a checkpoint of a run without
        --semi-sync): the global copy is them, no momentum, no sync under way."""
        for g, p in zip(self.global_copy, self.params):
            g.copy_(local_view(p))
        self.outer_optimizer.state.clear()
        self.inner_steps, self.pending = 0, {}


def build_outer_sync(cfg, layout, model_parts, rank: int) -> OuterSync:
    """The trainer's OuterSync for a --semi-sync run: the trained parameters of this rank's model parts, the
    cross-island group (this rank and its counterparts in the other islands)."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    from paratrain.parallel.semi_sync.islands import check_semi_sync

    check_semi_sync(cfg, layout)
    schedule = FragmentSchedule(cfg.fragments, cfg.sync_every, cfg.fragment_delay)
    # pp is refused, so dp_replicate is the outermost dimension: an island's ranks are consecutive
    island_size = layout.world // layout.dp_replicate
    outer = OuterSync(params, layout.submesh("dp_replicate").get_group(), schedule, cfg.outer_lr, cfg.outer_momentum,
                      cfg.outer_dtype, island=rank // island_size, islands=layout.dp_replicate,
                      rank_in_island=rank % island_size, island_size=island_size)
    log.info("%s: %d islands of %d rank(s), data parallelism inside each; nothing crosses islands between syncs",
             layout.semi_sync, layout.dp_replicate, island_size)
    log.info("%s: sync every %d inner steps (%d fragment(s), delay %d), outer lr %g, Nesterov momentum %g, %s "
             "outer all-reduce", layout.semi_sync, cfg.sync_every, cfg.fragments, cfg.fragment_delay, cfg.outer_lr,
             cfg.outer_momentum, cfg.outer_dtype)
    return outer
