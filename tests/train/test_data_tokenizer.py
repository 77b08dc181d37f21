"""`paratrain data tokenizer`: a byte-level BPE tokenizer.json trained on the user's own text, that `data prepare`
then uses. Reference: the text decoded from the prepared tokens is the text that went in."""

from __future__ import annotations

import json

import numpy as np
import pytest

TEXTS = ["The quick brown fox jumps over the lazy dog.\n" * 50, "def add(a, b):\n    return a + b\n" * 40 + "é ✓\n"]


@pytest.fixture
def texts(tmp_path):
    files = []
    for i, text in enumerate(TEXTS):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(text)
    return files


def test_a_trained_tokenizer_prepares_tokens_that_decode_to_the_text(cli_inproc, tmp_path, texts):
    from tokenizers import Tokenizer

    res = cli_inproc("data", "tokenizer", *map(str, texts), "--vocab-size", "300", "-o", "tok", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["tokenizer"] == "tok/tokenizer.json" and 257 < doc["vocab_size"] <= 300 and doc["eot"] == "<|endoftext|>"
    assert [s["bytes"] for s in doc["sources"]] == [f.stat().st_size for f in texts]
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.get_vocab_size() == doc["vocab_size"]
    assert "vocab" in res.stderr and "tok/tokenizer.json" in res.stderr

    res = cli_inproc("data", "prepare", "--tokenizer", "tok", *map(str, texts), "-o", "tokens.bin", "--json")
    assert res.returncode == 0, res.stderr
    meta = json.loads(res.stdout)
    assert meta["eot_id"] == 0 and meta["vocab_size"] == doc["vocab_size"]
    ids = np.fromfile(tmp_path / "tokens.bin", dtype=meta["dtype"]).tolist()
    assert ids.count(0) == len(texts) and meta["tokens"] < sum(len(t.encode()) for t in TEXTS) / 2  # merges learned
    documents, start = [], 0
    for end in (i for i, t in enumerate(ids) if t == 0):
        documents.append(tok.decode(ids[start:end]))
        start = end + 1
    assert documents == TEXTS  # byte-level: every character round-trips, the non-ASCII ones too


def test_the_vocabulary_stops_where_the_text_has_nothing_left_to_merge(cli_inproc, tmp_path):
    (tmp_path / "a.txt").write_text("ab ab ab\n" * 20)
    res = cli_inproc("data", "tokenizer", "a.txt", "-o", "tok", "--json")  # default --vocab-size 8192
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["requested_vocab_size"] == 8192 and 257 < doc["vocab_size"] < 270


@pytest.mark.parametrize("args, message", [
    (["a.txt", "--vocab-size", "100", "-o", "tok"], "--vocab-size 100: give 257"),
    (["missing.txt", "-o", "tok"], "input file not found: missing.txt"),
    (["a.txt", "-o", "a.txt"], "-o a.txt: exists and is not a directory"),
    (["bad.txt", "-o", "tok"], "bad.txt: cannot read it: 'utf-8' codec can't decode byte 0xff"),
    (["empty.txt", "-o", "tok"], "empty.txt: holds no documents (the file is empty)"),
    (["a.txt", "-o", "tok", "--text-field", "b.txt=body"], "b.txt names none of the sources (a.txt)"),
])
def test_bad_input_is_one_line_and_exit_2(cli_inproc, tmp_path, args, message):
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "bad.txt").write_bytes(b"not utf-8: \xff\xfe\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    res = cli_inproc("data", "tokenizer", *args)
    assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "tok").exists()
