"""--bf16-param-copies: bf16 copies of every nn.Linear's weight and bias, written after each optimizer step, that
the forward reads under bf16 autocast instead of casting the fp32 parameters again in every forward
(models/weight_copies.py). One device, DDP, ZeRO-1, context and pipeline parallel; FSDP (zero2, zero3, hsdp, ep)
already gathers bf16 parameters through MixedPrecisionPolicy(param_dtype=bf16).

The copies follow the parameters: the trainer writes them after the optimizer step (and after local SGD's
averaging), and a forward first rewrites them if anything else changed a parameter since (a checkpoint load, a
healed replica: each bumps the parameter's version counter).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.models.fused_loss import OutputHead
from paratrain.models.weight_copies import give_copies

# modules whose forward on an input alone is F.linear(x, weight, bias); subclasses that compute otherwise (FP8's
# float8 linears) keep their own. The output head's fused loss (given targets) casts the head weight itself
LINEARS = (nn.Linear, OutputHead)


def check_bf16_param_copies(cfg, layout) -> None:
    """One line where --bf16-param-copies cannot apply (train/validate.py)."""
    if not cfg.bf16_param_copies:
        return
    if layout.fsdp or layout.splits_experts:
        raise UserError(f"--bf16-param-copies is for single-device and DDP-style runs: {layout.strategy} shards the "
                        "parameters with FSDP, whose MixedPrecisionPolicy(param_dtype=bf16) already gathers bf16 "
                        "copies; drop --bf16-param-copies")
    if layout.splits_within_layers:
        raise UserError(f"--bf16-param-copies is not supported with tensor parallelism (tp={layout.tp}) yet: "
                        "its weights are DTensors; drop --bf16-param-copies or run without --tp")


def wants_bf16_copies(cfg, layout) -> bool:
    """Whether this run keeps copies: asked for, under bf16 autocast (no effect in fp32, fp16 or fp8), on a layout
    whose parameters are whole, plain tensors."""
    return bool(cfg.bf16_param_copies) and cfg.dtype == "bf16" and not (
        layout.fsdp or layout.splits_experts or layout.splits_within_layers)


class ParamCopies:
    """The copies of the model parts' nn.Linear parameters (a tied weight has one), attached to their modules."""

    def __init__(self, parts: list[nn.Module]):
        self.masters: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []
        by_master: dict[int, torch.Tensor] = {}
        for part in parts:
            for module in part.modules():
                if type(module) in LINEARS:
                    give_copies(module, *(self._copy_of(p, by_master) for p in (module.weight, module.bias)))
            part.register_forward_pre_hook(self.refresh_stale)
        self.versions: list[int] = []
        self.write()

    def _copy_of(self, master: torch.Tensor | None, by_master: dict) -> torch.Tensor | None:
        if master is None:
            return None
        if id(master) not in by_master:
            by_master[id(master)] = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
            self.masters.append(master)
            self.copies.append(by_master[id(master)])
        return by_master[id(master)]

    @torch.no_grad()
    def write(self) -> None:
        """Every copy from its master (one foreach cast)."""
        torch._foreach_copy_(self.copies, self.masters)
        self.versions = [m._version for m in self.masters]

    def refresh_stale(self, _module, _args) -> None:
        """Before a forward: rewrite the copies if a parameter changed since they were written."""
        if any(m._version != v for m, v in zip(self.masters, self.versions)):
            self.write()

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)
