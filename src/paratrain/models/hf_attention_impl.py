"""Which attention implementation a transformers model runs with, and what its attention holds that paratrain's
context-parallel kernels do not compute.

Implementation: SDPA where the family supports it; else eager (transformers marks some families as not
SDPA-capable: GPT-OSS's attention sinks, Gemma 2's logit soft-capping). Eager is every family's reference math and
runs on every device; flex attention would save eager's (batch, heads, seq, seq) scores but needs torch.compile to
be fast, which a CPU run cannot count on.

Under tensor parallelism an attention module whose own tensors are per head (GPT-OSS's sinks) has them split with
its heads (models/hf_tp_plan.py's HeadSplitParams); the attention function then gets a view of the module that
hands it their local part (`local_params_attention`), as the split projections hand it local heads.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger("paratrain")

LOCAL_PARAMS = "paratrain-local-params"
_SAID: set[str] = set()  # model classes whose eager attention was announced in this process


def with_supported_attention(make: Callable[[str], nn.Module], name: str) -> nn.Module:
    """`make("sdpa")`, or `make("eager")` where transformers refuses SDPA for the family (said once, in one line)."""
    try:
        return make("sdpa")
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        family = str(exc).split(" ", 1)[0]
    if family not in _SAID:
        _SAID.add(family)
        log.info("%s: %s does not support SDPA attention in transformers; using its eager attention", name, family)
    return make("eager")


class _LocalParams:
    """The attention module as its attention function reads it, with each DTensor parameter as its local part."""

    def __init__(self, module: nn.Module):
        self._module = module

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        return value.to_local() if hasattr(value, "to_local") else value


def local_params_attention(previous: str) -> str:
    """Register (once) the attention function that runs `previous` ("eager": the module's own eager function; else
    the registered one) on a view of the module whose per-head DTensor tensors are local; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if previous.startswith(LOCAL_PARAMS):  # already routed (an earlier layer's attention module)
        return previous
    name = f"{LOCAL_PARAMS}-{previous}"
    if name in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return name

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  **kwargs):
        if previous == "eager":
            inner = sys.modules[type(module).__module__].eager_attention_forward
        else:
            inner = ALL_ATTENTION_FUNCTIONS[previous]
        return inner(_LocalParams(module), query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    # and the masks `previous` gets (transformers passes none to a function no mask is registered for)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    return name


def context_parallel_limits(hf_model: nn.Module) -> list[str]:
    """What the model's attention computes that ring and Ulysses attention (parallel/cp/) do not, one phrase each:
    attention sinks, sliding windows, logit soft-capping, query and value heads of different sizes (multi-head
    latent attention)."""
    from paratrain.models.hf_files import config_value

    config = hf_model.config
    heads = config_value(config, "num_attention_heads", -1)
    out = []
    sinks = sorted({name.rpartition(".")[2] for name, p in hf_model.named_parameters()
                    if "attn" in name and p.dim() == 1 and p.shape[0] == heads})
    if sinks:
        out.append(f"per-head attention terms ({', '.join(sinks)}: attention sinks)")
    windowed = any(getattr(m, "sliding_window", None) for m in hf_model.modules()) or \
        "sliding_attention" in (getattr(config, "layer_types", None) or ())
    window = config_value(config, "sliding_window")
    if windowed and window:
        out.append(f"sliding-window attention (window {window})")
    softcap = config_value(config, "attn_logit_softcapping")
    if softcap:
        out.append(f"attention logit soft-capping ({softcap:g})")
    q_head = config_value(config, "qk_head_dim") or config_value(config, "qk_nope_head_dim")
    v_head = config_value(config, "v_head_dim")
    if q_head and v_head and q_head != v_head:
        out.append(f"query/key heads of {q_head} and value heads of {v_head} (multi-head latent attention)")
    return out
