"""What a --semi-sync checkpoint holds, and how it is read back (train/recovery/checkpoint.py asks here).

Its "model" entry is the global copy, so eval, export and a checkpoint's reader see the global parameters. Each
island's own parameters and inner optimizer state sit under "semi_sync.island<R>" (islands differ between syncs),
the outer momentum under "semi_sync.momentum", and an outer all-reduce under way (with --fragment-delay) as its
settled mean under "semi_sync.pending". The manifest's extra "semi_sync" says which: the islands, the inner step,
the pending fragments, whether momentum was saved.

A checkpoint of a run without --semi-sync resumes into one (the global copy starts from its parameters: a DDP
warm-up), and a --semi-sync checkpoint resumes into a run without it from the global parameters, with island 0's
inner optimizer state.
"""

from __future__ import annotations

import torch

from paratrain.errors import UserError

MAX_STEP = 2**40


def _like(value, local: torch.Tensor):
    """`local` shaped as the state dict's `value`: a DTensor on the same mesh and placements, or plain."""
    if hasattr(value, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape,
                                  stride=value.stride(), run_check=False)
    return local


def _local(value) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def record_problem(record) -> str | None:
    """Why a manifest's "semi_sync" record (it comes from disk) is not one this code wrote, or None."""

    def count(x, top=MAX_STEP) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= top

    ok = (isinstance(record, dict) and count(record.get("islands"), 1 << 20) and record["islands"] >= 2
          and count(record.get("inner_steps")) and isinstance(record.get("momentum"), bool)
          and isinstance(record.get("pending"), list) and all(count(f, 1 << 20) for f in record["pending"])
          and count(record.get("island_size"), 1 << 20))
    return None if ok else ("'extra.semi_sync' is not a semi-sync record (islands, island_size, inner_steps, pending, "
                            "momentum)")


def saved_semi_sync(manifest: dict | None) -> dict | None:
    """The manifest's record of a --semi-sync checkpoint, or None (read_manifest has checked it: record_problem)."""
    extra = (manifest or {}).get("extra")
    record = extra.get("semi_sync") if isinstance(extra, dict) else None
    if record is not None and record_problem(record):
        raise UserError(f"checkpoint has a malformed manifest: {record_problem(record)}")
    return record


class IslandCheckpoint:
    """The checkpoint view of one rank's OuterSync (outer_sync.py)."""

    def __init__(self, outer):
        self.outer, self.island_size = outer, outer.island_size
        self.loading: dict | None = None  # the manifest record being loaded, between tensors() and load()

    def record(self) -> dict:
        """The manifest's "semi_sync" extra for a save now."""
        return {"islands": self.outer.islands, "island_size": self.island_size, "inner_steps": self.outer.inner_steps,
                "pending": sorted(self.outer.pending), "momentum": self._momentum_on()}

    def _momentum_on(self) -> bool:
        return self.outer.outer_optimizer.param_groups[0]["momentum"] > 0

    def _pending_key(self, fragment: int) -> str:
        # a rank's flat mean of its local shards: the same on its counterparts in every island, not on its island's
        # other ranks (hence the rank inside the island in the key)
        return f"f{fragment}.r{self.outer.rank_in_island}"

    def tensors(self, model_sd: dict, optim_sd: dict, manifest: dict | None) -> dict:
        """The state dict DCP saves (manifest None) or loads into (the manifest of the checkpoint being read)."""
        outer = self.outer
        island = f"island{outer.island}"
        if manifest is None:
            saved = self.record()
            pending = {self._pending_key(f): mean for f, mean in outer.settle_pending().items()}
        else:
            saved = self.loading = saved_semi_sync(manifest)
            if saved is None:  # a run without --semi-sync: its model and optimizer are this island's start
                return {"model": model_sd, "optim": optim_sd}
            if saved["islands"] != outer.islands:
                raise UserError(f"the checkpoint holds {saved['islands']} islands; resume it with --dp-replicate "
                                f"{saved['islands']} (this run has {outer.islands})")
            if saved["pending"] and saved["island_size"] != self.island_size:
                raise UserError(f"the checkpoint was saved during an overlapped outer all-reduce by islands of "
                                f"{saved['island_size']} ranks; resume it with the same inner layout")
            lengths = outer.pending_lengths()
            pending = {self._pending_key(f): torch.empty(lengths[f]) for f in saved["pending"]}
        index = outer.index_by_storage()
        global_sd, momentum_sd = {}, {}
        buffers = outer.momentum_buffers() if saved["momentum"] and self._momentum_on() else None
        for key, value in model_sd.items():
            local = _local(value)
            i = index.get((local.data_ptr(), local.numel())) if local.numel() else None
            global_sd[key] = value if i is None else _like(value, outer.global_copy[i])
            if i is not None and buffers is not None:
                momentum_sd[key] = _like(value, buffers[i])
        out = {"model": global_sd, "semi_sync": {island: {"model": model_sd, "optim": optim_sd}}}
        if momentum_sd:
            out["semi_sync"]["momentum"] = momentum_sd
        if pending:
            out["semi_sync"]["pending"] = pending
        return out

    @torch.no_grad()
    def load(self, sd: dict) -> tuple[dict, dict]:
        """After DCP read `sd` (from tensors(manifest)): the global copy, momentum and pending means restored;
        returns the island's (model, optimizer) state dicts for the caller to load into the model parts."""
        outer, saved = self.outer, self.loading
        self.loading = None
        if saved is None:
            outer.restart_from_parameters()
            return sd["model"], sd["optim"]
        index = outer.index_by_storage()
        island = sd["semi_sync"][f"island{outer.island}"]
        buffers = outer.momentum_buffers() if self._momentum_on() else None
        for key, value in island["model"].items():
            local = _local(value)
            i = index.get((local.data_ptr(), local.numel())) if local.numel() else None
            if i is None:
                continue
            outer.global_copy[i].copy_(_local(sd["model"][key]))
            moment = sd["semi_sync"].get("momentum", {}).get(key)
            if buffers is not None and moment is not None:
                buffers[i].copy_(_local(moment))
            elif buffers is not None:
                buffers[i].zero_()
        outer.inner_steps = saved["inner_steps"]
        pending = sd["semi_sync"].get("pending", {})
        outer.restore_pending({f: pending[self._pending_key(f)].clone() for f in saved["pending"]})
        return island["model"], island["optim"]


def plain_view(model_sd: dict, optim_sd: dict, manifest: dict | None) -> dict:
    """What a run without --semi-sync reads of a checkpoint: a --semi-sync one's global parameters and island 0's
    inner optimizer state."""
    if saved_semi_sync(manifest) is None:
        return {"model": model_sd, "optim": optim_sd}
    return {"model": model_sd, "semi_sync": {"island0": {"optim": optim_sd}}}


def plain_parts(sd: dict) -> tuple[dict, dict]:
    if "optim" in sd:
        return sd["model"], sd["optim"]
    return sd["model"], sd["semi_sync"]["island0"]["optim"]
