"""Activation checkpointing per transformer block: trade recomputation in the backward for activation memory.

Modes: "none"; "full" recomputes the whole block; "selective" is op-level selective checkpointing (SAC):
matmul, attention and reduce-scatter outputs are kept, everything cheap (norms, RoPE, SiLU/GELU, casts,
elementwise) is recomputed, so the backward re-runs no matmul and no TP collective (an MoE block's expert
exchange under --ep is replayed, as with full AC: its all-to-alls write into buffers, which SAC cannot cache).

Selective AC replays a block's ops by count: the k-th call of each op in the recompute must match the k-th in
the forward. Profiler ranges (`record_function`) are not computation and their number can differ between the
two (under --ep with ep = dp_shard the experts' own FSDP2 state, nested in the block, marks one more range in
the replay than in the forward), so they bypass the SAC modes altogether.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, _CachedTorchDispatchMode, _CachingTorchDispatchMode

from paratrain.errors import UserError
from paratrain.parallel.options import AC_MODES

log = logging.getLogger("paratrain")


def ops_to_save() -> frozenset:
    """Ops whose outputs selective AC keeps: the FLOP-heavy ones (matmuls, every SDPA kernel) and the
    TP/SP reduce-scatter, whose recomputation would repeat communication."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return frozenset(ops)


def kept_collectives(mode: str) -> frozenset[str]:
    """The collectives whose outputs `mode` keeps for the backward, so its recomputation does not issue them again
    (ops_to_save: selective AC keeps the TP/SP reduce-scatter's; the all-gathers and all-reduces are replayed)."""
    return frozenset({"reduce_scatter"}) if mode == "selective" else frozenset()


def _save_matmuls_policy(saved: frozenset):
    def policy(ctx, op, *args, **kwargs):
        # MUST_* so that torch.compile's own recompute heuristics keep the same choice
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _profiler_ops() -> frozenset:
    profiler = torch.ops.profiler
    packets = (getattr(profiler, n) for n in ("_record_function_enter", "_record_function_enter_new",
                                               "_record_function_exit") if hasattr(profiler, n))
    return frozenset(getattr(p, o) for p in packets for o in p.overloads())


class _SaveMode(_CachingTorchDispatchMode):
    """The forward's SAC mode, profiler ranges passed through uncounted."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PROFILER_OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _ReplayMode(_CachedTorchDispatchMode):
    """The recompute's SAC mode, profiler ranges passed through uncounted."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PROFILER_OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


_PROFILER_OPS = _profiler_ops()


def selective_context_fn():
    """A fresh (forward, recompute) pair of SAC dispatch modes for each checkpointed call."""
    storage: dict = defaultdict(dict)
    return _SaveMode(_save_matmuls_policy(ops_to_save()), storage), _ReplayMode(None, storage)


def _has_dropout(block: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in block.modules())


def checkpoint_block(block: nn.Module, mode: str) -> nn.Module:
    # Saving the RNG state costs a copy per block per step; only random ops (dropout) need it replayed.
    kwargs = {"preserve_rng_state": _has_dropout(block)}
    if mode == "selective":
        kwargs["context_fn"] = selective_context_fn
    wrapped = checkpoint_wrapper(block, **kwargs)
    wrapped.ac_mode = mode  # read by apply_compile, which treats the two modes differently
    return wrapped


def apply_ac(model: nn.Module, mode: str) -> nn.Module:
    """Wrap every block in `model.layers` (a ModuleDict; pipeline stages hold a subset) with checkpointing.

    Parameter names gain `_checkpoint_wrapped_module.`; DCP state dicts and verify strip it, so checkpoints
    load across AC modes.
    """
    if mode not in AC_MODES:
        raise UserError(f"unknown activation checkpointing mode {mode!r}; use one of: {', '.join(AC_MODES)}")
    if mode == "none":
        return model
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise UserError(f"--ac {mode} needs a model whose transformer blocks sit in a ModuleDict `layers`")
    for name, block in list(layers.items()):
        layers[name] = checkpoint_block(block, mode)
    log.info("applied %s activation checkpointing to %d blocks", mode, len(layers))
    return model


def ac_mode_of(block: nn.Module) -> str:
    return getattr(block, "ac_mode", "none") if hasattr(block, "_checkpoint_wrapped_module") else "none"

