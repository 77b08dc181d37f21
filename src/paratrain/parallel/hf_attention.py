"""Context-parallel attention for transformers models, registered in transformers' attention-function registry.

A transformers attention module computes q, k, v (batch, heads, seq_local, head_dim) and hands them to the
function its config names (`config._attn_implementation`). We register ring or Ulysses attention under a name
of our own and point the config at it: no model code is forked. A name no mask function is registered under
makes transformers pass no mask; our functions apply the causal mask over the global (zigzag) sequence, and for
packed rows the document mask from the `doc_ids` keyword HFCausalLM hands the model (transformers passes a
forward's extra keywords down to the attention function).
"""

from __future__ import annotations

import itertools
import math

import torch

_names = itertools.count()


def register_attention(prefix: str, attn_fn) -> str:
    """Register `attn_fn(q, k, v) -> (batch, heads, seq_local, head_dim)`; returns the registered name."""
    from transformers import AttentionInterface

    def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs):
        if dropout and module.training:
            raise RuntimeError("context-parallel attention has no attention dropout; set attention_dropout to 0")
        if kwargs.get("sliding_window"):
            raise RuntimeError("context-parallel attention has no sliding window; set sliding_window to null")
        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        if scaling is not None and not math.isclose(scaling, query.shape[-1] ** -0.5):
            query = query * (scaling * math.sqrt(query.shape[-1]))  # our kernels scale by 1/sqrt(head_dim)
        doc_ids = kwargs.get("doc_ids")  # packed rows: HFCausalLM passes the whole row's document ids through
        out = attn_fn(query, key, value) if doc_ids is None else attn_fn(query, key, value, doc_ids=doc_ids)
        return out.transpose(1, 2).contiguous(), None

    name = f"{prefix}-{next(_names)}"
    AttentionInterface.register(name, attention)
    return name
