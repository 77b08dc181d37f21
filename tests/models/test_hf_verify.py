"""verify on transformers models (--model hf:PATH): every strategy against the unwrapped model on one device.

One 4-rank launch (hf_verify_worker.py, gloo, CPU) verifies ddp, zero2, zero3, hsdp, tp, tp-sp, cp-ring, cp-ulysses
dp_shard 2 x tp 2 and pp 2 (1f1b) x dp 2 on tiny random Llama and Qwen2 configs, ddp and zero3 on Mistral (grouped-query) and GPT-2
(tied head), and a tied Llama 3.2-style config under tp-sp, dp_shard 2 x tp-sp 2, pp 2 (1f1b and interleaved 1f1b) x
dp 2, 2 steps each at fp32 tolerances (verify/compare.py). Then five planted bugs must be caught at step 1, named by
the transformers parameter or module they touch.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from reliability.inproc import launch_here

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the worker and the shared configs beside this file

from hf_configs import CONFIGS, write_config, write_tied_llama  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    for kind in CONFIGS:
        write_config(root, kind)
    write_tied_llama(root)
    from hf_verify_worker import NPROC, worker  # the ranks import it by name: HERE is on sys.path (above)

    # the ranks fork from this process's warm forkserver (reliability/inproc.py): no interpreter start per rank
    return json.loads(json.dumps(launch_here(worker, (str(root),), NPROC, timeout_s=90.0), default=str))


@pytest.mark.timeout(420)
def test_every_strategy_matches_one_device(runs):
    from hf_verify_worker import RUNS

    assert sorted(runs["clean"]) == sorted(f"{m}/{s}" for m, s in RUNS)
    for name, report in runs["clean"].items():
        assert report["passed"] is True and report["first_divergence"] is None, (name, report)
        assert report["checks"].get("lora") is (True if "/lora-" in name else None), name  # verify/lora_checks.py
        # activations were compared too, module by module, and differ only by float rounding
        assert report["compared"]["activations"] is True and report["max_act_rel_diff"] < 1e-5, (name, report)
    assert runs["clean"]["llama/dp_shard2xtp2"]["dims"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1,
                                                            "ep": 1, "tp": 2}
    assert runs["clean"]["qwen2/cp-ulysses"]["dims"]["cp"] == 4
    assert runs["clean"]["llama/pp-1f1b"]["dims"]["pp"] == 2 and runs["clean"]["llama/pp-1f1b"]["compared"]["model_parts"] == 1
    # the tied head: one sharded table under tp-sp (and FSDP over it), a summed copy on the last pipeline stage
    tied = {name: runs["clean"][f"llama-tied/{name}"] for name in ("tp-sp", "dp_shard2xtp-sp2", "pp-interleaved")}
    assert tied["tp-sp"]["dims"]["tp"] == 4 and tied["dp_shard2xtp-sp2"]["dims"]["dp_shard"] == 2
    assert tied["pp-interleaved"]["dims"]["pp"] == 2 and tied["pp-interleaved"]["compared"]["model_parts"] == 2


@pytest.mark.timeout(420)
def test_planted_bugs_are_caught_in_a_transformers_model(runs):
    bad = runs["mutated"]
    for name, report in bad.items():
        assert report["passed"] is False and report["first_divergence"]["step"] == 1, (name, report)
    where = {name: report["first_divergence"] for name, report in bad.items()}
    assert where["dp-grad-sum"]["differs"] == "grads"
    assert all(abs(p["grad_scale"] - 4.0) < 1e-3 for p in where["dp-grad-sum"]["parameters"])  # 4 ranks summed
    assert where["fsdp-skip-update"]["parameters"][0]["name"] == "hf.model.layers.0.mlp.gate_proj.weight"
    assert where["tp-row-no-reduce"]["module"] == "hf.model.layers.1.mlp"
    assert where["cp-rope-positions"]["module"] == "hf.model.layers.0.self_attn"
    # the tied copies' gradients not summed: each end stage holds only its own part of the table's gradient
    unsummed = where["tied-grad-not-summed"]
    assert unsummed["differs"] == "grads" and not unsummed["loss_differs"], unsummed
    assert unsummed["parameters"][0]["name"] == "hf.model.embed_tokens.weight", unsummed
