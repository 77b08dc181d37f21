"""verify --generate: its comparison (verify/generate_parity.py) on crafted outputs, where the reference is the
first argument: equal runs pass; a logprob past 1e-4 or a token flipped with a clear top-2 gap fails and is named
as the first divergence; a token flipped at a near-tie (gap under 1e-5) is reported, not failed. And the command in
this process on one device (its layouts and a planted fault: test_generate_layouts.py)."""

from __future__ import annotations

import pytest

from paratrain.verify.generate_parity import compare_generations, describe_generation_divergence


def run(tokens, logprobs=None, gaps=None):
    n = len(tokens)
    return {"tokens": list(tokens), "logprobs": list(logprobs or [-1.0] * n), "gaps": list(gaps or [1.0] * n)}


def test_equal_runs_pass():
    report = compare_generations([run([1, 2, 3]), run([4, 5])], [run([1, 2, 3]), run([4, 5])], "fp32")
    assert report["passed"] and report["first_divergence"] is None and report["tokens_compared"] == 5
    assert describe_generation_divergence(report["first_divergence"]) is None


def test_a_logprob_past_the_tolerance_fails():
    reference = [run([1, 2, 3])]
    within = compare_generations(reference, [run([1, 2, 3], [-1.0, -1.0 + 5e-5, -1.0])], "fp32")
    assert within["passed"] and within["max_logprob_abs_diff"] == pytest.approx(5e-5)
    past = compare_generations(reference, [run([1, 2, 3], [-1.0, -1.0, -1.0 + 2e-4])], "fp32")
    assert not past["passed"]
    assert (past["first_divergence"]["kind"], past["first_divergence"]["position"]) == ("logprob", 2)


def test_a_flipped_token_is_named_with_both_tokens():
    report = compare_generations([run([1, 2, 3]), run([7, 8, 9])], [run([1, 2, 3]), run([7, 6, 0])], "fp32")
    assert not report["passed"]
    first = report["first_divergence"]
    assert (first["kind"], first["prompt"], first["position"], first["token_ref"], first["token"]) == \
        ("token", 1, 1, 8, 6)
    assert report["tokens_compared"] == 4  # the prompt is not compared past its divergence
    line = describe_generation_divergence(first)
    assert "prompt 1, new token 1" in line and "reference token 8" in line and "layout token 6" in line


def test_a_near_tie_is_reported_not_failed():
    reference = [run([1, 2, 3], gaps=[1.0, 5e-6, 1.0]), run([4, 5])]
    report = compare_generations(reference, [run([1, 9, 3]), run([4, 5])], "fp32")
    assert report["passed"] and report["first_divergence"] is None
    assert [(t["prompt"], t["position"], t["token_ref"], t["token"]) for t in report["near_ties"]] == [(0, 1, 2, 9)]


def test_a_run_that_ends_early_fails():
    report = compare_generations([run([1, 2, 3])], [run([1, 2])], "fp32")
    assert not report["passed"] and report["first_divergence"]["kind"] == "length"


def test_verify_generate_on_one_device_passes(cli_here):
    res = cli_here("verify", "--generate", "--strategy", "single", "--nproc", "1", "--device", "cpu",
                   "--max-new-tokens", "6", "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["mode"] == "generate" and doc["passed"] and doc["prompts"] == 4
    assert doc["tokens_compared"] == 24 and doc["max_logprob_abs_diff"] == 0.0
    assert "verify --generate PASSED" in res.stderr


def test_generate_options_need_verify_generate(cli_inproc):
    res = cli_inproc("verify", "--max-new-tokens", "8")
    assert res.returncode == 2 and "--max-new-tokens applies to verify --generate only" in res.stderr, res.stderr
