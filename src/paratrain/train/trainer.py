"""The training loop, visible in one place: build -> parallelize -> for each step: data, fwd/bwd, clip, step."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.gpu_catalog import catalog_name_for, device_peak_tflops
from paratrain.models.hf_files import is_hf_model
from paratrain.models.hf_model import build_hf_model
from paratrain.models.hf_pipeline import pipeline_view
from paratrain.models.hf_tp_plan import hf_tp_plan
from paratrain.models.lora import attach_lora, lora_spec_for
from paratrain.models.lora_tp import with_adapter_styles
from paratrain.models.plans import tp_plan_for
from paratrain.models.presets import build_model, flops_per_token, model_args_for
from paratrain.models.speed import model_speed_for
from paratrain.parallel.collective_hooks import collective, set_step
from paratrain.parallel.compile import compile_loss, fuse_gemm_epilogues
from paratrain.parallel.layout import Layout
from paratrain.parallel.loss_weighting import LossWeighting
from paratrain.parallel.parallelize import parallelize
from paratrain.parallel.semi_sync.outer_sync import build_outer_sync
from paratrain.parallel.strategies import resolve_layout
from paratrain.parallel.uneven_split import dp_shares
from paratrain.train.data.source import make_train_data
from paratrain.train.evaluate import build_validator, evaluate, perplexity
from paratrain.train.fit_summary import FitRun, fit_summary, log_run_start
from paratrain.train.hf_run_checks import check_hf_run
from paratrain.train.hooks import Hooks, default_hooks
from paratrain.train.host_memory import ResidentBaseline
from paratrain.train.loss_choice import FusedLoss
from paratrain.train.lr_schedules import lr_at_step
from paratrain.train.memory_snapshot import MemorySnapshot, cuda_memory_summary, out_of_memory_error
from paratrain.train.metrics import StepLog, current_rss_gib, peak_memory_gib
from paratrain.train.optim import build_run_optimizer, loss_scaler, run_optimizer_spec, set_lr
from paratrain.train.optimizer_graph import OptimizerGraph
from paratrain.train.param_copies import ParamCopies, wants_bf16_copies
from paratrain.train.precision import enable_tf32, peak_dtype
from paratrain.train.recovery import checkpoint as ckpt
from paratrain.train.recovery.run_failures import RunFailed
from paratrain.train.runtime import Runtime
from paratrain.train.step import PlainStep, clip_grad_norm, head_loss, lm_loss
from paratrain.train.step_record import LaunchedStep, PendingSteps, StepTiming
from paratrain.train.step_runner import StepRunner

log = logging.getLogger("paratrain")


class Trainer:
    def __init__(self, cfg: TrainConfig, runtime: Runtime, run_dir: Path | None = None, quiet: bool = False,
                 layout: Layout | None = None, custom=None, hooks: Hooks | None = None,
                 predicted_peak_gib: float | None = None, data_shard: tuple[int, int] | None = None):
        """`layout`: the run's Layout (default: resolved from cfg for this world), e.g. a single-device
        reference inside a multi-rank job (verify). `custom`: a user's own model (train/custom.py), not a preset.
        `hooks`: a registry of extension points (train/hooks.py, docs/hooks.md); default: this process's, with
        what PARATRAIN_PLUGINS loads. The trainer holds a child of it, `self.hooks`: attach to that to reach
        this trainer alone. `predicted_peak_gib`: the planner's peak per device (train's memory check), logged
        against the measured one at step 2. `data_shard`: (index, count), read that slice of each global batch
        instead of this layout's data-parallel rank's (a replica of --heal-replicas, train/recovery/replica_heal.py)."""
        from paratrain.parallel.checks import check_layout

        self.predicted_peak_gib = predicted_peak_gib

        self.cfg, self.rt, self.run_dir, self.quiet, self.data_shard = cfg, runtime, run_dir, quiet, data_shard
        self.hooks = Hooks(hooks if hooks is not None else default_hooks())
        layout = layout or resolve_layout(cfg, runtime.world_size)
        self.distributed = layout.world > 1
        self.custom = custom
        if custom is None:
            self.args = model_args_for(cfg)
            check_layout(layout, self.args, cfg.seq_len, cfg.global_batch, runtime.device_type)
        else:
            self.args = None
            custom.check(layout, cfg)
        self.layout = layout.with_mesh(runtime.device_type, cfg.timeout_s) if self.distributed else layout

        # CPU: the step-2 memory line measures resident memory above what the process holds now (host_memory.py)
        self.host_baseline = ResidentBaseline.take() \
            if predicted_peak_gib is not None and runtime.device_type != "cuda" else None
        # before the model exists, so the snapshot shows who allocated the parameters too
        self.mem_snapshot = MemorySnapshot.start(cfg.memory_snapshot, runtime.device_type, run_dir, runtime.rank)
        self.hf = custom is None and is_hf_model(cfg.model)
        if self.hf:  # a transformers model (--model hf:PATH): its own module tree, its own TP plan
            check_hf_run(layout, cfg, self.args)
            model = build_hf_model(cfg.model, cfg.seed)
            if layout.splits_stages:  # the same modules, seen as embedding / layers / norm / head for the stage split
                model = pipeline_view(model, self.args)
        else:
            model = custom.build_model(cfg.seed) if custom else build_model(self.args, "cpu", seed=cfg.seed, speed=model_speed_for(cfg))
        self.model_name = custom.name if custom else self.args.name
        # counted on the whole model, before any strategy shards it (parameters() counts a tied table once)
        self.param_count = sum(p.numel() for p in model.parameters())
        self.model_meta = custom.describe(model) if custom else self.args.to_dict()
        if cfg.init_from:  # into the full model, before any strategy shards it
            from paratrain.interop.hf_import import load_hf_weights

            load_hf_weights(model, cfg.init_from, self.args)
        self.lora = lora_spec_for(cfg, self.hf)  # --lora-r: adapters on the targets, the base frozen (models/lora.py)
        if self.lora is not None:
            attach_lora(model, self.lora, cfg.seed)
        model = model.to(runtime.device)
        if cfg.dtype == "fp8":  # before parallelize, so FSDP and compile see the float8 linears
            from paratrain.train.float8 import convert_to_float8

            model = convert_to_float8(model)
        self.tf32 = enable_tf32(runtime.device_type, cfg.dtype, cfg.tf32)
        self.scaler = loss_scaler(cfg, runtime.device_type)
        self.step_runner = self._build_step_runner(model)
        # under LoRA the optimizer holds the adapters alone (the frozen base gets no state)
        self.params = [p for part in self.step_runner.model_parts for p in part.parameters()
                       if p.requires_grad or self.lora is None]
        self.optimizers = self._build_optimizers()
        # --semi-sync: the islands' global copy and outer step, after the inner optimizer's (parallel/semi_sync/)
        # (a --heal-replicas island, one process of its own, gets its outer loop from its healer: island_heal.py)
        self.outer_sync = build_outer_sync(cfg, self.layout, self.step_runner.model_parts, runtime.rank) \
            if self.layout.semi_sync and data_shard is None else None

        dataset = custom.dataset(cfg) if custom else make_train_data(cfg, self.args.vocab_size)
        self.floor = dataset.entropy_floor()
        self.data_tokens = dataset.num_tokens()
        dp_rank, dp_size = data_shard or (self.dp_rank, self.layout.dp)
        micro, shares = self.layout.micro_batch_of(dp_rank), dp_shares(self.layout)  # shares: --dp-batch-split
        if data_shard:
            micro = min(micro, cfg.global_batch // dp_size)
        self.source = dataset.batch_source(cfg.global_batch, dp_rank, dp_size, micro, shares,
                                           workers=cfg.data_workers)
        self.validator = None if custom else \
            build_validator(cfg, self.args.vocab_size, dp_rank, dp_size, micro, shares)
        self.last_val: dict = {}
        self.step = 0
        # a custom model's data function yields samples, not sequences: its "tokens" are samples
        per_sample = 1 if custom and callable(custom.data) else cfg.seq_len
        self.tokens_per_step = cfg.global_batch * per_sample
        self.flops_per_step = flops_per_token(self.args, cfg.seq_len) * self.tokens_per_step if self.args else 0.0
        # a custom model's FLOPs are unknown: no MFU rather than a wrong one; otherwise the peak of the precision
        # that actually runs (TF32 or true fp32, bf16, fp8), None where the catalog does not know it
        self.peak_tflops = None if custom else \
            device_peak_tflops(runtime.device_type, peak_dtype(cfg.dtype, self.tf32))
        if runtime.device_type == "cuda" and self.peak_tflops is None and runtime.is_main and not quiet and not custom:
            log.info("MFU unknown: %s has no %s peak in paratrain's GPU catalog (none is borrowed from another GPU)",
                     torch.cuda.get_device_name(runtime.device), peak_dtype(cfg.dtype, self.tf32))
        self.state = ckpt.CheckpointState(self.step_runner.model_parts, self.optimizers,
                                          islands=self.outer_sync and self.outer_sync.checkpoint_view())
        self.fingerprint = ckpt.model_fingerprint(self.model_meta)
        self.last_checkpoint: Path | None = None
        self.run_id: str | None = None  # set by maybe_resume(): whose checkpoints prune may remove
        self.stop_reason: str | None = None  # set by a hook to end fit() after this step (e.g. "preempted")
        if cfg.preempt_signal:
            from paratrain.train.recovery.preemption import attach_preemption

            attach_preemption(self, cfg.preempt_signal)

    # -- assembly -----------------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rt.rank) if self.distributed else 0

    def _plan_for(self):
        """plan_for(model, **options) -> the TP plan: the model family's (or the custom model's), then the
        tp_plan hooks'."""
        layout = self.layout
        base = self.custom.plan_for if self.custom else \
            functools.partial(hf_tp_plan if self.hf else tp_plan_for, tp=layout.tp, sp=layout.sp)

        def plan_for(model, **options):
            plan = self.hooks.apply_tp_plan(model, base(model, **options))
            return with_adapter_styles(model, plan) if self.lora is not None else plan

        return plan_for

    def _prepare_batch(self, own):
        """The runner's batch preparation: `own` (context parallel's sharding, or None), then the prepare_batch
        hooks'; None while neither exists."""
        hooks, layout = self.hooks, self.layout
        if own is None and not hooks.has("prepare_batch"):
            return None

        def prepare(inputs, targets):
            extra = {}
            if own is not None:
                inputs, targets, extra = own(inputs, targets)
            return hooks.apply_prepare_batch(inputs, targets, extra, layout)

        return prepare

    def _build_step_runner(self, model) -> StepRunner:
        layout = self.layout
        use_autocast = layout.dtype != "fp32"
        plan_for = self._plan_for()
        # every micro-batch's loss factor and the loss's reduction (parallel/loss_weighting.py)
        self.loss_weighting = LossWeighting.of(layout, self.dp_rank)
        if layout.splits_stages:
            from paratrain.train.pipeline_step import build_pipeline_step

            return build_pipeline_step(model, layout, self.rt.device, self.cfg.seq_len, plan_for, self.hooks,
                                       self.loss_weighting)
        prepare = None
        if layout.splits_sequences:
            from paratrain.parallel.cp.context_parallel import sequence_sharder

            prepare = sequence_sharder(layout)
        prepare = self._prepare_batch(prepare)
        graphs = self.cfg.cuda_graphs  # one GPU (train/precision.py): the whole model, captured
        if self.cfg.fused_bias_gelu and (layout.compile or graphs):
            fuse_gemm_epilogues(self.rt.device_type)
        # on one device too: AC and compile live there. Under a built-in TP plan the logits stay vocab-sharded
        # (loss parallel: no all-gather of the logits); the loss then runs under loss_parallel()
        loss_parallel = layout.splits_within_layers and not self.custom
        plan = None
        if layout.splits_within_layers:
            plan = plan_for(model, loss_parallel=True) if loss_parallel else plan_for(model)
        model = parallelize(model, layout.replace(compile=False) if graphs else layout, plan)
        self.hooks.fire("after_parallelize", model, layout)
        if graphs:
            from paratrain.parallel.compile import apply_compile

            model = apply_compile(model, whole=True, mode="reduce-overhead")
        fused = FusedLoss.of(self.cfg)  # the model's head takes the targets and returns the loss (no logits)
        if self.custom and self.custom.loss_fn:
            loss_fn = self.custom.loss_fn
        elif fused is not None:
            loss_fn = head_loss
        else:
            loss_fn = lm_loss
        # DTensor logits stay eager: the loss_parallel() context is not traced
        if (layout.compile or graphs) and not layout.splits_within_layers and fused is None:
            loss_fn = compile_loss(loss_fn)
        weighting = self.loss_weighting
        self.loss_weighting = weighting.with_dense_weight(
            self.hooks.apply_loss_weight(layout, self.dp_rank, weighting.dense_weight))
        return PlainStep(model, self.rt.device, self.cfg.dtype, use_autocast, self.scaler, prepare, loss_fn=loss_fn,
                         loss_parallel=loss_parallel, mark_graph_steps=graphs, loss_weighting=self.loss_weighting,
                         hooks=self.hooks, fused_loss=fused)

    def _build_optimizers(self) -> list:
        """The optimizers (the runner's own, ZeRO-1's or AdamW), and what steps beside them: --optimizer-graph's
        folded (on CUDA captured) step, --bf16-param-copies' copies (train/optimizer_graph.py, param_copies.py)."""
        cfg = self.cfg
        optimizers = self.step_runner.build_optimizers(cfg)
        if optimizers is None and self.layout.zero_stage == 1:
            from paratrain.parallel.dp.data_parallel import build_zero1_optimizer

            optimizers = [build_zero1_optimizer(self.params, run_optimizer_spec(cfg), self.layout,
                                                self.rt.device_type)]
        elif optimizers is None:
            optimizers = [build_run_optimizer(self.params, cfg, self.rt.device_type)]
        self.optimizer_graph = OptimizerGraph(optimizers, cfg.grad_clip, self.rt.device) \
            if cfg.optimizer_graph else None
        self.param_copies = ParamCopies(self.step_runner.model_parts) \
            if wants_bf16_copies(cfg, self.layout) else None
        return optimizers

    # -- checkpoints ----------------------------------------------------------------------------------------
    def ckpt_dir(self) -> str | None:
        if self.cfg.ckpt_dir:
            return self.cfg.ckpt_dir
        wanted = self.cfg.ckpt_every or self.cfg.preempt_signal  # a preemptible run saves when told to
        return str(self.run_dir / "checkpoints") if (self.run_dir and wanted) else None

    def maybe_resume(self) -> None:
        found = ckpt.resume_from(self.cfg.resume, self.ckpt_dir(), self.state, self.fingerprint, self.model_meta)
        # a resumed run continues its checkpoint's lineage (run_id); a fresh one must not mix with another's
        self.run_id = (found[1].get("run_id") if found else None) or (ckpt.new_run_id() if self.ckpt_dir() else None)
        ckpt.refuse_foreign_newer(self.ckpt_dir(), found[1]["step"] if found else 0, self.run_id)
        if found is None:
            return
        path, manifest = found
        self.step = manifest["step"]
        self.source.load_state_dict(manifest["extra"]["data"])
        if self.scaler and "scaler" in manifest["extra"]:
            self.scaler.load_state_dict(manifest["extra"]["scaler"])
        if self.rt.is_main and not self.quiet:
            log.info("resumed from %s (step %d)", path, self.step)
            if self.step >= self.cfg.steps:
                log.info("nothing left to train: the checkpoint is at step %d of --steps %d", self.step,
                         self.cfg.steps)

    def checkpoint_due(self) -> bool:
        """Whether the step just taken is one of --ckpt-every's, in a run that has a checkpoint directory."""
        cfg = self.cfg
        return bool(cfg.ckpt_every and self.step % cfg.ckpt_every == 0 and self.ckpt_dir())

    def save_checkpoint(self) -> Path:
        if self.run_id is None:  # saved without maybe_resume(): a fresh lineage
            self.run_id = ckpt.new_run_id()
        extra = {"data": self.source.state_dict()}
        if self.outer_sync is not None:
            extra["semi_sync"] = self.state.islands.record()
        if self.scaler:
            extra["scaler"] = self.scaler.state_dict()
        meta = {"model_fingerprint": self.fingerprint, "model": self.model_meta, "world_size": self.layout.world,
                "dims": self.layout.degrees(), "strategy": self.cfg.strategy, "run_id": self.run_id,
                "model_source": ckpt.model_source(self.cfg.model, self.custom, self.cfg.tokenizer),
                "lora": self.lora.to_dict() if self.lora is not None else None}
        self.last_checkpoint = ckpt.save(self.ckpt_dir(), self.step, self.state, extra, meta, self.cfg.keep_ckpts)
        return self.last_checkpoint

    # -- the loop -----------------------------------------------------------------------------------------------
    def fit(self, on_step=None) -> dict:
        """Train from the resumed step to --steps. Each step: its micro-batches from the loader, launched
        (train_step below: zero_grad, forward and backward, optimizer_step, global_loss), its record completed
        (complete_record; one step late when nothing needs it at once: train/step_record.py), then a checkpoint
        when one is due. `on_step(trainer, record)` sees each step's record. Returns the run's summary."""
        cfg = self.cfg
        self.maybe_resume()
        steplog = StepLog(self.run_dir, cfg.steps, self.floor, enabled=cfg.metrics, quiet=self.quiet,
                          start_step=self.step) if self.rt.is_main else None
        log_run_start(self)
        loader = self.open_loader()
        monitor = self.start_monitor(steplog) if cfg.monitor else None
        monitor_clock = self.hooks.on_phase(monitor.clock.on_phase) if monitor else None
        run = FitRun(steplog, monitor, on_step)
        pending = PendingSteps(self.defers_records(on_step, monitor), functools.partial(self.complete_record, run=run))
        # wall_s / cpu_s: stamped at the top of every step, so consecutive differences hold everything between
        # (logging, --monitor's windows, callbacks), which step_time_s does not
        loop_wall, loop_cpu = time.perf_counter(), time.process_time()
        try:
            while self.step < cfg.steps:
                timing = StepTiming(self.rt.device)
                wall_s, cpu_s = timing.t0 - loop_wall, time.process_time() - loop_cpu
                loader = self.follow_data_position(loader)
                micro, waited = loader.next_step()
                out = self.launch_step(micro) if pending.defer else self.train_step(micro)
                launched = LaunchedStep.launched(self.step, out, timing, data_wait_s=waited,
                                                 mem_peak_gib=self.memory_gib(), wall_s=wall_s, cpu_s=cpu_s)
                pending.add(launched, read_now=self.needs_record_now())  # deferring: the previous step's record
                if self.stop_reason is not None:
                    break
                if self.checkpoint_due():
                    self.save_checkpoint()
            pending.finish()
        except BaseException as exc:
            with contextlib.suppress(Exception):  # the records already there; the failure is what is reported
                pending.complete_ready()
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise self.out_of_memory() from None
            raise
        finally:
            self.end_run(loader, monitor, monitor_clock, steplog)
        return fit_summary(self, run)

    def open_loader(self):
        """This rank's loader (train/data/source.py's StepLoader) from the source's position: pinned batches on
        CUDA, and the before_batch hooks called before each step's batch is read."""
        return self.source.prefetcher(pin=self.rt.device_type == "cuda", timeout_s=self.cfg.timeout_s,
                                      before_batch=self._before_batch())

    def follow_data_position(self, loader):
        """`loader`, or a new one where a hook moved the source's position (a healed replica's data position)."""
        if loader.position == self.source.step:
            return loader
        loader.close()
        return self.open_loader()

    def end_run(self, loader, monitor, monitor_clock, steplog) -> None:
        """fit()'s end, failed or not: stop the loader and --monitor, write the memory snapshot, close the log."""
        loader.close()
        if monitor:
            monitor.close()
            monitor_clock.remove()
        self.mem_snapshot.finish()
        if steplog:
            steplog.close()

    # -- the step -------------------------------------------------------------------------------------------
    def train_step(self, micro_batches) -> dict:
        """One optimizer step on these micro-batches, through the wrap_step hooks: {"loss", "lr", "grad_norm"}
        as floats (on CUDA, reading them waits for the step)."""
        return self._through_hooks(micro_batches, read=True)

    def launch_step(self, micro_batches) -> dict:
        """train_step without the host reads: "loss" and "grad_norm" stay tensors on the device, so on CUDA the
        call returns once the step's work is queued (fit()'s deferred records, train/step_record.py)."""
        return self._through_hooks(micro_batches, read=False)

    def _through_hooks(self, micro_batches, read: bool) -> dict:
        step = functools.partial(self._train_step, read=read)
        if not self.hooks.has("wrap_step"):
            return step(micro_batches)
        return self.hooks.run_step(self, micro_batches, step)

    def _train_step(self, micro_batches, read: bool = True) -> dict:
        """The step itself: zero the gradients; forward and backward over the micro-batches in the step runner
        (train/step.py's PlainStep, or train/pipeline_step.py's schedule); optimizer_step; global_loss. Each
        phase's end is marked for the on_phase hooks."""
        hooks = self.hooks  # on_phase: doctor's phase timer, --monitor's clock (they only read clocks)
        set_step(self.step + 1)
        hooks.phase("start")
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        local = self.step_runner.forward_backward([mb.to(self.rt.device, non_blocking=True) for mb in micro_batches])
        hooks.phase("forward_backward")
        lr, norm = self.optimizer_step()
        if read:  # inside the phase that waits for it, as --monitor's clock expects
            norm = float(norm)
        hooks.phase("optimizer")
        self.step += 1
        loss = self.global_loss(local, read)
        hooks.phase("loss_sync")
        return {"loss": loss, "lr": lr, "grad_norm": norm}

    def optimizer_step(self) -> tuple[float, torch.Tensor]:
        """Unscale, clip, step: (the learning rate, the gradient norm before clipping, on the device)."""
        self.hooks.fire("on_gradients", self)
        lr = lr_at_step(self.cfg, self.step)
        for opt in self.optimizers:
            set_lr(opt, lr)
            if self.scaler:
                self.scaler.unscale_(opt)
        pp_group = self.layout.submesh("pp").get_group() if self.layout.splits_stages else None
        # --optimizer-graph: the norm alone here; its clip scale enters the fused step
        folded = self.optimizer_graph is not None
        norm = clip_grad_norm(self.params, 0.0 if folded else self.cfg.grad_clip, pp_group)
        self.hooks.fire("before_optimizer_step", self)
        if folded:
            self.optimizer_graph.step(norm)
        else:
            for opt in self.optimizers:
                if self.scaler:
                    self.scaler.step(opt)
                else:
                    opt.step()
        if self.scaler:
            self.scaler.update()
        self.step_runner.after_optimizer_step()  # e.g. local SGD's periodic parameter averaging
        if self.outer_sync is not None:
            self.outer_sync.after_inner_step()
        if self.param_copies is not None:
            self.param_copies.write()
        return lr, norm

    def global_loss(self, local: torch.Tensor, read: bool = True) -> float | torch.Tensor:
        """The mean loss over dp x cp (or the runner's own reduction). read=False: a tensor left on the device
        (no host sync), unless the runner's reduction already read it (a pipeline's)."""
        reduced = self.step_runner.reduce_loss(local)
        if reduced is not None:
            return float(reduced) if read else reduced
        if self.distributed:
            mesh = self.layout.submesh("dp_cp")
            if mesh is not None:
                local, group = local.clone(), mesh.get_group()
                collective("loss", "dp_cp", "all_reduce", group, lambda: dist.all_reduce(local, group=group),
                           (local,))
                local = self.loss_weighting.global_mean(local)
        return float(local.item()) if read else local

    # -- a step's record ------------------------------------------------------------------------------------
    def defers_records(self, on_step, monitor) -> bool:
        """Whether fit() may complete a step's record after launching the next step (train/step_record.py): only
        when nothing needs the record before then: no on_step callback, after_step hook or --monitor (they may
        stop the run, save, or read the model or the phase clocks at that step) and no MoE layer (its expert
        load is read from the model). Decided once, when fit() starts."""
        moe = self.args is not None and self.args.moe
        return on_step is None and monitor is None and not self.hooks.has("after_step") and not moe

    def needs_record_now(self) -> bool:
        """Whether the step just launched must have its record complete before the next launch: it validates,
        checkpoints (never a diverged step's update) or is the last one, or something asked to stop."""
        cfg, step = self.cfg, self.step
        return (step >= cfg.steps or self.stop_reason is not None
                or bool(self.validator and cfg.eval_every and step % cfg.eval_every == 0)
                or self.checkpoint_due())

    def complete_record(self, launched: LaunchedStep, run: FitRun) -> None:
        """Step `launched.step`'s record: its values read, checked, then handed on in order (metrics.jsonl,
        --monitor, on_step, the after_step hooks). Validation runs here: such a step is completed before the
        next one is launched (needs_record_now), so it evaluates the model as that step left it."""
        cfg, step, main = self.cfg, launched.step, self.rt.is_main
        loss, grad_norm, dt = launched.values()
        if not math.isfinite(loss):
            raise RunFailed(f"loss became {loss} at step {step}: training diverged; "
                            f"try a lower --lr (now {launched.lr:.3g} at this step, peak {cfg.lr:g})")
        tokens_per_s = self.tokens_per_step / dt
        mfu = (self.flops_per_step / dt / (self.peak_tflops * 1e12 * self.layout.world)
               if self.peak_tflops else None)
        if step > 1 or cfg.steps == 1:
            run.total_time += dt
            run.measured_steps += 1
        record = {"step": step, "loss": loss, "lr": launched.lr, "grad_norm": grad_norm,
                  "step_time_s": dt, "data_wait_s": launched.data_wait_s, "tokens_per_s": tokens_per_s, "mfu": mfu,
                  "mem_peak_gib": launched.mem_peak_gib, "wall_s": launched.wall_s, "cpu_s": launched.cpu_s}
        if self.args is not None and self.args.moe:  # per-layer expert load (models/moe.py)
            from paratrain.models.moe import expert_load_record

            record.update(expert_load_record(self.step_runner.model_parts))
        if self.validator and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            with self.outer_sync.global_parameters() if self.outer_sync else contextlib.nullcontext():
                val = evaluate(self)  # under --semi-sync, of the global parameters
            self.last_val = {"val_loss": val, "val_ppl": perplexity(val)}
            record.update(self.last_val)
        run.history.append(record)
        run.tokens_per_s = tokens_per_s
        if step == 2 and self.predicted_peak_gib is not None and main and not self.quiet:
            self.log_memory_against_prediction(record["mem_peak_gib"])
        if run.steplog and (step % cfg.log_every == 0 or step == cfg.steps):
            run.steplog.log(record)
        if run.monitor:
            run.monitor.observe(record)
        if run.on_step is not None:
            run.on_step(self, record)
        self.hooks.fire("after_step", self, record)

    def start_monitor(self, steplog):
        """train --monitor; fit() attaches its clock to the on_phase hook."""
        from paratrain.train.monitor import Monitor

        return Monitor(self.cfg.monitor_every, self.cfg.monitor_windows, self.run_dir,
                       steplog.file if steplog else None, self.rt.is_main, self.cfg.monitor_port)

    def _before_batch(self):
        """The prefetcher's before_batch callback (on its thread), or None while no hook is registered."""
        if not self.hooks.has("before_batch"):
            return None
        return functools.partial(self.hooks.fire, "before_batch")

    def log_memory_against_prediction(self, measured_gib: float) -> None:
        """Step 2 (the optimizer state exists from step 1): the memory check's prediction against the measured
        peak: on a GPU the peak allocated bytes; on CPU the resident memory above what the process held before
        the model was built (torch itself is not predicted), or where that cannot be read, all of it."""
        what = "peak allocated" if self.rt.device_type == "cuda" else "process RSS, torch included"
        if self.host_baseline is not None:
            measured_gib, what = self.host_baseline.peak_above(), self.host_baseline.describe()
        log.info("memory at step 2: predicted %.3g GiB per device, measured %.3g GiB (%s): %.2fx",
                 self.predicted_peak_gib, measured_gib, what, measured_gib / self.predicted_peak_gib)

    def out_of_memory(self) -> UserError:
        """Dump the allocator state, then name the snapshot and the planner's fix in one line."""
        snapshot = self.mem_snapshot.dump("oom-snapshot")
        gpu = catalog_name_for(torch.cuda.get_device_name(self.rt.device)) if self.rt.device_type == "cuda" else None
        return out_of_memory_error(self.cfg, self.layout.world, self.source.micro_batch, self.step, self.rt.rank,
                                   snapshot, gpu, cuda_memory_summary(self.rt.device))

    def verify_extras(self) -> dict:
        """Extra verify --json fields: per-rank model-state bytes (collective: every rank must call it)."""
        from paratrain.parallel.model_states import gather_model_state_bytes

        extras = {"model_state_bytes": gather_model_state_bytes(self.step_runner.model_parts, self.optimizers)}
        extras.update(self.step_runner.verify_extras())  # e.g. the pipeline's busy/idle timing
        return extras

    def memory_gib(self) -> float:
        gpu = peak_memory_gib(self.rt.device)
        return gpu if gpu is not None else current_rss_gib()
