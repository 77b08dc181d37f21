"""Parity harness: a strategy on N processes against a single-device reference, step by step, rank by rank.

Same seed, same initial weights (built once on CPU, then sharded), same global batches. After EVERY step,
EVERY rank sends rank 0 its loss, its pre-clip gradient norm, its full gradients (before clipping), its full
parameters and its activation fingerprints; rank 0 compares each with the reference (verify/compare.py)
and reports where the run first diverges. docs/verify.md has the tolerances and their measured margins.
"""

from __future__ import annotations

import gc
import json
import os

import torch.distributed as dist

from paratrain.errors import UserError
from paratrain.verify.compare import (
    FLOOR_MULTIPLE,
    Tolerance,
    compare_step,
    divergence,
    floor_multiple,
    judge,
    nanmax,
    set_aside_summary,
)
from paratrain.verify.lora_checks import LoraChecks, first_logits_match_base, lora_result
from paratrain.verify.recorder import Fingerprints, clean_name, full_tensors  # noqa: F401 (re-exported)
from paratrain.verify.routing_match import RoutingCheck, routing_of

_REFERENCES: dict[str, dict] = {}  # reference runs by config, so one process group can verify many layouts


def check_verifiable(cfg, layout) -> None:
    """Refuse, in one line, options that would not act within the verified steps or cannot match one device."""
    steps = cfg.steps
    if layout.ddp_comm_hook == "powersgd":
        start = layout.powersgd_start
        when = (f"it would not compress within {steps} steps (it starts at step {start + 1})" if start >= steps
                else f"from step {start + 1} it approximates gradients (rank-limited)")
        raise UserError(f"verify refuses --ddp-comm-hook powersgd: {when}, and an approximation cannot match one "
                        "device step for step; its convergence against DDP is tested instead")
    if layout.local_sgd_period:
        period = layout.local_sgd_period
        when = (f"it would not act within {steps} steps (local steps start after step {period})" if period >= steps
                else "after its warm-up each rank steps on its own gradients")
        raise UserError(f"verify refuses --local-sgd-period {period}: {when}, which cannot match one device step "
                        "for step; its convergence against DDP is tested instead")
    if layout.lora_dropout:
        raise UserError(f"verify refuses --lora-dropout {layout.lora_dropout:g}: dropout draws its masks from each "
                        "rank's random stream, so no run (one device's included) draws the reference's masks and the "
                        "adapters' gradients cannot match step for step; verify at --lora-dropout 0 (the same "
                        "adapters and placement) and train with the dropout")
    if layout.semi_sync:  # against islands simulated on one device (verify/semi_sync_parity.py)
        from paratrain.verify.semi_sync_parity import check_islands_verifiable

        check_islands_verifiable(cfg, layout)
    if layout.splits_stages:
        return
    if layout.dp_micro_batches:  # --dp-batch-split: --microbatches is the accumulation count
        if layout.microbatches == 1 and cfg.microbatches is not None:
            raise UserError("--microbatches 1 takes each rank's whole share as one micro-batch: no gradient "
                            "accumulation happens, so verify would not exercise it; give --microbatches 2 or more")
        return
    local = cfg.global_batch // layout.dp
    if cfg.microbatches is not None and cfg.microbatches != layout.microbatches:
        raise UserError(f"--microbatches {cfg.microbatches} does not act without a pipeline: this run takes "
                        f"{layout.microbatches} micro-batch(es) per step, so verify would not exercise gradient "
                        f"accumulation; use --micro-batch N (N < {local}, the per-rank batch)")
    if (cfg.micro_batch is not None or cfg.microbatches is not None) and layout.microbatches == 1:
        raise UserError(f"this run takes one micro-batch of {layout.micro_batch} per step (the whole per-rank batch, "
                        f"{cfg.global_batch} / dp {layout.dp}): no gradient accumulation happens, so verify would "
                        f"not exercise it; give --micro-batch below {local}")


class Recorder:
    """Reads one Trainer's state at every step: the gradients before clipping (the trainer's on_gradients
    hook), then loss, grad norm, parameters and activation fingerprints."""

    def __init__(self, trainer, tp_rank: int, fingerprints: bool):
        self.trainer, self.grads, self.tp_rank = trainer, None, tp_rank
        self.parts = trainer.step_runner.model_parts
        self.fingerprints = Fingerprints(self.parts, tp_rank) if fingerprints else None
        self.handle = trainer.hooks.on_gradients(self._read_grads)

    def _read_grads(self, trainer) -> None:
        scaler = trainer.scaler  # fp16: the grads are still multiplied by the loss scale here
        self.grads = full_tensors(self.parts, "grad", float(scaler.get_scale()) if scaler else 1.0)

    def step(self) -> dict:
        micro = self.trainer.source.next_step()
        out = self.trainer.train_step(micro)
        calls = self.trainer.step_runner.microbatches or len(micro)
        acts = self.fingerprints.take(calls) if self.fingerprints else None
        return {"loss": out["loss"], "grad_norm": out["grad_norm"], "grads": self.grads,
                "params": full_tensors(self.parts, "param"), "acts": acts,
                "routing": routing_of(self.parts) if self.tp_rank == 0 else {}}

    @property
    def order(self) -> list[str]:
        return self.fingerprints.order if self.fingerprints else []

    def close(self) -> None:
        self.handle.remove()
        if self.fingerprints:
            self.fingerprints.remove()


def reference_config(cfg, dtype: str):
    from paratrain.parallel.layout import DEGREE_NAMES

    return cfg.model_copy(update={"strategy": "single", "micro_batch": None, "microbatches": None,
                                  **dict.fromkeys(DEGREE_NAMES), "sp": False, "ac": "none",
                                  "compile": False, "cpu_offload": False, "ddp_comm_hook": "none",
                                  "local_sgd_period": 0, "virtual_stages": 1, "dtype": dtype,
                                  "dp_batch_split": None, "pp_layers": None})


def reference_run(cfg, rt, dtype: str, fingerprints: bool, repeat: int = 0) -> dict:
    """The single-device run on this rank (rank 0): every step's record plus the step's own parameter update.
    repeat > 0: that many-th run of the same reference again (not the cached one), for the run-to-run floor."""
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.train.trainer import Trainer

    ref_cfg = reference_config(cfg, dtype)
    key = json.dumps([ref_cfg.model_dump(), fingerprints, repeat], sort_keys=True, default=str)
    if key in _REFERENCES:
        return _REFERENCES[key]
    trainer = Trainer(ref_cfg, rt, quiet=True, layout=resolve_layout(ref_cfg, 1))
    recorder = Recorder(trainer, 0, fingerprints)
    before = full_tensors(recorder.parts, "param")
    steps = []
    for _ in range(cfg.steps):
        rec = recorder.step()
        rec["update"] = {n: float((p - before[n]).double().norm()) for n, p in rec["params"].items()}
        before = rec["params"]
        steps.append(rec)
    recorder.close()
    run = {"steps": steps, "order": recorder.order}
    if len(_REFERENCES) >= 4:
        _REFERENCES.pop(next(iter(_REFERENCES)))
    _REFERENCES[key] = run
    return run


def run_to_run_varies(device) -> bool:
    """Whether the same single-device run can land elsewhere when run again: on a GPU some kernels add with
    atomics in whatever order threads finish (fp32 attention's backward through SDPA's memory-efficient kernel;
    measured on an H100: 4e-4 relative in attention gradients by step 3). The CPU kernels repeat exactly."""
    return device.type != "cpu"


def noise_floor(same: dict, exact: dict) -> dict:
    """How far the single-device run in the low precision lands from the fp32 one, per metric (max over steps)."""
    floor = {"loss": 0.0, "grad_norm": 0.0, "grad": 0.0, "param": 0.0, "act": 0.0}
    for low, ref in zip(same["steps"], exact["steps"]):
        err = compare_step(ref, [low])
        floor["loss"] = nanmax([floor["loss"], err["loss_abs"] / max(abs(ref["loss"]), 1e-30)])
        floor["grad_norm"] = nanmax([floor["grad_norm"], err["grad_norm_rel"]])
        floor["grad"] = nanmax([e[0] for e in err["grads"]], floor["grad"])
        floor["param"] = nanmax([e[0] for e in err["params"]], floor["param"])
        floor["act"] = nanmax([e for e, _ in err["acts"] or []], floor["act"])
    return floor


def verify_in_group(cfg, rt, tol: Tolerance | None = None) -> dict | None:
    """One verify run inside an already joined process group; rank 0 returns the report, others None.

    Tests call it several times in one group (one launch for many strategies)."""
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.train.trainer import Trainer

    layout = resolve_layout(cfg, rt.world_size)
    check_verifiable(cfg, layout)
    reference, floor = None, None
    fingerprints = not cfg.compile  # hooks inside compiled regions are not safe
    if rt.is_main and layout.semi_sync:  # fp32 only (check_islands_verifiable)
        from paratrain.verify.semi_sync_parity import islands_reference

        reference = islands_reference(cfg, rt, layout, reference_config(cfg, "fp32"),
                                      lambda t: Recorder(t, 0, fingerprints))
    elif rt.is_main:
        exact = reference_run(cfg, rt, "fp32", fingerprints)
        reference = exact
        if cfg.dtype != "fp32":
            reference = reference_run(cfg, rt, cfg.dtype, fingerprints)
            floor = noise_floor(reference, exact)
            tol = tol or Tolerance.from_floor(floor, floor_multiple(layout))
        elif run_to_run_varies(rt.device):
            floor = noise_floor(reference_run(cfg, rt, "fp32", fingerprints, repeat=1), exact)
            tol = tol or Tolerance.from_floor(floor, FLOOR_MULTIPLE, basis="run-to-run noise floor")
    if rt.is_main:
        tol = tol or Tolerance.for_dtype(cfg.dtype)
    trainer = Trainer(cfg, rt, quiet=True)
    tp_rank = trainer.layout.coords(rt.rank)["tp"] if trainer.distributed else 0
    recorder = Recorder(trainer, tp_rank, fingerprints)
    lora = LoraChecks(trainer) if trainer.lora is not None else None
    report = Report(cfg, trainer.layout, tol, reference, floor) if rt.is_main else None
    if report is not None:
        report.model_parts = len(trainer.step_runner.model_parts)
    for step in range(1, cfg.steps + 1):
        record = recorder.step()
        if trainer.outer_sync is not None:  # --semi-sync: the global copy too, after a sync
            from paratrain.verify.semi_sync_parity import synced_global

            record["global"] = synced_global(trainer)
        everyone = [record]
        if trainer.distributed:
            everyone = [None] * dist.get_world_size() if rt.is_main else None
            dist.gather_object(record, everyone, dst=0)
        if report is not None:
            report.add(step, everyone)
    recorder.close()
    extra = trainer.verify_extras()
    if lora is not None:  # the frozen base, its gradients and optimizer state on every rank (verify/lora_checks.py)
        records = [lora.finish()]
        if trainer.distributed:
            mine, records = records[0], [None] * dist.get_world_size() if rt.is_main else None
            dist.gather_object(mine, records, dst=0)
        if report is not None:
            extra["lora"] = lora_result(records, first_logits_match_base(trainer))
            report.checks["lora"] = extra["lora"]["passed"]
    if report is None:
        return None
    return report.result(extra)


class Report:
    """Rank 0's running comparison, step by step, and the final JSON document."""

    def __init__(self, cfg, layout, tol: Tolerance, reference: dict, floor: dict | None):
        self.cfg, self.layout, self.tol, self.ref, self.floor = cfg, layout, tol, reference, floor
        self.per_step, self.first = [], None
        self.checks = {"loss": True, "activations": True, "grads": True, "params": True}
        self.max = {"loss_abs": 0.0, "loss_rel": 0.0, "grad_norm_rel": 0.0, "grad_rel": 0.0, "param_rel": 0.0,
                    "param_abs": 0.0, "act_rel": 0.0}
        if layout.semi_sync:  # the global copy after each sync (verify/semi_sync_parity.py)
            self.checks["global_params"], self.max["global_param_rel"] = True, 0.0
        self.missing: list[str] = []
        self.acts_compared = True
        self.same_loss = True  # every rank reported exactly the same global loss
        self.model_parts = 1
        self.routing = RoutingCheck()
        self.set_aside: dict = {}  # (rank, name) -> the elements whose gradient was rounding (compare.py)

    def compare(self, step: int, records: list[dict]) -> tuple[dict, dict, dict]:
        """(the step's reference, the errors of every rank's record, which checks pass)."""
        ref = self.ref["steps"][step - 1]
        if self.layout.semi_sync:  # each rank against its island's reference, and the global copies
            from paratrain.verify.semi_sync_parity import compare_islands

            ref, err, ok = compare_islands(ref, records, self.set_aside, self.tol)
            self.max["global_param_rel"] = nanmax([self.max["global_param_rel"], nanmax([e[0] for e in err["global"]])])
            return ref, err, ok
        err = compare_step(ref, records, self.set_aside, self.tol.grad_rtol)
        return ref, err, judge(err, ref, self.tol)

    def add(self, step: int, records: list[dict]) -> None:
        ref, err, ok = self.compare(step, records)
        routed_alike = self.routing.add(step, ref.get("routing", {}), [r.get("routing", {}) for r in records])
        worst_act = nanmax([e for e, _ in err["acts"]]) if err["acts"] is not None else None
        self.acts_compared = self.acts_compared and err["acts"] is not None
        row = {"loss_abs": err["loss_abs"], "loss_rel": err["loss_abs"] / max(abs(ref["loss"]), 1e-30),
               "grad_norm_rel": err["grad_norm_rel"], "grad_rel": nanmax([e[0] for e in err["grads"]]),
               "param_rel": nanmax([e[0] for e in err["params"]]), "param_abs": nanmax([e[3] for e in err["params"]]),
               "act_rel": worst_act or 0.0}
        for key, value in row.items():
            self.max[key] = nanmax([self.max[key], value])
        for key, passed in ok.items():
            self.checks[key] = self.checks[key] and passed
        self.missing = sorted(set(self.missing) | set(err["missing"]))
        self.same_loss = self.same_loss and len({rec["loss"] for rec in records}) == 1
        if self.first is None and not all(ok.values()):
            self.first = divergence(step, err, ok, self.tol, self.ref["order"])
        self.per_step.append({"step": step, "loss_ref": ref["loss"], "loss": records[0]["loss"],
                              "grad_norm_ref": ref["grad_norm"], "grad_norm": records[0]["grad_norm"],
                              "grad_rel_diff": row["grad_rel"], "param_rel_diff": row["param_rel"],
                              "act_rel_diff": worst_act, "passed": all(ok.values()) and routed_alike})
        if self.layout.semi_sync:  # the steps that synced, and their global copies' error
            self.per_step[-1].update(synced=bool(err["global"]), global_param_rel_diff=nanmax(
                [e[0] for e in err["global"]]) if err["global"] else None)

    def margins(self) -> dict:
        """Tolerance / largest error seen, per check (how far inside its bound the run stayed)."""
        t, m = self.tol, self.max
        pairs = {"loss": (t.loss_rtol, m["loss_rel"]), "grad_norm": (t.grad_norm_rtol, m["grad_norm_rel"]),
                 "grads": (t.grad_rtol, m["grad_rel"]), "params": (t.param_rtol, m["param_rel"]),
                 "activations": (t.act_rtol, m["act_rel"])}
        if self.layout.semi_sync:
            pairs["global_params"] = (t.param_rtol, m["global_param_rel"])
        return {k: (bound / err if err > 0 else None) if err == err else float("nan") for k, (bound, err) in pairs.items()}

    def _first_with_routing(self) -> dict | None:
        """first_divergence, naming the first router mismatch too (alone when only the routing differs)."""
        routed = self.routing.first
        if routed is None:
            return self.first
        first = self.first or {"step": routed["step"], "differs": "routing", "parameters": []}
        return {**first, "routing": routed}

    def result(self, extra: dict) -> dict:
        layout, m = self.layout, self.max
        return {"strategy": self.cfg.strategy, "dims": layout.degrees(), "world_size": layout.world,
                "steps": self.cfg.steps, "dtype": self.cfg.dtype, "model": self.cfg.model,
                "dp_batch_split": self.cfg.dp_batch_split, "pp_layers": self.cfg.pp_layers,
                "tolerance": self.tol.to_dict(), "noise_floor": self.floor,
                "floor_multiple": floor_multiple(layout) if self.floor is not None else None,
                "max_loss_abs_diff": m["loss_abs"], "max_loss_rel_diff": m["loss_rel"],
                "max_grad_norm_rel_diff": m["grad_norm_rel"], "max_grad_rel_diff": m["grad_rel"],
                "max_param_rel_diff": m["param_rel"], "max_param_abs_diff": m["param_abs"],
                "param_elements_set_aside": set_aside_summary(self.set_aside),
                "max_act_rel_diff": m["act_rel"] if self.acts_compared else None, "margins": self.margins(),
                "passed": all(self.checks.values()) and not self.missing and self.routing.ok is not False,
                "checks": self.checks, **self.routing.result(),
                "first_divergence": self._first_with_routing(), "missing": self.missing,
                "compared": {"ranks": layout.world, "every_step": True, "grads": "before clipping",
                             "activations": self.acts_compared, "model_parts": self.model_parts},
                "same_loss_on_every_rank": self.same_loss,
                "per_step": self.per_step, **self._islands(), **extra}

    def _islands(self) -> dict:
        """--semi-sync: what was simulated, and the largest error of the global copies after a sync."""
        if not self.layout.semi_sync:
            return {}
        cfg = self.cfg
        return {"semi_sync": {"method": cfg.semi_sync, "islands": self.layout.dp_replicate, "sync_every": cfg.sync_every,
                              "fragments": cfg.fragments, "fragment_delay": cfg.fragment_delay,
                              "outer_dtype": cfg.outer_dtype, "outer_lr": cfg.outer_lr,
                              "outer_momentum": cfg.outer_momentum,
                              "syncs": sum(1 for row in self.per_step if row["synced"]),
                              "max_global_param_rel_diff": self.max["global_param_rel"]}}


def describe_divergence(first: dict | None) -> str | None:
    """One line for a person: the step, what differs, and where."""
    if not first:
        return None
    what = {"loss": "the loss differs", "activations": "activations differ (loss within tolerance)",
            "grads": "only the gradients differ (the loss matches)",
            "params": "only the parameters differ (loss and gradients match): an optimizer-side bug",
            "global_params": "the global parameters differ after a sync (the islands' inner steps match): an "
                             "outer-step bug",
            "routing": "only the router's decisions differ (loss, gradients and parameters within tolerance)"
            }[first["differs"]]
    where = f"; first diverging module: {first['module']}" if first.get("module") else ""
    top = first["parameters"][0] if first["parameters"] else None
    param = ""
    if top:
        param = f"; largest error: {top['name']} on rank {top['rank']} (relative error {top['rel_error']:.3g}"
        if top.get("grad_scale") is not None and top["grad_scale"] == top["grad_scale"]:
            param += f", gradient {top['grad_scale']:.3g}x the reference"
        param += ")"
    if first.get("ranks"):
        param += f"; diverging on rank(s) {', '.join(str(r) for r in first['ranks'])}"
    missing = f"; missing: {', '.join(first['missing'][:3])}" if first.get("missing") else ""
    if first.get("routing"):
        missing += (f"; tokens first reach other experts at step {first['routing']['step']} in "
                    f"{first['routing']['layer']}")
    return f"first divergence at step {first['step']}: {what}{where}{param}{missing}"


def verify_worker(cfg_dict: dict, tol_dict: dict | None = None) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    # true fp32 on CUDA (no TF32): TF32's ~1e-3 rounding would swamp the fp32 tolerances
    cfg = TrainConfig(**{**cfg_dict, "resume": "never", "ckpt_every": 0, "metrics": False, "tf32": False})
    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime(cfg.device, cfg.timeout_s)
    tol = Tolerance(**tol_dict) if tol_dict else None
    try:
        result = verify_in_group(cfg, rt, tol)
    except UserError:  # raised on: the launcher makes it the run's one last line (exit 2)
        shutdown()
        raise
    gc.collect()  # free the trainers (DDP reducers) while the groups are registered: see train/worker.py
    shutdown()
    return result
