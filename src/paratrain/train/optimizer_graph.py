"""--optimizer-graph: the gradient clip folded into the fused AdamW step, and on CUDA that step captured once in a
CUDA graph and replayed.

Clipping multiplies every gradient by min(1, max_norm / (norm + 1e-6)) (torch's clip_grads_with_norm_), a pass of
its own over all gradients before the optimizer reads them again. The fused AdamW kernel divides each gradient by
its `grad_scale` tensor as it reads it (the hook torch's GradScaler uses to unscale), and writes the divided
gradient back: with grad_scale = 1 / that coefficient the step sees the clipped gradients without the extra pass.
Without clipping the coefficient is exactly 1 and the step is bit-identical to the unfolded one; with it, g / (1/c)
and g * c differ by a rounding or two (fp32: about 1e-7 relative in the gradients).

On CPU only the folding runs (fused AdamW has a CPU kernel; there are no graphs). On CUDA the optimizers are
capturable (train/optim.py): the step reads the learning rate from a tensor filled each step and the gradients
where the graph was captured.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from paratrain.errors import UserError

log = logging.getLogger("paratrain")

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grads_with_norm_'s: the coefficient is max_norm / (norm + 1e-6)
EAGER_STEPS = 2  # before capture: the first step creates the optimizer state; torch.cuda.graphs warms up too


def check_optimizer_graph(cfg, layout) -> None:
    """One line where --optimizer-graph cannot apply (train/validate.py)."""
    if not cfg.optimizer_graph:
        return
    if cfg.optimizer == "sgd":
        raise UserError("--optimizer-graph folds the clip into fused Adam(W)'s step; with --optimizer sgd drop "
                        "--optimizer-graph")
    if cfg.dtype == "fp16":
        raise UserError("--optimizer-graph is not supported with --dtype fp16: its loss scaler already divides the "
                        "gradients through the fused step's grad_scale; use --dtype bf16 or drop --optimizer-graph")
    if layout.zero_stage == 1:
        raise UserError("--optimizer-graph is not supported with zero1: ZeroRedundancyOptimizer steps its own inner "
                        "optimizer on each rank's shard; use ddp, zero2 or zero3, or drop --optimizer-graph")
    if cfg.cpu_offload:
        raise UserError("--optimizer-graph is not supported with --cpu-offload: the offloaded optimizer steps on "
                        "the host, where nothing is captured; drop one of them")


class OptimizerGraph:
    """Steps the trainer's optimizers with the clip folded in (max_norm > 0), captured on CUDA."""

    def __init__(self, optimizers: list, max_norm: float, device: torch.device):
        self.max_norm = max_norm
        # one tensor for every optimizer: the captured kernels read it where it lies
        self.grad_scale = torch.ones((), device=device) if max_norm > 0 else None
        for opt in optimizers:
            if self.grad_scale is not None:
                opt.grad_scale = self.grad_scale  # read by fused Adam(W).step(), as GradScaler sets it
        self.steps = [CapturedStep(opt) if device.type == "cuda" else opt.step for opt in optimizers]

    def step(self, norm: torch.Tensor) -> None:
        """Every optimizer's step; `norm`: the global gradient norm (before clipping) that scales it."""
        if self.grad_scale is not None:
            coef = torch.clamp(self.max_norm / (norm + CLIP_EPS), max=1.0)  # clip_grads_with_norm_'s expression
            self.grad_scale.copy_(coef.reciprocal())
        for step in self.steps:
            step()


class CapturedStep:
    """One capturable optimizer's step as a CUDA graph: eager (on a side stream, as torch.cuda.graphs asks) while
    its state is created, then captured once and replayed. A step whose parameters with gradients are not the
    captured ones (a gradient dropped or replaced) copies into the captured tensors, or runs eagerly when the set
    differs; loading a state dict (a resume, a healed replica) replaces the state tensors, so it captures anew."""

    def __init__(self, opt):
        self.opt = opt
        device = next(p.device for g in opt.param_groups for p in g["params"])
        self.lrs = [torch.tensor(float(g["lr"]), device=device) for g in opt.param_groups]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.params: list = []
        self.grads: list = []
        self.eager = 0
        opt.register_load_state_dict_post_hook(lambda _opt: self.reset())

    def reset(self) -> None:
        self.graph, self.params, self.grads, self.eager = None, [], [], 0

    def __call__(self) -> None:
        for lr, group in zip(self.lrs, self.opt.param_groups, strict=True):
            lr.fill_(float(group["lr"]))  # a kernel argument, no host sync
        params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        if self.graph is not None and len(params) == len(self.params) and \
                all(p is q for p, q in zip(params, self.params)):
            moved = [i for i, p in enumerate(params) if p.grad is not self.grads[i]]
            if moved:
                torch._foreach_copy_([self.grads[i] for i in moved], [params[i].grad for i in moved])
                for i in moved:
                    params[i].grad = self.grads[i]
            self.graph.replay()
            return
        if self.graph is not None or self.eager < EAGER_STEPS:
            self._eager()
            return
        self._capture(params)

    def _eager(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), self._tensor_lrs():
            self.opt.step()
        torch.cuda.current_stream().wait_stream(side)
        self.eager += 1

    def _capture(self, params: list) -> None:
        self.params, self.grads = params, [p.grad for p in params]
        graph = torch.cuda.CUDAGraph()
        # thread_local: a data loader thread's CUDA calls meanwhile are not this capture's
        with self._tensor_lrs(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.opt.step()
        self.graph = graph
        log.info("optimizer step captured in a CUDA graph (%d parameters)", len(params))
        graph.replay()  # capturing records the step without running it

    @contextlib.contextmanager
    def _tensor_lrs(self):
        """The groups' learning rates as the device tensors, for the step only: the param groups (and so the
        checkpoints) keep floats."""
        floats = [g["lr"] for g in self.opt.param_groups]
        for group, lr in zip(self.opt.param_groups, self.lrs, strict=True):
            group["lr"] = lr
        try:
            yield
        finally:
            for group, lr in zip(self.opt.param_groups, floats, strict=True):
                group["lr"] = lr
