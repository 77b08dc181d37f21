"""verify --semi-sync: the run against its islands simulated on one device (verify/parity.py asks here).

The reference trains one single-device copy of the model per island, each on that island's share of every global
batch (the data-parallel ranks of an island read consecutive slices, so an island's share is one slice of
--dp-replicate) with its own inner optimizer, and meets them at each fragment's sync for the outer step: the mean of
their outer gradients (global copy minus island parameters; --outer-dtype's encoding applied as the run's outer
all-reduce applies it), torch's SGD with Nesterov momentum on the global copy, then every island restarting from it
(or, with --fragment-delay, merging half way). It is written from the method, not from parallel/semi_sync/
outer_sync.py, so a wrong outer step in the run shows. Every step each rank's loss (the mean over all islands),
pre-clip gradients, gradient norm, parameters and activation fingerprints are compared with its island's reference
(verify's fp32 tolerances); after each sync, every rank's global copy with the reference's, in units of the outer
step's own update.
"""

from __future__ import annotations

import json

import torch

from paratrain.errors import UserError
from paratrain.models.hf_pipeline import hf_name
from paratrain.parallel.semi_sync.fragments import FragmentSchedule, split_into_fragments
from paratrain.parallel.semi_sync.outer_codec import mean_of_contributions, pack_contribution
from paratrain.verify.compare import compare_step, judge, nanmax, param_errors
from paratrain.verify.recorder import clean_name, full_tensors

# Streaming DiLoCo's merge of an overlapped fragment: half the new global copy, half the island's own parameters
MERGE_ALPHA = 0.5


def check_islands_verifiable(cfg, layout) -> None:
    """UserError, in one line, for a --semi-sync run verify cannot compare step for step."""
    flag = f"verify --semi-sync {layout.semi_sync}"
    first_sync = cfg.sync_every // cfg.fragments
    if cfg.steps < first_sync:
        raise UserError(f"{flag}: the first sync comes after step {first_sync}, so {cfg.steps} steps would verify "
                        f"no outer step; give --steps {first_sync} or more")
    if cfg.dtype != "fp32":
        raise UserError(f"{flag} compares at fp32's tolerances: run it with --dtype fp32")
    island_size = layout.world // layout.dp_replicate
    if cfg.outer_dtype != "fp32" and island_size > 1:
        raise UserError(f"{flag} --outer-dtype {cfg.outer_dtype}: islands of {island_size} ranks encode their local "
                        f"shards in rows of their own, which the one-device reference cannot round alike; verify it "
                        f"with one-rank islands (--dp-replicate {layout.world}) or --outer-dtype fp32")


def _trained(part) -> list[tuple[str, torch.nn.Parameter]]:
    """(verify's name, parameter) of a model part's trained parameters, in the order the outer step takes them."""
    return [(hf_name(getattr(part, "module", part), clean_name(name)), p) for name, p in part.named_parameters()
            if p.requires_grad]


class ReferenceIslands:
    """The islands of a --semi-sync run, one after another on this device."""

    def __init__(self, cfg, rt, islands: int, one_device_cfg, recorder):
        """`islands`: the run's --dp-replicate; `one_device_cfg`: the run's config as verify's single-device reference
        takes it (parity.py); `recorder(trainer)`: what reads each island's steps (parity.py's Recorder)."""
        from paratrain.parallel.strategies import resolve_layout
        from paratrain.train.trainer import Trainer

        self.count = islands
        ref_cfg = one_device_cfg.model_copy(update={"semi_sync": None})
        self.trainers = [Trainer(ref_cfg, rt, quiet=True, layout=resolve_layout(ref_cfg, 1), data_shard=(k, self.count))
                         for k in range(self.count)]
        self.recorders = [recorder(t) for t in self.trainers]
        named = [[pair for part in t.step_runner.model_parts for pair in _trained(part)] for t in self.trainers]
        self.names = [name for name, _ in named[0]]
        self.params = [[p for _, p in island] for island in named]
        with torch.no_grad():
            self.global_copy = [p.detach().clone() for p in self.params[0]]
        self.outer = torch.optim.SGD(self.global_copy, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                     nesterov=cfg.outer_momentum > 0)
        self.schedule = FragmentSchedule(cfg.fragments, cfg.sync_every, cfg.fragment_delay)
        self.fragments = split_into_fragments([p.numel() for p in self.global_copy], cfg.fragments)
        self.dtype, self.inner_steps, self.pending = cfg.outer_dtype, 0, {}

    @property
    def order(self) -> list[str]:
        return self.recorders[0].order

    def step(self) -> dict:
        """One inner step of every island, then any outer step: {"loss" (the islands' mean), "islands": each
        island's step record, "global" and "global_update" (the synced fragment's) after a sync, else None}."""
        before = [full_tensors(r.parts, "param") for r in self.recorders]
        islands = [recorder.step() for recorder in self.recorders]
        self.inner_steps += 1
        started = self.schedule.started_after(self.inner_steps)
        if started is not None:
            self.pending[started] = self._mean_outer_gradient(started)
        applied = self.schedule.applied_after(self.inner_steps)
        out = {"loss": sum(r["loss"] for r in islands) / self.count, "islands": islands, "global": None,
               "global_update": None}
        if applied is not None:  # the synced fragment's global parameters, and the outer step's update of them
            members = self.fragments[applied]
            global_before = {self.names[i]: self.global_copy[i].clone() for i in members}
            self._outer_step(applied, self.pending.pop(applied))
            out["global"] = {self.names[i]: self.global_copy[i].clone() for i in members}
            out["global_update"] = {n: float((out["global"][n] - was).double().norm())
                                    for n, was in global_before.items()}
            for record, recorder in zip(islands, self.recorders):  # the island parameters the sync left
                record["params"] = full_tensors(recorder.parts, "param")
        for record, was in zip(islands, before):
            record["update"] = {n: float((p - was[n]).double().norm()) for n, p in record["params"].items()}
        return out

    @torch.no_grad()
    def _mean_outer_gradient(self, fragment: int) -> torch.Tensor:
        members = self.fragments[fragment]
        flats = [torch.cat([(self.global_copy[i] - params[i]).flatten() for i in members]).float()
                 for params in self.params]
        if self.dtype == "fp32":
            return sum(flats) / self.count
        # the encodings of the run's outer all-reduce (outer_codec.py), rounded as it rounds them
        packed = [pack_contribution(flat, self.dtype, k, True) for k, flat in enumerate(flats)]
        return mean_of_contributions(packed, self.dtype, flats[0].numel())[0]

    @torch.no_grad()
    def _outer_step(self, fragment: int, mean: torch.Tensor) -> None:
        members, offset = self.fragments[fragment], 0
        for i in members:
            g = self.global_copy[i]
            g.grad = mean[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        self.outer.step()
        for i in members:
            self.global_copy[i].grad = None
            for params in self.params:
                if self.schedule.delay:
                    params[i].lerp_(self.global_copy[i], 1 - MERGE_ALPHA)
                else:
                    params[i].copy_(self.global_copy[i])

    def close(self) -> None:
        for recorder in self.recorders:
            recorder.close()


_LAST: dict = {}  # the last reference, by config: one process group verifying a layout clean and faulted runs it once


def islands_reference(cfg, rt, layout, one_device_cfg, recorder) -> dict:
    """The reference of a --semi-sync verify: every step's record (ReferenceIslands.step)."""
    key = json.dumps([cfg.model_dump(), layout.dp_replicate], sort_keys=True, default=str)
    if key not in _LAST:
        islands = ReferenceIslands(cfg, rt, layout.dp_replicate, one_device_cfg, recorder)
        steps = [islands.step() for _ in range(cfg.steps)]
        islands.close()
        _LAST.clear()
        _LAST[key] = {"steps": steps, "order": islands.order}
    return _LAST[key]


def synced_global(trainer) -> dict | None:
    """This rank's whole global parameters after a sync at the step just taken (a collective over each island's
    shards: every rank calls it), else None."""
    outer = trainer.outer_sync
    if outer.schedule.applied_after(outer.inner_steps) is None:
        return None
    with outer.global_parameters():
        params = full_tensors(trainer.step_runner.model_parts, "param")
    trained = {name for part in trainer.step_runner.model_parts for name, _ in _trained(part)}
    return {name: t for name, t in params.items() if name in trained}


def summed_routing(islands: list[dict]) -> dict:
    """The islands' expert loads added up, as the ranks' are (routing_match.py)."""
    total: dict = {}
    for record in islands:
        for name, stats in record.get("routing", {}).items():
            if stats is None or total.get(name, 0) is None:
                total[name] = None
                continue
            have = total.setdefault(name, [[0.0] * len(stats[0]), [0.0] * len(stats[1])])
            have[0] = [a + b for a, b in zip(have[0], stats[0])]
            have[1] = [a + b for a, b in zip(have[1], stats[1])]
    return total


def compare_islands(ref: dict, records: list[dict], set_aside: dict, tol) -> tuple[dict, dict, dict]:
    """One step of every rank against its island's reference: (the reference as the report reads it, the errors
    merged over islands with global rank numbers, which checks pass)."""
    count = len(ref["islands"])
    size = len(records) // count
    merged = {"loss_abs": 0.0, "grad_norm_rel": 0.0, "grads": [], "params": [], "acts": [], "missing": []}
    ok = {"loss": True, "activations": True, "grads": True, "params": True, "global_params": True}
    for k, island in enumerate(ref["islands"]):
        mine = records[k * size:(k + 1) * size]
        local = {(rank - k * size, name): mask for (rank, name), mask in set_aside.items()
                 if k * size <= rank < (k + 1) * size}
        err = compare_step({**island, "loss": ref["loss"]}, mine, local, tol.grad_rtol)
        set_aside.update({(rank + k * size, name): mask for (rank, name), mask in local.items()})
        for key, passed in judge(err, {**island, "loss": ref["loss"]}, tol).items():
            ok[key] = ok[key] and passed
        merged["loss_abs"] = nanmax([merged["loss_abs"], err["loss_abs"]])
        merged["grad_norm_rel"] = nanmax([merged["grad_norm_rel"], err["grad_norm_rel"]])
        merged["grads"] += [(e, name, rank + k * size, s) for e, name, rank, s in err["grads"]]
        merged["params"] += [(e, name, rank + k * size, mx) for e, name, rank, mx in err["params"]]
        merged["acts"] = None if err["acts"] is None or merged["acts"] is None else merged["acts"] + err["acts"]
        merged["missing"] = sorted(set(merged["missing"]) | set(err["missing"]))
    merged["global"] = []
    if ref["global"] is not None:
        for rank, record in enumerate(records):  # the fragment that synced (the others keep their last sync's)
            got = {name: t for name, t in (record.get("global") or {}).items() if name in ref["global"]}
            errors = param_errors(ref["global"], ref["global_update"], got)
            merged["global"] += [(e, name, rank, mx) for name, (e, mx) in errors.items()]
            merged["missing"] = sorted(set(merged["missing"]) | (set(ref["global"]) - set(got)))
        ok["global_params"] = all(
            e <= tol.param_rtol + tol.param_atol / max(ref["global_update"].get(name, 0.0), 1e-30)
            for e, name, _, _ in merged["global"]) and not merged["missing"]
    view = {"loss": ref["loss"], "grad_norm": ref["islands"][0]["grad_norm"],
            "routing": summed_routing(ref["islands"])}
    return view, merged, ok
