"""`plan` on transformers' own real-size default configs (issue 51): it answers, and counts exactly the parameters
transformers builds from the config (on the meta device: shapes only, no memory). Llama 4 (text) and Qwen3-Next
were counted as dense models of 11.1 B and 2.7 B; transformers builds 107.8 B and 79.7 B. The coverage run
(benchmarks/hf_coverage.py) has the whole family list; here a sample of decoder families, MoE and dense."""

from __future__ import annotations

import json

import pytest

FAMILIES = ["llama4_text", "qwen3_next", "deepseek_v3", "gpt_oss", "qwen2_moe", "mixtral", "gemma3_text", "llama",
            "glm4_moe"]
# one layout fixed (nothing searched): FSDP over 8 GPUs, short sequences; only the counts are checked here
ONE_LAYOUT = ("--gpu", "h100-sxm", "--gpus", "8", "--strategy", "zero3", "--dp-shard", "8", "--tp", "1", "--pp", "1",
              "--cp", "1", "--ep", "1", "--micro-batch", "1", "--ac", "full", "--seq-len", "1024", "--global-batch",
              "8", "--top", "1", "--json")


def built(model_type: str):
    """transformers' default config of the family and its causal LM built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_plan_counts_what_transformers_builds(model_type, tmp_path, cli_inproc):
    config, model = built(model_type)
    config.save_pretrained(tmp_path)
    res = cli_inproc("plan", "--hf-config", str(tmp_path), *ONE_LAYOUT)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["model"]["params"] == model.num_parameters()
    assert doc["model"]["params_counted_by"].startswith("transformers")
    assert doc["candidates"] and doc["candidates"][0]["step_time_s"] > 0


def test_an_moe_counts_its_active_parameters_by_the_experts_shapes(tmp_path, cli_inproc):
    """Mixtral's 8 experts, top-2: a token uses a quarter of each MoE layer's routed experts (12.9 B of 46.7 B)."""
    config, model = built("mixtral")
    config.save_pretrained(tmp_path)
    doc = json.loads(cli_inproc("plan", "--model", f"hf:{tmp_path}", *ONE_LAYOUT).stdout)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert doc["model"]["active_params"] == model.num_parameters() - experts + experts * 2 // 8
    assert 12.8e9 < doc["model"]["active_params"] < 13.0e9
