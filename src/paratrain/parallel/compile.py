"""torch.compile per transformer block (and of the loss), applied after TP/CP/AC and before FSDP/DDP.

Compiling block by block keeps compile time flat in depth (every block reuses one compiled graph) and leaves
the data-parallel wrappers' hooks outside the compiled regions, which is what lets FSDP2 and DDP compose.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from paratrain.errors import UserError
from paratrain.parallel.activation_checkpoint import ac_mode_of

log = logging.getLogger("paratrain")


def apply_compile(model: nn.Module, fullgraph: bool = True, whole: bool = False, mode: str | None = None) -> nn.Module:
    """Replace every block in `model.layers` by its compiled version (an OptimizedModule); a block under full
    activation checkpointing keeps its checkpoint outside and has the module inside compiled.

    whole=True (one device, no wrapper hooks to keep outside): the model's forward is compiled in place (names
    unchanged), so the embedding, the final norm and the head fuse too; `mode`: torch.compile's mode
    ("reduce-overhead": CUDA graphs, --cuda-graphs). Its forward, not Module.compile's whole call: hooks on the
    model itself (the doctor's phase timers, which synchronize the GPU) then run eagerly around the graph
    instead of breaking it.

    Parameter names gain `_orig_mod.`; DCP state dicts and verify strip it, so checkpoints load with or
    without --compile. fullgraph=True: a graph break inside a block is a bug we want to hear about.
    """
    if whole:
        model.forward = torch.compile(model.forward, fullgraph=fullgraph, mode=mode)
        log.info("compiled the whole model with torch.compile%s", f" (mode={mode})" if mode else "")
        return model
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise UserError("--compile needs a model whose transformer blocks sit in a ModuleDict `layers`")
    for name, block in list(layers.items()):
        if ac_mode_of(block) == "full":
            # Full AC stays outside: its recompute re-runs the compiled forward. Compiling through a plain
            # checkpoint breaks AOT autograd on DTensor (TP) blocks in torch 2.13 (it tries to save the
            # DeviceMesh); selective AC is compiled with the block, where the compiler applies its policy.
            # In place (Module.compile), so the names stay those DCP already maps back to the plain model's.
            block._checkpoint_wrapped_module.compile(fullgraph=fullgraph)
            block.register_forward_pre_hook(wait_for_async_inputs)
        else:
            layers[name] = compile_block(block, fullgraph)
    log.info("compiled %d transformer blocks with torch.compile", len(layers))
    return model


def compile_block(block: nn.Module, fullgraph: bool) -> nn.Module:
    compiled = torch.compile(block, fullgraph=fullgraph)
    compiled.register_forward_pre_hook(wait_for_async_inputs)
    return compiled


def fuse_gemm_epilogues(device_type: str) -> bool:
    """--fused-bias-gelu: Inductor picks each GEMM among its Triton templates and ATen by timing them
    (max-autotune), and a template writes the pointwise ops that follow it (GPT-2's bias + GELU) in its epilogue
    instead of a second kernel re-reading the output. Inductor's settings are process-wide and read when a graph
    compiles (lazily, at the first step), hence set here, before. On CPU Inductor's GEMM templates serve frozen
    inference weights only: training keeps ATen's GEMMs (its backward already fuses GELU's gradient with the
    bias sum), so nothing changes there."""
    if device_type != "cuda":
        return False
    import torch._inductor.config as inductor

    inductor.max_autotune_gemm = True
    inductor.max_autotune_gemm_backends = "TRITON,ATEN"
    inductor.epilogue_fusion = True
    log.info("--fused-bias-gelu: Inductor autotunes GEMMs with fused epilogues (compiles take longer)")
    return True


def wait_for_async_inputs(_module: nn.Module, args: tuple):
    """Hand compiled blocks plain tensors, never an AsyncCollectiveTensor.

    Plain TP gives the first block the embedding's async all-reduce result as such a tensor; inside a
    compiled region its gradient comes back as a plain tensor where DTensor's backward wants a DTensor
    (AttributeError '_local_tensor', torch 2.13). A non-view op (clone) waits for it eagerly and keeps the
    autograd link; it is one copy of the hidden states per step, and only where TP produced one.
    """
    if any(isinstance(a, AsyncCollectiveTensor) for a in args):
        return tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args)
    return None


def compile_loss(loss_fn):
    """The compiled loss: fuses the fp32 upcast of the logits with the cross-entropy, so the
    (tokens x vocab) fp32 copy is never materialised; for large vocabularies that is a big slice of step time."""
    return torch.compile(loss_fn, fullgraph=True)


def is_whole_compiled(model: nn.Module) -> bool:
    """apply_compile(whole=True) replaced the model's forward by its compiled version."""
    return "forward" in vars(model)


def is_compiled(block: nn.Module) -> bool:
    """The block, or (under full AC) the module its checkpoint wraps, runs compiled."""
    inner = getattr(block, "_checkpoint_wrapped_module", None)
    return hasattr(block, "_orig_mod") or getattr(inner, "_compiled_call_impl", None) is not None
