"""The KV cache of generation: every attention layer's keys and values kept across decode steps, so that a step
computes only its new tokens.

The interface the generate loop (infer/generate.py) codes against:

- `supports_cache(model_parts) -> bool`: whether this rank's model can decode with the cache. Not under pipeline
  stages (a rank holds a part of the model: each stage has its own cache, `stage_supports_cache` and
  `stage_forward`, infer/pipeline_generate.py), context parallelism (its ring / Ulysses attention replaced the
  attention), nor an MoE with a capacity factor (which copies drop depends on the whole sequence's length, so
  a token's output changes as the sequence grows); the loop then runs the cache-free full forward.
- `new_cache(model_parts, batch, max_len, layout) -> KVCache`: an empty cache for `batch` rows of up to
  `max_len` tokens (prompt and new tokens).
- `forward_step(model_parts, tokens, positions, cache) -> logits`: the logits (batch, seq, vocab, in the model's
  output dtype, whole even when tensor parallel shards the head) of `tokens` (batch, seq), filling the cache.
  Prefill passes the whole prompt, then each decode step one token per row. `positions` (batch, seq), or (seq,)
  for every row: each token's position in its sequence (RoPE's angle, GPT-2's learned position), continuing from
  the prompt's length. A position of -1 marks padding (a left-padded shorter prompt): no token attends to it, and
  the model sees it at position 0.

Each model's own numerics stay: paratrain's models keep their forward and only have their attention hook
(`Attention.attn_fn`, the one context parallelism swaps) pointed, for one step, at an attention over the cached
keys; transformers models (`hf:`) run with transformers' own DynamicCache (`past_key_values`, `use_cache=True`).
The cache lives on each rank and holds what that rank's attention sees: under tensor parallelism its local
heads, under FSDP or expert parallelism (every rank a whole attention) all heads of its own rows. A padded row
matches the cache-free forward given per-row positions and a document mask that keeps padding apart.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import UserError
from paratrain.models.llama import causal_sdpa

PADDING = -1  # the position of a padding token


class KVCache:
    """One rank's cache for a batch: per attention layer its keys and values (batch, heads, max_len, head_dim),
    allocated at the first step (their heads and dtype are the layer's, local under tp), each slot's position
    (-1: padding or not yet filled), and for transformers models their DynamicCache."""

    def __init__(self, batch: int, max_len: int, device: torch.device, hf_cache=None):
        self.batch, self.max_len = batch, max_len
        self.length = 0  # slots filled, the same for every row
        self.positions = torch.full((batch, max_len), PADDING, dtype=torch.long, device=device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.hf = hf_cache
        self.padded = False  # whether a filled slot is padding: only then does a decode step need a mask
        self.attention: list[tuple[nn.Module, int]] | None = None  # (attention module, query heads per kv head)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a step's keys and values (batch, heads, seq, head_dim) after the filled slots; every filled
        slot's keys and values, this step's included."""
        if layer not in self.keys:
            shape = (self.batch, k.shape[1], self.max_len, k.shape[-1])
            self.keys[layer] = k.new_zeros(shape)
            self.values[layer] = v.new_zeros(shape)
        stop = self.length + k.shape[2]
        self.keys[layer][:, :, self.length:stop] = k
        self.values[layer][:, :, self.length:stop] = v
        return self.keys[layer][:, :, :stop], self.values[layer][:, :, :stop]

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


def whole_model(model_parts: list[nn.Module]) -> nn.Module | None:
    """The one module that holds the whole model on this rank (through a DDP wrapper), or None (pipeline)."""
    if len(model_parts) != 1:
        return None
    model = getattr(model_parts[0], "module", model_parts[0])  # DDP
    is_hf = hasattr(model, "use_attention")
    whole = getattr(model, "tok_embeddings", None) is not None and getattr(model, "output", None) is not None
    return model if is_hf or whole else None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """paratrain's attention modules (llama.py, gpt2.py), in layer order: those with the attention hook."""
    return [m for m in model.modules() if hasattr(m, "attn_fn")]


def supports_cache(model_parts: list[nn.Module]) -> bool:
    model = whole_model(model_parts)
    if model is None:
        return False
    if hasattr(model, "use_attention"):  # transformers: under context parallelism it attends through our kernels
        return model.hf.can_generate() and not getattr(model, "attention_takes_documents", False)
    return stage_supports_cache(model)


def model_positions(model: nn.Module) -> int | None:
    """The most positions the model has, where it has a limit (GPT-2's learned table; a transformers config's
    max_position_embeddings)."""
    if hasattr(model, "use_attention"):
        return getattr(model.hf.config, "max_position_embeddings", None)
    args = getattr(model, "args", None)
    return args.max_seq_len if getattr(args, "family", None) == "gpt2" else None


def new_cache(model_parts: list[nn.Module], batch: int, max_len: int, layout) -> KVCache:
    """An empty cache for this rank's `batch` rows. `layout` is the run's: a layout the cache cannot serve is
    refused here (supports_cache tells the loop beforehand)."""
    model = whole_model(model_parts)
    if model is None or layout.splits_stages or layout.splits_sequences or not supports_cache(model_parts):
        raise ValueError("this layout decodes without a KV cache (supports_cache is False): pipeline stages, "
                         "context parallelism or MoE capacity")
    limit = model_positions(model)
    if limit is not None and max_len > limit:
        raise UserError(f"{max_len} tokens (prompt + new tokens) are past the model's {limit} positions: "
                        "shorten the prompt or --max-new-tokens")
    device = next(model.parameters()).device
    hf_cache = None
    if hasattr(model, "use_attention"):
        from transformers import DynamicCache

        try:  # the config tells it which layers slide a window (transformers >= 4.56)
            hf_cache = DynamicCache(config=model.hf.config)
        except TypeError:
            hf_cache = DynamicCache()
    return KVCache(batch, max_len, device, hf_cache)


def visible_keys(positions: torch.Tensor, start: int, padded: bool = True) -> torch.Tensor | None:
    """(batch, 1, seq, slots) bool: a query (slot start + i) sees the filled non-padding slots at positions up to
    its own, and a padding query sees itself (a row of nothing would give NaN, and NaN spreads through values).
    None where no row has padding and plain attention is the same: the first step (causal, the cache-free forward's
    own kernel) or one new token (it sees every filled slot). `padded` False: the caller knows no slot is padding
    (KVCache.padded), so no look at the positions."""
    slots = positions.shape[1]
    if (start == 0 or slots - start == 1) and not (padded and bool((positions == PADDING).any())):
        return None
    queries = positions[:, start:]
    seen = (positions[:, None, :] != PADDING) & (positions[:, None, :] <= queries[:, :, None])
    own = torch.arange(start, slots, device=positions.device)[:, None] == torch.arange(slots, device=positions.device)
    return (seen | (own & (queries[:, :, None] == PADDING)))[:, None]


def cached_sdpa(cache: KVCache, layer: int, groups: int, mask: torch.Tensor | None, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention hook for one step: this step's keys and values into the cache, the queries over all of them.
    Grouped-query attention's repeated kv heads are kept once and shared by SDPA's enable_gqa."""
    if groups > 1:
        k, v = k[:, ::groups], v[:, ::groups]
    keys, values = cache.store(layer, k, v)
    if mask is None:  # visible_keys: a whole prompt (causal) or one token (every slot)
        return F.scaled_dot_product_attention(q, keys, values, is_causal=q.shape[2] > 1, enable_gqa=groups > 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=groups > 1)


@contextlib.contextmanager
def attention_over(cache: KVCache, model: nn.Module, mask: torch.Tensor | None):
    """Every attention module's hook pointed at the cache for one forward, then put back. The modules are looked up
    at the cache's first step (a walk of the whole module tree each step costs a decode step real time)."""
    if cache.attention is None:
        # kv heads repeated for grouped-query attention: query heads per kv head (a ratio tp sharding keeps)
        cache.attention = [(m, m.wq.out_features // m.wk.out_features) for m in attention_modules(model)]
    saved = [m.attn_fn for m, _ in cache.attention]
    for layer, (m, groups) in enumerate(cache.attention):
        m.attn_fn = functools.partial(cached_sdpa, cache, layer, groups, mask)
    try:
        yield
    finally:
        for (m, _), fn in zip(cache.attention, saved, strict=True):
            m.attn_fn = fn


def whole_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits a tensor-parallel head left vocab-sharded (loss parallel), gathered."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def stage_supports_cache(stage: nn.Module) -> bool:
    """Whether a paratrain model, or one pipeline stage of it (through its wrappers), can decode with the cache: it
    has attention layers with the hook, all plain causal attention, and no MoE capacity."""
    modules = attention_modules(stage)
    return bool(modules) and all(m.attn_fn is causal_sdpa for m in modules) and \
        not any(getattr(m, "capacity_factor", 0) > 0 for m in stage.modules())


def _claim_slots(cache: KVCache, positions: torch.Tensor) -> tuple[int, int]:
    """(start, stop): the slots a step of positions (batch, seq) fills, their positions recorded. A step of one token
    a row extends rows and is never padding (the decode loop's steps: no look at its position, no host sync)."""
    start, stop = cache.length, cache.length + positions.shape[1]
    if stop > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} tokens; this step would fill {stop}")
    cache.positions[:, start:stop] = positions
    if positions.shape[1] > 1 and not cache.padded:
        cache.padded = bool((positions == PADDING).any())
    return start, stop


@torch.no_grad()
def stage_forward(stage: nn.Module, inputs: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One pipeline stage's forward through its own cache: `inputs` (batch, seq) token ids on the first stage,
    (batch, seq, dim) hidden states after it; the stage's output (hidden states, or the last stage's logits)."""
    batch, seq = inputs.shape[:2]
    positions = positions.to(inputs.device).expand(batch, seq)
    start, stop = _claim_slots(cache, positions)
    with attention_over(cache, stage, visible_keys(cache.positions[:, :stop], start, cache.padded)):
        out = stage(inputs, positions=positions.clamp(min=0))
    cache.length = stop
    return out


@torch.no_grad()
def forward_step(model_parts: list[nn.Module], tokens: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache) -> torch.Tensor:
    part = model_parts[0]  # through its wrappers: FSDP's hooks gather the root's parameters
    batch, seq = tokens.shape
    positions = positions.to(tokens.device).expand(batch, seq)
    start, stop = _claim_slots(cache, positions)
    seen_at = positions.clamp(min=0)
    if cache.hf is not None:
        filled = (cache.positions[:, :stop] != PADDING).long()
        logits = part(tokens, seen_at, cache=cache.hf, attention_mask=filled)
    else:
        with attention_over(cache, whole_model(model_parts), visible_keys(cache.positions[:, :stop], start,
                                                                          cache.padded)):
            logits = part(tokens, positions=seen_at)
    cache.length = stop
    return whole_logits(logits)
