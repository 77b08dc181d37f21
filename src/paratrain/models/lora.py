"""LoRA adapters on a model's nn.Linear modules, without renaming any base parameter (docs/lora.md).

Each targeted linear gets two child modules, `lora_A` (in -> r) and `lora_B` (r -> out), and a forward hook that
adds B(A(dropout(x))) * alpha / r to its output: the base keeps its `weight` (checkpoint keys, TP plans and
exports see the same names) and the adapters' keys are PEFT's (`<module path>.lora_A.weight`). B starts at zero,
so the model's first output is the base model's; A as PEFT initialises it (kaiming-uniform, a = sqrt(5)), from
the run's seed so every rank draws the same. Every other parameter is frozen (requires_grad False): no gradient,
and the optimizer is given the adapters alone (train/trainer.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.errors import UserError

log = logging.getLogger("paratrain")

# attention q and v, as PEFT's default for llama: a preset's names, a transformers model's names
PRESET_TARGETS = ("wq", "wv")
HF_TARGETS = ("q_proj", "v_proj")
QKV_NAMES = {"wq", "wk", "wv"}
ADAPTER_MODULES = ("lora_A", "lora_B", "lora_dropout")
# offset from the run's seed: the adapters' draw must not repeat the base weights' first draws
SEED_OFFSET = 0x10A


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}


def lora_spec_for(cfg, hf: bool) -> LoraSpec | None:
    """The run's adapters, or None without --lora-r. Refuses (one line) the options that would skip them."""
    if not cfg.lora_r:
        if cfg.lora_targets is not None or cfg.lora_alpha is not None or cfg.lora_dropout:
            raise UserError("--lora-alpha, --lora-targets and --lora-dropout need --lora-r R (the adapters' rank)")
        return None
    targets = cfg.lora_target_names or (HF_TARGETS if hf else PRESET_TARGETS)
    if cfg.fused_qkv and QKV_NAMES & set(targets):
        raise UserError(f"--fused-qkv runs wq, wk and wv as one GEMM, which skips the adapters on "
                        f"{', '.join(sorted(QKV_NAMES & set(targets)))}: drop --fused-qkv, or adapt other linears "
                        f"(--lora-targets wo,w1,...)")
    if cfg.dtype == "fp8" or cfg.bf16_param_copies:
        raise UserError(f"LoRA is not supported with {'--dtype fp8' if cfg.dtype == 'fp8' else '--bf16-param-copies'}"
                        " (they swap or copy the linears the adapters hang on)")
    alpha = float(cfg.lora_alpha if cfg.lora_alpha is not None else cfg.lora_r)
    return LoraSpec(cfg.lora_r, alpha, targets, cfg.lora_dropout)


def attach_lora(model: nn.Module, spec: LoraSpec, seed: int) -> list[str]:
    """Freeze `model` and give each nn.Linear named by one of spec.targets (its last name component) adapters.
    Returns the adapted modules' paths."""
    for p in model.parameters():
        p.requires_grad_(False)
    found = [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in spec.targets]
    if not found:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(f"--lora-targets {','.join(spec.targets)} names no module of this model; its linears: "
                        f"{', '.join(names)}")
    generator = torch.Generator().manual_seed(seed + SEED_OFFSET)
    for name, module in found:
        if type(module) is not nn.Linear:
            raise UserError(f"--lora-targets: {name} is a {type(module).__name__}, not an nn.Linear; LoRA adapts "
                            f"linears only")
        add_adapter(module, spec, generator)
    log.info("LoRA: rank %d, alpha %g on %d linears (%s); %d adapter parameters train, the base is frozen",
             spec.r, spec.alpha, len(found), ",".join(spec.targets), sum(adapter_numels(model).values()))
    return [name for name, _ in found]


def add_adapter(linear: nn.Linear, spec: LoraSpec, generator: torch.Generator) -> None:
    weight = linear.weight
    lora_a = nn.Linear(linear.in_features, spec.r, bias=False, device=weight.device, dtype=weight.dtype)
    lora_b = nn.Linear(spec.r, linear.out_features, bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        bound = 1 / math.sqrt(linear.in_features)  # kaiming_uniform_(a=sqrt(5)): PEFT's and nn.Linear's init
        lora_a.weight.copy_(torch.rand(lora_a.weight.shape, generator=generator) * 2 * bound - bound)
        lora_b.weight.zero_()
    for part in (lora_a, lora_b):
        part.fsdp_own_group = True  # FSDP2 shards the adapters apart from the frozen base (parallel/dp/)
    linear.lora_A, linear.lora_B = lora_a, lora_b
    linear.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
    linear.lora_scale = spec.scale
    linear.register_forward_hook(_add_adapter_output)


def _add_adapter_output(linear: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    # args: what the linear computed on, after any TP input hook made it a DTensor
    return output + linear.lora_B(linear.lora_A(linear.lora_dropout(args[0]))) * linear.lora_scale


def has_adapter(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lora_A", None), nn.Module)


def adapter_numels(model: nn.Module) -> dict[str, int]:
    """{name: elements} of the trainable parameters (the adapters under LoRA)."""
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A, in fp32 then back to W's dtype (the merged export)."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)
