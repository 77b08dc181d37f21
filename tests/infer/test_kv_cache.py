"""The KV cache (infer/kv_cache.py) on one device: greedy decoding through it equals the cache-free decoding that
runs the whole sequence through the model at every step (tokens identical, logprobs within 1e-5, fp32), for each
preset family and a transformers model; what it refuses; and that the training forward is left as it was.

Reference: kv_decode.greedy_full, each prompt alone, unpadded, the model's own training forward. The cached side
decodes the prompts as one left-padded batch, so padding is covered too. Multi-rank (tp, tp-sp, ep):
test_kv_cache_parallel.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_decode import greedy_cached, greedy_full  # noqa: E402

from paratrain.errors import UserError  # noqa: E402
from paratrain.infer.kv_cache import forward_step, new_cache, supports_cache  # noqa: E402
from paratrain.models.llama import causal_sdpa  # noqa: E402
from paratrain.models.presets import build_model, get_preset  # noqa: E402
from paratrain.parallel.layout import Layout  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7, 81], [200, 1, 2], [9, 9, 9, 9, 9]]
SAME_LENGTH = [[5, 17, 99, 3], [200, 1, 2, 2]]  # no padding: plain causal prefill, unmasked decode steps
NEW_TOKENS = 10
LOGPROB_ATOL = 1e-5
# a transformers Llama with grouped-query attention (2 kv heads for 4 heads): transformers' own DynamicCache
HF_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
            "attention_dropout": 0.0}


def hf_model(tmp_path, **changes):
    pytest.importorskip("transformers")
    from paratrain.models.hf_model import build_hf_model

    (tmp_path / "config.json").write_text(json.dumps({**HF_LLAMA, **changes}))
    return build_hf_model(f"hf:{tmp_path}", seed=0).eval()


def model_for(name: str, tmp_path):
    if name == "hf-llama":
        return hf_model(tmp_path)
    return build_model(get_preset(name), "cpu", seed=0).eval()


def assert_same_decoding(model, prompts=PROMPTS, new_tokens=NEW_TOKENS, atol=LOGPROB_ATOL):
    cached = greedy_cached([model], prompts, new_tokens, Layout())
    for prompt, (tokens, logprobs) in zip(prompts, cached, strict=True):
        ref_tokens, ref_logprobs = greedy_full(model, prompt, new_tokens)
        assert tokens == ref_tokens, (prompt, tokens, ref_tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) <= atol, (logprobs, ref_logprobs)


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny", "moe-tiny", "hf-llama"])
def test_cached_greedy_equals_cache_free_greedy(name, tmp_path):
    """Llama's RoPE (positions continue from each prompt's length), GPT-2's learned positions, the MoE's routing
    one token at a time, transformers' DynamicCache: each row of a left-padded batch, and of a batch of one
    length, decodes as its prompt alone does."""
    model = model_for(name, tmp_path)
    assert supports_cache([model])
    assert_same_decoding(model, PROMPTS)
    assert_same_decoding(model, SAME_LENGTH)


def test_the_cache_is_what_makes_the_steps_agree():
    """The check can fail: decode steps that skip the cache's earlier keys (a fresh cache each step, the token at
    its right position) give other tokens than the cache-free reference."""
    model = build_model(get_preset("tiny"), "cpu", seed=0).eval()
    prompt = PROMPTS[0]
    ref_tokens, _ = greedy_full(model, prompt, NEW_TOKENS)
    cache = new_cache([model], 1, 32, Layout())
    logits = forward_step([model], torch.tensor([prompt]), torch.arange(len(prompt)), cache)
    tokens = [int(logits[0, -1].argmax())]
    for _ in range(NEW_TOKENS - 1):
        forgetful = new_cache([model], 1, 32, Layout())
        position = torch.tensor([len(prompt) + len(tokens) - 1])
        tokens.append(int(forward_step([model], torch.tensor([[tokens[-1]]]), position, forgetful)[0, -1].argmax()))
    assert tokens[0] == ref_tokens[0] and tokens != ref_tokens


def test_cache_holds_the_kv_heads_once_and_restores_the_attention_hook():
    """Grouped-query attention's repeated heads are cached once (tiny: 2 kv heads of 16); after a step every
    attention module has its own hook back, and the training forward gives the same logits, bit for bit."""
    model = build_model(get_preset("tiny"), "cpu", seed=0).eval()
    tokens = torch.tensor([PROMPTS[0]])
    before = model(tokens)
    cache = new_cache([model], 1, 16, Layout())
    forward_step([model], tokens, torch.arange(tokens.shape[1]), cache)
    assert cache.length == tokens.shape[1]
    assert {tuple(k.shape) for k in cache.keys.values()} == {(1, 2, 16, 16)}
    assert cache.memory_bytes() == 2 * 2 * (2 * 16 * 16) * 4  # 2 layers, keys and values, fp32
    assert all(m.attention.attn_fn is causal_sdpa for m in model.layers.values())
    assert torch.equal(model(tokens), before)


def test_bf16_autocast_decoding_stays_close():
    """Under bf16 autocast the cache keeps bf16 keys; the cached logprobs stay within bf16's rounding of the
    cache-free ones (the same math in another order)."""
    model = build_model(get_preset("gpt2-tiny"), "cpu", seed=0).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = new_cache([model], 1, 16, Layout())
        prompt = torch.tensor([PROMPTS[0]])
        cached = forward_step([model], prompt, torch.arange(prompt.shape[1]), cache)[0, -1].float()
        full = model(prompt)[0, -1].float()
    assert {k.dtype for k in cache.keys.values()} == {torch.bfloat16}
    assert torch.allclose(cached.log_softmax(-1), full.log_softmax(-1), atol=2e-2)


def test_layouts_without_a_cache_are_said(tmp_path):
    """A pipeline stage (no embedding), context parallelism's attention, an MoE with a capacity factor, and a
    transformers model under context parallelism: supports_cache is False and new_cache refuses."""
    import dataclasses

    stage = build_model(get_preset("tiny"), "cpu", seed=0)
    stage.tok_embeddings = None
    ring = build_model(get_preset("tiny"), "cpu", seed=0)
    ring.layers["0"].attention.attn_fn = lambda q, k, v, doc_ids=None: causal_sdpa(q, k, v)
    capped = build_model(dataclasses.replace(get_preset("moe-tiny"), capacity_factor=1.0), "cpu", seed=0)
    hf_cp = hf_model(tmp_path)
    hf_cp.use_attention(hf_cp.attention, documents=True)
    whole = build_model(get_preset("tiny"), "cpu", seed=0)
    for parts in ([stage], [ring], [capped], [hf_cp], [whole, whole]):
        assert not supports_cache(parts)
        with pytest.raises(ValueError, match="without a KV cache"):
            new_cache(parts, 1, 8, Layout())
    assert supports_cache([whole])
    with pytest.raises(ValueError, match="without a KV cache"):
        new_cache([whole], 1, 8, Layout(cp=2))


def test_length_past_the_models_positions_is_one_user_error(tmp_path):
    gpt2 = build_model(get_preset("gpt2-tiny"), "cpu", seed=0)
    with pytest.raises(UserError, match="past the model's 1024 positions"):
        new_cache([gpt2], 1, 1025, Layout())
    with pytest.raises(UserError, match="past the model's 64 positions"):
        new_cache([hf_model(tmp_path)], 1, 65, Layout())
    cache = new_cache([gpt2], 1, 4, Layout())
    with pytest.raises(ValueError, match="holds 4 tokens"):
        forward_step([gpt2], torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5), cache)
