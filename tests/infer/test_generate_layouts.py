"""Issue 49's acceptance for `paratrain generate`: on checkpoints trained on the Markov data (tiny under ddp,
moe-tiny under ep), greedy decoding of 32 new tokens for a batch of 4 in fp32 gives the tokens of one device under
tp=2, dp=2, dp_shard=2, dp_shard 2 x tp 2 (4 ranks), dp=4 and ep=2, logprobs within 1e-4, with the KV cache and
(tp) without; seeded sampling gives the same tokens on every layout. verify --generate's comparison passes a
clean run and names the first divergence of a planted one. Issue 50: the same under pipeline stages, pp=2 (with
the KV cache and without, sampled) and pp 2 x dp_shard 2 (4 ranks), and verify --generate passes under both.

Reference: the 2-rank group's one-device generation of the same checkpoint (every rank alone). Run inside the shared
2- and 4-rank groups (tests/infer/generate_worker.py, tests/groups.py)."""

from __future__ import annotations

import math

import pytest

from support.generate_faults import FAULT_STEP

LOGPROB_ATOL = 1e-4
GREEDY_2 = ("tp", "dp", "dp_shard", "tp-no-cache", "pp", "pp-no-cache")
SAMPLED_2 = ("dp-sampled", "pp-sampled")  # prompts split over the ranks; tp: the 4-rank group's dp_shard 2 x tp 2


def assert_same(outputs: list[dict], reference: list[dict], name: str, report: dict) -> None:
    assert len(outputs) == len(reference) == report["prompts"], name
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert len(ref["tokens"]) == report["new_tokens"], (name, i)
        assert out["tokens"] == ref["tokens"], (name, i)
        worst = max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"]))
        assert worst <= LOGPROB_ATOL, (name, i, worst)


@pytest.fixture(scope="module")
def report(two_ranks):
    return two_ranks["generate"]


@pytest.fixture(scope="module")
def cases(report):
    return report["cases"]


def test_the_checkpoint_is_trained_not_random(cases):
    """The greedy tokens' mean logprob is far above a uniform guess over 256 tokens (-5.55): the chain was learned."""
    for name in ("single", "moe-single"):
        logprobs = [lp for out in cases[name] for lp in out["logprobs"]]
        assert sum(logprobs) / len(logprobs) > -2.5, name
        assert all(lp <= 0 and math.isfinite(lp) for lp in logprobs)


@pytest.mark.parametrize("layout", GREEDY_2)
def test_greedy_tokens_equal_one_device(report, cases, layout):
    assert_same(cases[layout], cases["single"], layout, report)


def test_greedy_tokens_equal_one_device_under_expert_parallel(report, cases):
    assert_same(cases["moe-ep"], cases["moe-single"], "moe-ep", report)


@pytest.mark.parametrize("layout", SAMPLED_2)
def test_seeded_sampling_equals_one_device(report, cases, layout):
    assert_same(cases[layout], cases["single-sampled"], layout, report)


def test_seeded_sampling_equals_one_device_under_expert_parallel(report, cases):
    assert_same(cases["moe-ep-sampled"], cases["moe-single-sampled"], "moe-ep-sampled", report)


def test_sampling_samples(cases):
    """Temperature 0.8 and top-p 0.9 leave the greedy path somewhere in 4 x 32 tokens."""
    assert [o["tokens"] for o in cases["single-sampled"]] != [o["tokens"] for o in cases["single"]]


def test_four_rank_meshes_equal_one_device(four_ranks, report, cases):
    """The 4-rank group's layouts against the 2-rank group's one-device run of the same checkpoint."""
    four = four_ranks["generate"]["cases"]
    assert_same(four["dp_shard2xtp2"], cases["single"], "dp_shard2xtp2", report)
    assert_same(four["dp4"], cases["single"], "dp4", report)
    assert_same(four["pp2xdp_shard2"], cases["single"], "pp2xdp_shard2", report)
    assert_same(four["dp_shard2xtp2-sampled"], cases["single-sampled"], "dp_shard2xtp2-sampled", report)


def assert_clean(clean: dict) -> None:
    assert clean["passed"] and clean["first_divergence"] is None, clean
    assert clean["tokens_compared"] == clean["prompts"] * clean["max_new_tokens"]
    assert clean["max_logprob_abs_diff"] <= clean["tolerance"]["logprob_atol"]


def test_verify_generate_passes_a_clean_layout(two_ranks):
    assert_clean(two_ranks["generate"]["verify"]["clean"])


def test_verify_generate_passes_under_pipeline_stages(two_ranks, four_ranks):
    """pp=2, and pp 2 x dp_shard 2 whose default prompts give a replica filler micro-batches."""
    two, four = two_ranks["generate"]["verify"]["pp"], four_ranks["generate"]["verify"]["pp2xdp_shard2"]
    assert (two["dims"]["pp"], four["dims"]["pp"], four["dims"]["dp_shard"]) == (2, 2, 2)
    assert two["kv_cache"] and four["kv_cache"]  # each stage through its own cache
    assert_clean(two)
    assert_clean(four)


def test_verify_generate_names_the_first_divergence_of_a_planted_fault(two_ranks):
    """generate_faults lifts the runner-up at each rank's decoding step FAULT_STEP of the dp_shard=2 run: rank 0's
    first batch holds prompts 0 and 2 (one length), rank 1's prompt 1; the first divergence in prompt order is
    prompt 0's new token FAULT_STEP - 1."""
    fault = two_ranks["generate"]["verify"]["fault"]
    assert not fault["passed"]
    first = fault["first_divergence"]
    assert (first["kind"], first["prompt"], first["position"]) == ("token", 0, FAULT_STEP - 1), first
    assert first["token"] != first["token_ref"] and first["gap"] >= fault["tolerance"]["tie_gap"]
    assert fault["near_ties"] == []
