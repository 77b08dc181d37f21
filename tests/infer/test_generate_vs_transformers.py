"""`paratrain generate` against transformers' own generate(do_sample=False) on the exported model (issue 49).

For each preset family (Llama-style tiny, GPT-2 tiny, the MoE moe-tiny, exported as LlamaForCausalLM,
GPT2LMHeadModel and MixtralForCausalLM): trained for some steps on the Markov data (not random weights), exported
by `paratrain export`, then 32 greedy tokens for a batch of 4 prompts from paratrain's checkpoint, with the KV cache
and without it, and from transformers on the export. Tokens identical, logprobs within 1e-4 (fp32). A mismatch at
a position whose top-2 logit gap (transformers') is under 1e-5 is a near-tie either side may break: it is reported
(a warning), not failed, and that row is compared up to there.

All in this process (run_cli_inproc, --nproc 1): no interpreter or worker start.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

from reliability.inproc import run_cli_inproc

transformers = pytest.importorskip("transformers")

NEW_TOKENS, PROMPT_LEN, BATCH = 32, 8, 4
LOGPROB_ATOL = 1e-4
NEAR_TIE = 1e-5
PRESETS = ("tiny", "gpt2-tiny", "moe-tiny")


def cli(root: Path, *args: str) -> str:
    code, out, err = run_cli_inproc(list(args), cwd=root)
    assert code == 0, err[-3000:]
    return out


def prompts_file(root: Path) -> list[list[int]]:
    rng = random.Random(49)
    prompts = [[rng.randrange(256) for _ in range(PROMPT_LEN)] for _ in range(BATCH)]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    return prompts


def transformers_greedy(folder: Path, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """(new tokens per prompt, their logits (batch, new tokens, vocab)) from transformers' generate."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, PROMPT_LEN:].tolist(), torch.stack(out.logits, dim=1).float()


def compare(ours: dict, tokens: list[list[int]], logits: torch.Tensor, label: str) -> int:
    """Token for token and logprob for logprob; the number of tokens compared. A near-tie mismatch is reported."""
    logprobs = logits.log_softmax(-1)
    compared = 0
    for row, (out, theirs) in enumerate(zip(ours["outputs"], tokens, strict=True)):
        assert len(out["tokens"]) == NEW_TOKENS
        for t, (mine, their) in enumerate(zip(out["tokens"], theirs, strict=True)):
            if mine != their:
                top2 = logits[row, t].topk(2).values
                gap = float(top2[0] - top2[1])
                assert gap < NEAR_TIE, f"{label}: prompt {row} token {t}: {mine} against transformers' {their} " \
                                       f"(top-2 logit gap {gap:.2e})"
                warnings.warn(f"{label}: prompt {row} token {t}: a near-tie (gap {gap:.1e}) broken the other way",
                              stacklevel=2)
                break
            assert abs(out["logprobs"][t] - float(logprobs[row, t, their])) <= LOGPROB_ATOL, (label, row, t)
            compared += 1
    return compared


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_generate_equals_transformers_on_the_export(tmp_path, preset):
    prompts = prompts_file(tmp_path)
    cli(tmp_path, "train", "--model", preset, "--nproc", "1", "--steps", "40", "--seq-len", "64", "--ckpt-every",
        "40", "--ckpt-dir", "ck", "--resume", "never", "--out", "run")
    cli(tmp_path, "export", "ck", "-o", "hf")
    docs = {flag: json.loads(cli(tmp_path, "generate", "ck", "--prompts", "prompts.jsonl", "--max-new-tokens",
                                 str(NEW_TOKENS), "--nproc", "1", flag, "--json"))
            for flag in ("--kv-cache", "--no-kv-cache")}
    assert docs["--kv-cache"]["kv_cache"] and not docs["--no-kv-cache"]["kv_cache"]
    # with and without the cache: the same tokens, logprobs within fp32 rounding of the two attention orders
    for cached, whole in zip(docs["--kv-cache"]["outputs"], docs["--no-kv-cache"]["outputs"], strict=True):
        assert cached["tokens"] == whole["tokens"]
        assert max(abs(a - b) for a, b in zip(cached["logprobs"], whole["logprobs"])) <= 1e-5
    tokens, logits = transformers_greedy(tmp_path / "hf", prompts)
    # most of the 128 tokens are compared: near-ties are rare on a trained model
    assert compare(docs["--kv-cache"], tokens, logits, preset) >= BATCH * NEW_TOKENS // 2
