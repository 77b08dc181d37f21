"""The planner always answers (issue 32): a layout paratrain's runtime refuses is still priced and marked
`runtime_unsupported` with the rule; 'fits nowhere' only when memory is the reason, with the closest layout's
memory by part; a refused layout is never recommended, nor taken by `train --strategy auto`."""

from __future__ import annotations

import copy
import json

import pytest

from paratrain.models.presets import get_preset
from paratrain.plan import plan_report, search
from paratrain.plan.plan_cli import build_job, format_plan
from paratrain.plan.plan_report import plan_document
from paratrain.plan.search import Job, SearchResult

# GPT-3 175B as a transformers gpt2 config: tied head by default (Korthikanti et al. 2022, Table 5: 18.13 s/step)
GPT_175B = {"model_type": "gpt2", "n_layer": 96, "n_embd": 12288, "n_head": 96, "vocab_size": 51200,
            "n_positions": 2048}
ISSUE_LAYOUT = dict(gpu="a100-80", gpus=64, tp=8, pp=8, micro_batch=1, global_batch=64, seq_len=2048, ac="full")


def _plan(config: dict, tmp_path, **o):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    job, hw, fixed = build_job({"hf_config": str(path), **o})
    return job, plan_document(job, hw, fixed, top=5)


@pytest.mark.timeout(300)
def test_the_175b_tp8_pp8_fp16_layout_is_priced_and_names_the_rule(tmp_path):
    _, doc = _plan(GPT_175B, tmp_path, dtype="fp16", **ISSUE_LAYOUT)
    cands = doc["candidates"]
    assert cands and doc["recommended"] is None and not doc["fits"]
    assert doc["no_fit_reason"] == "runtime_unsupported"
    assert all(c["runtime_unsupported"] and c["step_time_s"] > 0 for c in cands)
    assert all(c["dims"]["tp"] == 8 and c["dims"]["pp"] == 8 for c in cands)
    assert any(c["feasible"] for c in cands)  # memory is not what stops it
    rule = doc["runtime_unsupported"]
    assert "fp16" in rule and rule in doc["message"] and "fits nowhere" not in doc["message"]
    text = format_plan(doc)
    assert "runtime_unsupported" in text and rule in text and "run it:" not in text


@pytest.mark.timeout(300)
def test_a_tied_head_under_pp_is_an_ordinary_candidate(tmp_path):
    """The runtime runs tied embeddings under pp (parallel/tied_weights.py): a tied-head GPT-2 preset under tp x pp
    is planned as an ordinary candidate. Megatron's 175B layout as a transformers config runs as transformers'
    modules (`--model hf:`), whose pipeline composes with data parallelism only: priced, marked with that rule
    alone (never a tied-head rule)."""
    from paratrain.parallel.layout import Layout
    from paratrain.train.hf_run_checks import check_hf_pipeline_layout

    job, hw, fixed = build_job({"model": "gpt2-124m", "gpu": "a100-80", "gpus": 8, "tp": 2, "pp": 4,
                                "micro_batch": 1, "global_batch": 8, "seq_len": 1024, "dtype": "bf16"})
    doc = plan_document(job, hw, fixed, top=5)
    best = doc["candidates"][0]
    assert job.args.tie_embeddings and best["step_time_s"] > 0
    assert best["runtime_unsupported"] is None and doc["recommended"] == 0, doc["message"]
    _, doc = _plan(GPT_175B, tmp_path, dtype="bf16", **ISSUE_LAYOUT)
    with pytest.raises(Exception) as rule:
        check_hf_pipeline_layout(Layout(tp=8, pp=8))
    assert doc["candidates"] and {c["runtime_unsupported"] for c in doc["candidates"]} == {str(rule.value)}


def test_fits_nowhere_shows_the_closest_layouts_memory_by_part():
    job, hw, fixed = build_job({"model": "llama-162m", "gpu": "rtx4090", "mem_gib": 1, "gpus": 1, "seq_len": 1024,
                                "global_batch": 8, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1, "dp_replicate": 1})
    doc = plan_document(job, hw, fixed, top=3)
    assert not doc["fits"] and doc["no_fit_reason"] == "memory"
    assert "fits nowhere" in doc["message"] and "closest" in doc["message"]
    assert all(part in doc["message"] for part in ("params", "grads", "optimizer"))
    assert doc["candidates"] and not doc["candidates"][0]["feasible"]


@pytest.fixture
def supported_and_refused(monkeypatch):
    """A real search on a small job, plus an injected copy of its best candidate marked refused and made 2x
    faster: the refused one must lose to the supported one everywhere."""
    from paratrain.plan.plan_cli import build_job as build

    job, hw, fixed = build({"model": "tiny", "gpu": "h100-sxm", "gpus": 2, "seq_len": 64, "global_batch": 8})
    real = search.search_all(job, hw, fixed)
    supported = real.feasible[0]
    refused = copy.deepcopy(supported)
    refused.runtime_unsupported = "an injected runtime rule"
    refused.time.step_s /= 2
    injected = SearchResult([refused, supported], [refused], [], real.examined)
    monkeypatch.setattr(search, "search_all", lambda *a, **k: injected)
    monkeypatch.setattr(plan_report, "search_all", lambda *a, **k: injected)
    return job, hw, fixed, supported


def test_a_refused_layout_is_never_recommended_over_a_runnable_one(supported_and_refused):
    job, hw, fixed, supported = supported_and_refused
    doc = plan_document(job, hw, fixed, top=5)
    assert doc["recommended"] == 0 and doc["fits"]
    assert all(c["runtime_unsupported"] is None for c in doc["candidates"])
    assert doc["candidates"][0]["step_time_s"] == supported.time.step_s


def test_auto_never_takes_a_refused_layout(supported_and_refused):
    job, hw, fixed, supported = supported_and_refused
    feasible, _, _ = search.search(job, hw, fixed)  # what plan/auto.py takes
    assert feasible == [supported]


def test_a_layout_that_cannot_be_priced_says_why():
    job = Job(args=get_preset("tiny"), model_name="tiny", gpus=8, seq_len=64, global_batch=8)
    from paratrain.plan.plan_cli import build_job as build

    _, hw, _ = build({"model": "tiny", "gpu": "h100-sxm", "gpus": 8})
    doc = plan_document(job, hw, {"tp": 8}, top=3)  # tiny has 4 heads: tp=8 splits nothing
    assert doc["no_fit_reason"] == "shape" and "does not divide" in doc["message"]
