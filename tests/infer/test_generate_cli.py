"""`paratrain generate`'s contract, in this process (one device; the layouts are test_generate_layouts.py's): the
--json document and --out file of DESIGN.md, outputs in input order, the stderr summary, batching and the KV cache
that change no token, sampling streams that belong to the prompt, text prompts through a tokenizer with its
end-of-text token ending a row, and bad input refused in one line with exit 2."""

from __future__ import annotations

import json
import math

import pytest

from reliability.inproc import make_trainer, one_rank

SINGLE = ("--strategy", "single", "--nproc", "1", "--device", "cpu")
PROMPTS = [{"ids": [1, 2, 3, 4]}, {"ids": [9, 8]}, {"ids": [5, 6, 7, 8]}, {"ids": [200, 100, 50, 25, 12]}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """tiny, 6 steps on the Markov data, saved at step 6."""
    root = tmp_path_factory.mktemp("generate-cli")
    with one_rank() as rt:
        trainer = make_trainer(rt, steps=6, ckpt_every=6, ckpt_dir=str(root / "ckpt"), resume="never")
        trainer.fit()
        del trainer
    return str(root / "ckpt" / "step-6")


def prompts_file(folder, records=PROMPTS, name="prompts.jsonl"):
    path = folder / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def generate(cli_here, ckpt, *args):
    res = cli_here("generate", ckpt, *SINGLE, "--json", *args)
    assert res.returncode == 0, res.stderr
    return res


def test_json_document_out_file_and_summary(cli_here, ckpt, tmp_path):
    out = tmp_path / "out.jsonl"
    res = generate(cli_here, ckpt, "--prompts", prompts_file(tmp_path), "--max-new-tokens", "5", "--out", str(out))
    doc = res.json()
    assert {"outputs", "tokens_per_s", "ttft_s", "tpot_s", "peak_mem_gib", "layout"} <= set(doc)
    assert [o["prompt"] for o in doc["outputs"]] == [p["ids"] for p in PROMPTS]  # input order, ids as given
    for o in doc["outputs"]:
        assert set(o) == {"prompt", "tokens", "text", "logprobs"}
        assert len(o["tokens"]) == len(o["logprobs"]) == 5 and o["text"] is None  # a preset on ids: no tokenizer
        assert all(0 <= t < 256 for t in o["tokens"]) and all(lp <= 0 and math.isfinite(lp) for lp in o["logprobs"])
    assert doc["tokens_per_s"] > 0 and doc["ttft_s"] > 0 and doc["tpot_s"] > 0 and doc["peak_mem_gib"] > 0
    assert doc["layout"]["tp"] == 1 and doc["step"] == 6
    assert [json.loads(line) for line in out.read_text().splitlines()] == doc["outputs"]
    summary = res.stderr.strip().splitlines()[-1]
    for part in ("tokens/s", "time to first token", "per output token", "peak memory"):
        assert part in summary, summary


def test_batching_and_the_kv_cache_change_no_token(cli_here, ckpt, tmp_path):
    prompts = prompts_file(tmp_path)
    runs = [generate(cli_here, ckpt, "--prompts", prompts, "--max-new-tokens", "6", *extra).json()["outputs"]
            for extra in ((), ("--batch-size", "1"), ("--no-kv-cache",))]
    for other in runs[1:]:  # a batch's shape may change a kernel's summation order: the last bits
        assert [o["tokens"] for o in other] == [o["tokens"] for o in runs[0]]
        for mine, theirs in zip(runs[0], other):
            assert max(abs(a - b) for a, b in zip(mine["logprobs"], theirs["logprobs"])) <= 1e-5


def test_a_sampling_stream_belongs_to_its_prompt(cli_here, ckpt, tmp_path):
    """The same seed gives the same draws however the prompts are batched; another seed other draws."""
    prompts = prompts_file(tmp_path)

    def sampled(*extra):
        return [o["tokens"] for o in generate(cli_here, ckpt, "--prompts", prompts, "--max-new-tokens", "8",
                                              "--temperature", "1.0", "--top-k", "50", "--top-p", "0.95",
                                              *extra).json()["outputs"]]

    first = sampled("--seed", "3")
    assert sampled("--seed", "3", "--batch-size", "1") == first
    assert sampled("--seed", "4") != first
    greedy = [o["tokens"] for o in generate(cli_here, ckpt, "--prompts", prompts, "--max-new-tokens", "8")
              .json()["outputs"]]
    assert first != greedy


def word_tokenizer(folder, eos_id: int):
    """A word-level tokenizer.json over 256 ids whose end-of-text token </s> is `eos_id`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(256)]
    words[eos_id] = "</s>"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[eos_id - 1]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_text_prompts_and_the_end_of_text_token(cli_here, ckpt, tmp_path):
    """--prompt TEXT through --tokenizer; generated text decoded; a row ends at the tokenizer's end-of-text token
    (here the id greedy decoding gives third)."""
    ids = [3, 1, 4, 1, 5]
    plain = generate(cli_here, ckpt, "--prompts", prompts_file(tmp_path, [{"ids": ids}]), "--max-new-tokens", "6")
    tokens = plain.json()["outputs"][0]["tokens"]
    eos = tokens[2]
    stop = tokens.index(eos) + 1
    text = " ".join(f"w{i}" for i in ids)
    doc = generate(cli_here, ckpt, "--prompt", text, "--tokenizer", word_tokenizer(tmp_path / "tok", eos),
                   "--max-new-tokens", "6").json()
    out = doc["outputs"][0]
    assert out["prompt"] == text
    assert out["tokens"] == tokens[:stop]  # ended at </s>, included
    assert out["text"].split() == [f"w{i}" if i != eos else "</s>" for i in tokens[:stop]]


@pytest.mark.parametrize("args,needle", [
    (("--temperature", "0", "--top-k", "5"), "--temperature 0"),
    (("--temperature", "0.7", "--top-p", "1.5"), "--top-p"),
    (("--max-new-tokens", "2000"), "positions"),
    (("--prompt", "hello"), "tokenizer"),
    # pipeline generation runs one stage per rank (infer/pipeline_generate.py)
    (("--strategy", "pp", "--nproc", "2", "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2"),
     "one pipeline stage per rank"),
])
def test_bad_generate_options_are_one_line(cli_inproc, ckpt, tmp_path, args, needle):
    prompts = () if "--prompt" in args else ("--prompts", prompts_file(tmp_path))
    res = cli_inproc("generate", ckpt, *SINGLE, *prompts, *args)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and needle in res.stderr, res.stderr


@pytest.mark.parametrize("records,needle", [
    (['{"ids": [1, 2]}', '{"ids": [1, 2'], "line 2: not JSON"),
    (['{"ids": [1]}', '{"text": "a", "lang": "en"}'], "line 2: unknown key(s) 'lang'"),
    (['{"ids": []}'], "line 1: \"ids\" must be a non-empty list"),
    (['{"ids": [1, 256]}'], "line 1: token id 256 is outside"),
    (['{"ids": [1], "text": "a"}'], "line 1: give \"text\" or \"ids\", not both"),
    (['', '   '], "holds no prompt"),
    (['[1, 2]'], "line 1: expected a JSON object"),
])
def test_malformed_prompts_files_name_the_line(cli_inproc, ckpt, tmp_path, records, needle):
    res = cli_inproc("generate", ckpt, *SINGLE, "--prompts", prompts_file(tmp_path, records))
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and needle in res.stderr, res.stderr


def test_prompt_and_prompts_together_or_neither(cli_inproc, ckpt, tmp_path):
    for args in ((), ("--prompt", "a", "--prompts", prompts_file(tmp_path))):
        res = cli_inproc("generate", ckpt, *SINGLE, *args)
        assert res.returncode == 2 and "--prompt TEXT or --prompts FILE.jsonl" in res.stderr, res.stderr
