"""The KV cache under tensor and expert parallelism, from the shared 2-rank group (tests/groups.py, conftest's
`two_ranks`; the checks are tests/infer/kv_cache_worker.py's).

Reference: the same prompts decoded greedily without a cache, by the same sharded model and by the unsharded
model on one device: in fp32 tokens identical and logprobs within 1e-5 of both; in bf16 (autocast, as the generate
loop runs it) tokens identical to the sharded cache-free decoding, logprobs within bf16's rounding.
"""

from __future__ import annotations

import pytest

FP32_CASES = ("tiny-tp", "gpt2-tiny-tp", "gpt2-tiny-tp-sp", "moe-tiny-ep", "hf-llama-tp", "tiny-fsdp", "gpt2-tiny-ddp")
# kv heads each rank caches: tp=2 halves them (tiny and the transformers Llama: 2 -> 1; GPT-2: 4 -> 2); under ep,
# FSDP and DDP every rank holds whole attention (tiny's and moe-tiny's 2 kv heads, GPT-2's 4)
LOCAL_KV_HEADS = {"tiny-tp": 1, "gpt2-tiny-tp": 2, "gpt2-tiny-tp-sp": 2, "moe-tiny-ep": 2, "hf-llama-tp": 1,
                  "tiny-fsdp": 2, "gpt2-tiny-ddp": 4}


@pytest.mark.parametrize("case", FP32_CASES)
def test_cached_greedy_under_two_ranks_equals_cache_free(two_ranks, case):
    got = two_ranks["kv_cache"][case]
    assert got["supports"]
    assert got["tokens_equal_full"], "the cache changed the sharded model's tokens"
    assert got["tokens_equal_single"], "the sharded cached decoding differs from one device's"
    assert got["logprob_diff_full"] <= 1e-5 and got["logprob_diff_single"] <= 1e-5
    assert got["cached_heads"] == [LOCAL_KV_HEADS[case]]
    assert got["dtypes"] == ["torch.float32"]


def test_cached_greedy_under_tp_in_bf16(two_ranks):
    got = two_ranks["kv_cache"]["tiny-tp-bf16"]
    assert got["supports"] and got["tokens_equal_full"]
    assert got["logprob_diff_full"] <= 2e-2
    assert got["cached_heads"] == [1] and got["dtypes"] == ["torch.bfloat16"]


def test_pipeline_stages_and_context_parallel_decode_without_the_cache(two_ranks):
    assert two_ranks["kv_cache"]["refused"] == {"pp": False, "cp-ring": False}
