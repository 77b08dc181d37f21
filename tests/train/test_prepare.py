"""`paratrain data prepare`: a tiny BPE tokenizer trained in memory, text files -> tokens.bin + sidecar -> train.

Reference: the tokenizer's own `encode` of each whole file (plus the end-of-text id) must equal the tokens on disk.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helpers import CLIResult
from paratrain.train.data.prepare_tokens import prepare_tokens
from reliability.inproc import run_cli_inproc

TEXTS = [
    "def add(a, b):\n    return a + b\n\n" * 40,
    "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n" * 30,
    "for i in range(10):\n    print(i * i)\n" * 50,
]


def make_tokenizer(directory, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return tok


@pytest.fixture
def corpus(tmp_path):
    files = []
    for i, text in enumerate(TEXTS):
        f = tmp_path / f"doc{i}.txt"
        f.write_text(text)
        files.append(f)
    return files


def test_tokens_equal_the_tokenizers_own_encoding(tmp_path, corpus):
    tok = make_tokenizer(tmp_path / "tok", 300)
    eot = tok.token_to_id("<|endoftext|>")
    # a small chunk size: large-file chunking (cut at line ends) must not change the tokens
    meta = prepare_tokens(tmp_path / "tok", corpus, tmp_path / "tokens.bin", chunk_chars=97)
    expected = [i for text in TEXTS for i in tok.encode(text).ids + [eot]]
    got = np.fromfile(tmp_path / "tokens.bin", dtype=np.uint16)
    assert got.tolist() == expected
    side = json.loads((tmp_path / "tokens.bin.json").read_text())
    assert side == meta
    assert side["vocab_size"] == tok.get_vocab_size() == 300 and side["dtype"] == "uint16"
    assert side["tokens"] == len(expected) and side["documents"] == 3 and side["eot_id"] == eot
    assert side["tokenizer_sha256"] == hashlib.sha256((tmp_path / "tok" / "tokenizer.json").read_bytes()).hexdigest()


def test_prepare_then_train_end_to_end(tmp_path, corpus):
    def cli(*args: str) -> CLIResult:  # in this process: one rank, no interpreter start
        return CLIResult(*run_cli_inproc(list(args), cwd=tmp_path))

    make_tokenizer(tmp_path / "tok", 300)
    res = cli("data", "prepare", "--tokenizer", "tok", *[p.name for p in corpus], "-o", "tokens.bin", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    tokens = res.json()["tokens"]
    run = cli("train", "--data", "tokens.bin", "--vocab-size", "320", "--strategy", "single", "--steps", "6",
              "--global-batch", "8", "--seq-len", "32", "--lr", "0.01", "--out", "run", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    steps_per_epoch = tokens / (8 * 32)
    assert f"{tokens:,} tokens" in run.stderr and f"one epoch = {steps_per_epoch:.1f} steps" in run.stderr
    doc = run.json()
    assert doc["data_tokens"] == tokens and doc["epochs"] == pytest.approx(6 / steps_per_epoch)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1


def test_tokenizer_vocab_larger_than_the_model_is_refused(cli_inproc, tmp_path, corpus):
    make_tokenizer(tmp_path / "tok", 300)
    assert cli_inproc("data", "prepare", "--tokenizer", "tok", corpus[0].name, "-o", "tokens.bin").returncode == 0
    res = cli_inproc("train", "--data", "tokens.bin", "--model", "tiny", "--strategy", "single", "--steps", "1")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "tokens.bin.json" in lines[0] and "300" in lines[0] and "256" in lines[0], res.stderr


def test_progress_bar_on_large_inputs(tmp_path, corpus, capsys):
    make_tokenizer(tmp_path / "tok", 300)
    prepare_tokens(tmp_path / "tok", corpus, tmp_path / "t.bin", progress=True)
    assert "tokenize" in capsys.readouterr().err
