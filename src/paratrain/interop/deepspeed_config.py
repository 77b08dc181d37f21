"""--deepspeed FILE.json: a DeepSpeed config mapped onto paratrain's run options (docs/training-options.md).

What DeepSpeed's engine decides takes DeepSpeed's default where the file leaves it out (no clipping, fp32, ZeRO
stage 0, no offload); what a DeepSpeed user's own code hands the engine (the optimizer, the scheduler) stays the
run's own where the file has none, as paratrain is that code. "auto" (as transformers writes it) is the run's own
value, except in the batch sizes, where it is the flag's or refused. Precedence: defaults < --config TOML < the
DeepSpeed file < flags given on the command line (each flag that overrides the file is named in one warning).
The data-parallel check of the batch sizes runs once the layout is known (check_deepspeed_batch).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.errors import UserError
from paratrain.interop import deepspeed_keys as keys
from paratrain.interop.commented_json import load_commented_json

log = logging.getLogger("paratrain")

AUTO = "auto"
STAGE_STRATEGY = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
COMM_HOOKS = {"fp16": "fp16", "bf16": "bf16", "fp32": "none"}
SCHEDULES = {"WarmupLR": "warmup-log", "WarmupDecayLR": "warmup-decay", "WarmupCosineLR": "cosine",
             "OneCycle": "one-cycle"}
KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
_MISSING = object()


def read_deepspeed(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"cannot read DeepSpeed config {path}: {getattr(exc, 'strerror', None) or exc}") from None
    doc = load_commented_json(text, f"DeepSpeed config {path}")
    if not isinstance(doc, dict):
        raise UserError(f"DeepSpeed config {path} must hold a JSON object, not {type(doc).__name__}")
    return doc


@dataclass
class DeepSpeedRun:
    fields: dict = field(default_factory=dict)  # run-config field -> value
    sources: dict = field(default_factory=dict)  # run-config field -> the DeepSpeed key it came from
    no_equivalent: list[str] = field(default_factory=list)  # keys named in the one warning
    notes: list[str] = field(default_factory=list)  # how a mapped key differs, one warning each


class _Mapper:
    """Reads one DeepSpeed document section by section into a DeepSpeedRun; every refusal names the file."""

    def __init__(self, path: str, given: dict, dtype: str):
        self.path, self.given, self.dtype, self.run = path, given, dtype, DeepSpeedRun()

    def fail(self, message: str) -> UserError:
        return UserError(f"DeepSpeed config {self.path}: {message}")

    def set(self, name: str, value, source: str) -> None:
        if value is not AUTO:
            self.run.fields[name], self.run.sources[name] = value, source

    def section(self, parent: dict, key: str, mapped: set, unmapped: set, where: str = "") -> dict:
        """parent[key] as a dict ({} when absent), its keys checked: known, or refused as unknown."""
        value = parent.get(key, {})
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(f"{where}{key} must be an object")
        self.check_keys(value, mapped, unmapped, f"{where}{key}.")
        return value

    def check_keys(self, section: dict, mapped: set, unmapped: set, where: str) -> None:
        for key, value in section.items():
            if key in mapped:
                continue
            if key not in unmapped:
                raise self.fail(f"unknown key {where + key!r} (not a DeepSpeed option paratrain knows; a typo?)")
            disabled = value is False or value is None or (isinstance(value, dict) and value.get("enabled") is False)
            if not disabled:  # a feature switched off loses nothing
                self.run.no_equivalent.append(f"{where}{key}")

    def value(self, section: dict, key: str, where: str, kind: str, default=_MISSING, low=None, high=None):
        """section[key] checked as `kind` (int, float, bool, str); AUTO passes through; default when absent."""
        if key not in section:
            if default is _MISSING:
                raise self.fail(f"{where}{key} is required")
            return default
        value = section[key]
        if value == AUTO:
            return AUTO
        types = {"int": int, "float": int | float, "bool": bool, "str": str}[kind]
        if not isinstance(value, types) or (kind != "bool" and isinstance(value, bool)):
            raise self.fail(f"{where}{key} must be {KIND_WORDS[kind]} or \"auto\", got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"{low}..{high}"
            raise self.fail(f"{where}{key} must be {bounds}, got {value!r}")
        return value

    # -- the sections --------------------------------------------------------------------------------------------
    def top_level(self, doc: dict) -> None:
        self.check_keys(doc, keys.MAPPED, keys.NO_EQUIVALENT, "")

    def layout(self, doc: dict) -> None:
        if isinstance(doc.get("zero_optimization"), bool):  # DeepSpeed's oldest form: true is stage 1
            doc = {**doc, "zero_optimization": {"stage": int(doc["zero_optimization"])}}
        zero = self.section(doc, "zero_optimization", keys.ZERO_MAPPED, keys.ZERO_NO_EQUIVALENT)
        stage = self.value(zero, "stage", "zero_optimization.", "int", 0, 0, 3)
        self.set("strategy", stage if stage is AUTO else STAGE_STRATEGY[stage], "zero_optimization.stage")
        offloaded = []
        for key in ("offload_param", "offload_optimizer"):
            where = "zero_optimization."
            sub = self.section(zero, key, keys.OFFLOAD_MAPPED, keys.OFFLOAD_NO_EQUIVALENT, where)
            device = self.value(sub, "device", f"{where}{key}.", "str", "none")
            if device not in ("none", "cpu", "nvme", AUTO):
                raise self.fail(f"{where}{key}.device must be none, cpu or nvme, got {device!r}")
            if device == "nvme":
                self.run.no_equivalent.append(f"{where}{key}.device nvme (not offloaded)")
            if device == "cpu" or zero.get({"offload_param": "cpu_offload_param",
                                            "offload_optimizer": "cpu_offload"}[key]) is True:
                offloaded.append(key)
        self.set("cpu_offload", bool(offloaded), " and ".join(f"zero_optimization.{k}" for k in offloaded)
                 or "zero_optimization (no offload)")
        if offloaded and stage in (0, 1):
            raise self.fail(f"zero_optimization.{offloaded[0]} at stage {stage}: paratrain offloads through FSDP2 "
                            f"(--cpu-offload), which needs stage 2 or 3")
        if len(offloaded) == 1:
            self.run.notes.append(f"zero_optimization.{offloaded[0]} alone: FSDP2 offloads parameters, gradients "
                                  f"and optimizer state together, so --cpu-offload offloads all three")
        tp = self.section(doc, "tensor_parallel", keys.TENSOR_PARALLEL_MAPPED, keys.TENSOR_PARALLEL_NO_EQUIVALENT)
        autotp = self.value(tp, "autotp_size", "tensor_parallel.", "int", 0, 0)
        if autotp is not AUTO and autotp > 1:
            self.set("tp", autotp, "tensor_parallel.autotp_size")
        comm = self.value(doc, "communication_data_type", "", "str", None)
        if comm not in (None, AUTO):
            if comm not in COMM_HOOKS:
                raise self.fail(f"communication_data_type must be fp16, bf16 or fp32, got {comm!r}")
            if stage in (0, 1):
                self.set("ddp_comm_hook", COMM_HOOKS[comm], "communication_data_type")
            else:
                self.run.no_equivalent.append(f"communication_data_type {comm} (ZeRO-{stage}: FSDP reduces in the "
                                              f"gradients' dtype)")

    def batch(self, doc: dict) -> None:
        triple = [self.value(doc, k, "", "int", None, 1) for k in keys.BATCH_TRIPLE]
        total, micro, accumulation = triple
        if isinstance(total, int):
            self.set("global_batch", total, "train_batch_size")
        elif "global_batch" not in self.given:
            said = '"auto"' if total is AUTO else "not set"
            raise self.fail(f"train_batch_size is {said}: give --global-batch N (sequences per optimizer step, all "
                            f"ranks); the micro batch and accumulation steps are checked against it")
        if isinstance(micro, int):
            self.set("micro_batch", micro, "train_micro_batch_size_per_gpu")
        elif isinstance(accumulation, int) and accumulation > 1 and "micro_batch" not in self.given:
            said = '"auto"' if micro is AUTO else "not set"
            raise self.fail(f"gradient_accumulation_steps is {accumulation} but train_micro_batch_size_per_gpu is "
                            f"{said}: give --micro-batch N")

    def precision(self, doc: dict) -> None:
        fp16 = self.section(doc, "fp16", keys.FP16_MAPPED, keys.FP16_NO_EQUIVALENT)
        name = "bf16" if "bf16" in doc or "bfloat16" not in doc else "bfloat16"
        bf16 = self.section(doc, name, keys.BF16_MAPPED, keys.BF16_NO_EQUIVALENT)
        on16 = self.value(fp16, "enabled", "fp16.", "bool", False)
        onbf = self.value(bf16, "enabled", f"{name}.", "bool", False)
        if on16 is True and onbf is True:
            raise self.fail("fp16 and bf16 are both enabled; enable one")
        if on16 is True or (on16 is AUTO and self.dtype == "fp16"):
            self.set("dtype", "fp16", "fp16.enabled")
            self.loss_scale(fp16)
        elif onbf is True:
            self.set("dtype", "bf16", f"{name}.enabled")
        elif on16 is False and onbf is False:
            self.set("dtype", "fp32", "fp16 and bf16 (neither enabled)")
        clip = self.value(doc, "gradient_clipping", "", "float", 0.0, 0)
        self.set("grad_clip", float(clip) if clip is not AUTO else clip, "gradient_clipping")

    def loss_scale(self, fp16: dict) -> None:
        static = self.value(fp16, "loss_scale", "fp16.", "float", 0, 0)
        power = self.value(fp16, "initial_scale_power", "fp16.", "int", 16, 0, 64)
        window = self.value(fp16, "loss_scale_window", "fp16.", "int", 1000, 1)
        if static not in (0, AUTO):
            self.set("loss_scale_init", float(static), "fp16.loss_scale")
            self.run.notes.append(f"fp16.loss_scale {static} is a static scale in DeepSpeed; paratrain's loss "
                                  f"scale is dynamic and starts there")
        elif power is not AUTO:
            self.set("loss_scale_init", float(2 ** power), "fp16.initial_scale_power")
        self.set("loss_scale_window", window, "fp16.loss_scale_window")
        hysteresis = self.value(fp16, "hysteresis", "fp16.", "int", 2, 1)
        if hysteresis != 1:  # DeepSpeed's default 2 waits for a second overflow; GradScaler backs off at the first
            self.run.no_equivalent.append(f"fp16.hysteresis {hysteresis}")

    def optimizer(self, doc: dict) -> None:
        section = self.section(doc, "optimizer", {"type", "params"}, {"legacy_fusion"})
        if not section:
            return
        kind = self.value(section, "type", "optimizer.", "str").lower()
        params = section.get("params", {})
        if not isinstance(params, dict):
            raise self.fail("optimizer.params must be an object")
        where = "optimizer.params."
        if kind == "sgd":
            self.check_keys(params, keys.SGD_PARAMS_MAPPED, keys.SGD_PARAMS_NO_EQUIVALENT, where)
            self.set("optimizer", "sgd", "optimizer.type")
            self.set("momentum", self.value(params, "momentum", where, "float", 0.0, 0), f"{where}momentum")
            for name in ("betas", "eps"):  # the run's Adam(W) settings do not apply to SGD
                self.set(name, {"betas": "0.9,0.95", "eps": 1e-8}[name], "optimizer.type SGD")
        elif kind in ("adam", "adamw") or kind in keys.ONE_BIT_ADAMS:
            self.check_keys(params, keys.ADAM_PARAMS_MAPPED, keys.ADAM_PARAMS_NO_EQUIVALENT, where)
            decoupled = kind != "adam" or self.value(params, "adam_w_mode", where, "bool", True) is not False
            self.set("optimizer", "adamw" if decoupled else "adam", "optimizer.type")
            if kind in keys.ONE_BIT_ADAMS:
                self.run.no_equivalent.append(f"optimizer.type {section['type']} (its 1-bit compression; runs as "
                                              f"AdamW)")
            betas = params.get("betas", [0.9, 0.999])  # DeepSpeed's FusedAdam's default
            if betas != AUTO:
                if not (isinstance(betas, list) and len(betas) == 2):
                    raise self.fail(f"{where}betas must be a list of two numbers, got {betas!r}")
                self.set("betas", betas, f"{where}betas")
            self.set("eps", self.value(params, "eps", where, "float", 1e-8, 0), f"{where}eps")
            self.set("momentum", 0.0, "optimizer.type")
        else:
            raise self.fail(f"optimizer {section['type']!r} has no paratrain equivalent (Adam, AdamW, SGD)")
        self.set("lr", self.value(params, "lr", where, "float", 1e-3), f"{where}lr")
        self.set("weight_decay", self.value(params, "weight_decay", where, "float", 0.0, 0), f"{where}weight_decay")

    def scheduler(self, doc: dict) -> None:
        section = self.section(doc, "scheduler", {"type", "params"}, set())
        if not section:
            return
        kind = self.value(section, "type", "scheduler.", "str")
        if kind not in SCHEDULES:
            raise self.fail(f"scheduler {kind!r} has no paratrain equivalent (WarmupLR, WarmupDecayLR, "
                            f"WarmupCosineLR, OneCycle)")
        params = self.section(section, "params", keys.SCHEDULER_PARAMS[kind],
                              keys.ONE_CYCLE_NO_EQUIVALENT | {"last_batch_iteration"}, "scheduler.")
        where = "scheduler.params."
        self.set("lr_schedule", SCHEDULES[kind], "scheduler.type")
        if self.value(params, "last_batch_iteration", where, "int", -1) not in (-1, AUTO):
            self.run.no_equivalent.append(f"{where}last_batch_iteration (paratrain resumes from its checkpoints)")
        if kind == "OneCycle":
            self.one_cycle(params, where, doc)
            return
        warmup_type = self.value(params, "warmup_type", where, "str", "log")
        if warmup_type not in ("log", "linear", AUTO):
            raise self.fail(f"{where}warmup_type must be log or linear, got {warmup_type!r}")
        self.set("warmup_type", warmup_type, f"{where}warmup_type")
        self.set("warmup_steps", self.value(params, "warmup_num_steps", where, "int", 1000, 0),
                 f"{where}warmup_num_steps")
        if kind != "WarmupLR":  # DeepSpeed takes total_num_steps as the run's length
            self.set("steps", self.value(params, "total_num_steps", where, "int", low=1), f"{where}total_num_steps")
        if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
            self.set("min_lr", None, "scheduler.type WarmupCosineLR")
            self.set("min_lr_ratio", self.value(params, "cos_min_ratio", where, "float", 0.0001, 0, 1),
                     f"{where}cos_min_ratio")
            self.set("warmup_start_ratio", self.value(params, "warmup_min_ratio", where, "float", 0.0, 0, 1),
                     f"{where}warmup_min_ratio")
            return
        self.set("min_lr", self.value(params, "warmup_min_lr", where, "float", 0.0, 0), f"{where}warmup_min_lr")
        self.set("lr", self.value(params, "warmup_max_lr", where, "float", 0.001), f"{where}warmup_max_lr")

    def one_cycle(self, params: dict, where: str, doc: dict) -> None:
        self.set("min_lr", self.value(params, "cycle_min_lr", where, "float", low=0), f"{where}cycle_min_lr")
        self.set("lr", self.value(params, "cycle_max_lr", where, "float"), f"{where}cycle_max_lr")
        self.set("warmup_steps", self.value(params, "cycle_first_step_size", where, "int", 2000, 1),
                 f"{where}cycle_first_step_size")
        self.set("cooldown_steps", self.value(params, "cycle_second_step_size", where, "int", None, 0),
                 f"{where}cycle_second_step_size")
        self.set("decay_lr_rate", float(self.value(params, "decay_lr_rate", where, "float", 0.0, 0)),
                 f"{where}decay_lr_rate")
        self.set("decay_step_size", self.value(params, "decay_step_size", where, "int", 0, 0),
                 f"{where}decay_step_size")
        sgd = str(doc.get("optimizer", {}).get("type", "")).lower() == "sgd"
        if params.get("cycle_momentum", True) is True and not sgd and f"{where}cycle_momentum" not in \
                self.run.no_equivalent:  # on by default: DeepSpeed cycles Adam's beta1 (and sets beta2 0.99)
            self.run.no_equivalent.append(f"{where}cycle_momentum (on by default; beta1 stays --betas')")


def map_deepspeed(path: str, given: dict, dtype: str = "fp32") -> DeepSpeedRun:
    """The run options a DeepSpeed config file sets; `given`: the flags given on the command line (the batch
    sizes' "auto"), `dtype`: the run's own (fp16's "enabled": "auto" takes the loss scale settings under fp16)."""
    mapper = _Mapper(path, given, dtype)
    doc = read_deepspeed(path)
    mapper.top_level(doc)
    mapper.layout(doc)
    mapper.batch(doc)
    mapper.precision(doc)
    mapper.optimizer(doc)
    mapper.scheduler(doc)  # after the optimizer: DeepSpeed's scheduler sets the lr the optimizer was built with
    return mapper.run


def with_deepspeed(path: str, file_values: dict, given: dict) -> dict:
    """The run's config values: the --config file's, then the DeepSpeed file's, then the flags `given`. Warns
    (once, on rank 0) of the keys with no equivalent, how mapped ones differ, and the flags that override it."""
    run = map_deepspeed(path, given, {**file_values, **given}.get("dtype", "fp32"))
    overridden = [f"--{k.replace('_', '-')} {given[k]} over {run.sources[k]}" for k in run.fields
                  if k in given and given[k] != run.fields[k]]
    if os.environ.get("RANK", "0") == "0":
        if run.no_equivalent:
            log.warning("%s: no paratrain equivalent, not applied: %s", path, ", ".join(run.no_equivalent))
        for note in run.notes:
            log.warning("%s: %s", path, note)
        if overridden:
            log.warning("%s: flags given beside it win: %s", path, "; ".join(overridden))
    return {**file_values, **run.fields, **given}


def check_deepspeed_batch(path: str, global_batch: int, micro_batch: int | None, dp: int) -> None:
    """The file's batch sizes against the run's data-parallel size, as DeepSpeed checks them: train_batch_size =
    train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks (the run's values where the
    file says "auto" or a flag overrode it)."""
    doc = read_deepspeed(path)
    accumulation = doc.get("gradient_accumulation_steps")
    if not isinstance(accumulation, int) or isinstance(accumulation, bool):
        return  # "auto" or absent: paratrain derives it from the global and micro batch
    micro = micro_batch or global_batch // dp
    if micro * accumulation * dp != global_batch:
        raise UserError(f"DeepSpeed config {path}: the batch sizes do not add up on {dp} data-parallel rank(s): "
                        f"train_batch_size {global_batch} must be train_micro_batch_size_per_gpu {micro} x "
                        f"gradient_accumulation_steps {accumulation} x {dp}")
