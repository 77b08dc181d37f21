# The KV cache under tensor parallelism, run in the suite's shared 2-rank group (tests/groups.py, dp_worker.py's
# "kv_cache"): each rank caches its local heads; greedy decoding through the cache must equal the cache-free
# decoding of the same sharded model and of the unsharded model on one device (fp32).
"""By hand: torchrun --standalone --nproc-per-node 2 tests/parallel/dp_worker.py SPEC.json, SPEC {"kv_cache": true}."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_decode import greedy_cached, greedy_full  # noqa: E402

from paratrain.config import TrainConfig  # noqa: E402
from paratrain.infer.kv_cache import forward_step, new_cache, supports_cache  # noqa: E402
from paratrain.train.step import autocast_context  # noqa: E402
from paratrain.train.trainer import Trainer  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7], [200, 1, 2], [9, 9, 9, 9]]
NEW_TOKENS = 8
# every family's model under tp (loss parallel: the head's logits vocab-sharded), GPT-2 also under tp-sp, the MoE
# under ep (FSDP over both ranks, experts split), a transformers Llama under tp; FSDP and DDP wrappers; tp in bf16
CASES = {"tiny-tp": {"strategy": "tp"}, "gpt2-tiny-tp": {"strategy": "tp", "model": "gpt2-tiny"},
         "tiny-fsdp": {"strategy": "zero3"}, "gpt2-tiny-ddp": {"strategy": "ddp", "model": "gpt2-tiny"},
         "gpt2-tiny-tp-sp": {"strategy": "tp-sp", "model": "gpt2-tiny"},
         "moe-tiny-ep": {"strategy": "ep", "model": "moe-tiny"}, "hf-llama-tp": {"strategy": "tp", "model": "hf"},
         "tiny-tp-bf16": {"strategy": "tp", "dtype": "bf16"}}
HF_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
            "attention_dropout": 0.0}


def reference_model(trainer: Trainer):
    """The model on one device with the trainer's initial weights (built once from the seed, as verify's)."""
    from paratrain.models.hf_model import build_hf_model
    from paratrain.models.presets import build_model

    cfg = trainer.cfg
    if cfg.model.startswith("hf:"):
        return build_hf_model(cfg.model, seed=cfg.seed).eval()
    return build_model(trainer.args, "cpu", seed=cfg.seed).eval()


def trainer_for(rt, **overrides) -> Trainer:
    cfg = TrainConfig(**{"nproc": rt.world_size, "device": "cpu", "steps": 1, "metrics": False, "resume": "never",
                         "timeout_s": 120.0, "seq_len": 32, **overrides})
    return Trainer(cfg, rt, quiet=True)


def check(rt, overrides: dict, folder: str) -> dict:
    if overrides.get("model") == "hf":
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(HF_LLAMA, f)
        overrides = {**overrides, "model": f"hf:{folder}"}
    trainer = trainer_for(rt, **overrides)
    cfg, parts = trainer.cfg, trainer.step_runner.model_parts
    for part in parts:
        part.eval()
    with autocast_context("cpu", cfg.dtype, cfg.dtype != "fp32"):  # as the generate loop runs bf16
        cached = greedy_cached(parts, PROMPTS, NEW_TOKENS, trainer.layout)
        full = [greedy_full(parts[0], p, NEW_TOKENS) for p in PROMPTS]
        one = reference_model(trainer)
        single = [greedy_full(one, p, NEW_TOKENS) for p in PROMPTS]
        keys = cached_keys(parts, trainer.layout)
    return {"supports": supports_cache(parts), "tokens_equal_full": tokens(cached) == tokens(full),
            "tokens_equal_single": tokens(cached) == tokens(single), "logprob_diff_full": logprob_diff(cached, full),
            "logprob_diff_single": logprob_diff(cached, single),
            "cached_heads": sorted({t.shape[1] for t in keys}), "dtypes": sorted({str(t.dtype) for t in keys})}


def tokens(decoded: list) -> list:
    return [ids for ids, _ in decoded]


def logprob_diff(decoded: list, reference: list) -> float:
    return max(abs(a - b) for (_, mine), (_, ref) in zip(decoded, reference) for a, b in zip(mine, ref))


def cached_keys(parts, layout) -> list[torch.Tensor]:
    """The keys one prefill step caches on this rank (their head count: local under tp)."""
    cache = new_cache(parts, 1, 4, layout)
    forward_step(parts, torch.tensor([[1, 2, 3]]), torch.arange(3), cache)
    if cache.hf is not None:
        return [layer.keys for layer in cache.hf.layers]
    return list(cache.keys.values())


def run_checks(rt) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        report = {name: check(rt, overrides, folder) for name, overrides in CASES.items()}
    # where the cache cannot serve: a pipeline stage, context parallelism's ring attention
    report["refused"] = {strategy: supports_cache(trainer_for(rt, strategy=strategy).step_runner.model_parts)
                         for strategy in ("pp", "cp-ring")}
    return report

