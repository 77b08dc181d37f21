"""Greedy decoding two ways, for the KV cache's tests (importable as `kv_decode`): the cache-free reference, one
prompt at a time with the whole sequence through the model each step, and a minimal loop over
infer/kv_cache.py's forward_step for a left-padded batch of prompts."""

from __future__ import annotations

import torch

from paratrain.infer.kv_cache import PADDING, forward_step, new_cache


def model_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


@torch.no_grad()
def greedy_full(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """The reference: each new token from the whole sequence's forward, no cache."""
    ids = torch.tensor([prompt])
    out, logprobs = [], []
    for _ in range(new_tokens):
        last = model_logits(model, ids)[0, -1].float().log_softmax(-1)
        token = int(last.argmax())
        out.append(token)
        logprobs.append(float(last[token]))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out, logprobs


@torch.no_grad()
def greedy_cached(model_parts, prompts: list[list[int]], new_tokens: int, layout) -> list[tuple[list[int], list[float]]]:
    """Every prompt at once, left-padded (padding at position -1), through the cache: the prompt in one step,
    then one token per row per step."""
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    positions = torch.tensor([[PADDING] * (width - len(p)) + list(range(len(p))) for p in prompts])
    cache = new_cache(model_parts, len(prompts), width + new_tokens, layout)
    outs: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
    for _ in range(new_tokens):
        last = forward_step(model_parts, tokens, positions, cache)[:, -1].float().log_softmax(-1)
        picked = last.argmax(-1)
        for row, (ids, logprobs) in enumerate(outs):
            ids.append(int(picked[row]))
            logprobs.append(float(last[row, picked[row]]))
        tokens, positions = picked[:, None], positions[:, -1:] + 1
    return outs
