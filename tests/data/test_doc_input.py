"""What a new user meets on the document path (issue 44): an empty source, a mixture written wrong and a corrupted
Parquet file are one exact error line each (exit 2); --text-field names each source's column
(NAME or SOURCE=NAME,...), from the CLI and from TOML; `data tokenizer` reads documents as `train` does.
All in this process, refused before any worker starts (or never starting one)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.train.data.doc_sources import parse_sources
from paratrain.train.data.source import make_train_data
from support.doc_corpus import make_corpus

pytest.importorskip("datasets")
SMALL = ["--vocab-size", "320", "--seq-len", "16", "--global-batch", "2", "--steps", "1"]
SYNTAX = "a mixture is written A:w,B:w, e.g. 'web/*.jsonl:0.7,code.parquet:0.3'"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def here(tmp_path, corpus):
    """The corpus's files in the test's directory (the CLI's), plus code.parquet: a.jsonl's texts in a `content`
    column, and the same texts as `text` in same.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("a.jsonl", "b.parquet"):
        shutil.copy(corpus[name[0]], tmp_path / name)
    shutil.copytree(corpus["tok"], tmp_path / "tok")
    texts = [json.loads(line)["text"] for line in open(corpus["a"])]
    pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}), tmp_path / "code.parquet")
    pq.write_table(pa.table({"text": texts}), tmp_path / "same.parquet")
    return tmp_path


def one_error(res) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.parametrize("data", ["empty.jsonl", "a.jsonl:0.5,empty.jsonl:0.5"])
def test_an_empty_source_alone_or_in_a_mixture_is_one_line_naming_it(cli_inproc, here, data):
    (here / "empty.jsonl").write_text("")
    res = cli_inproc("train", "--data", data, "--tokenizer", "tok", *SMALL)
    assert one_error(res) == "error: --data empty.jsonl: holds no documents (the file is empty)"


@pytest.mark.parametrize("data, why", [
    ("a.jsonl:0.7;b.parquet:0.3", "sources are separated by ','"),
    ("a.jsonl=0.7", "a weight follows ':'"),
    ("a.jsonl:x", "the weight 'x' is not a number"),
])
@pytest.mark.parametrize("tokenizer", [[], ["--tokenizer", "tok"]])
def test_a_mixture_written_wrong_shows_the_syntax(cli_inproc, here, data, why, tokenizer):
    res = cli_inproc("train", "--data", data, *tokenizer, *SMALL)
    assert one_error(res) == f"error: --data {data}: no such file ({why}); {SYNTAX}"


def test_an_existing_file_with_a_colon_or_equals_in_its_name_is_read(here):
    """The mixture check only speaks when no such file exists."""
    for name in ("x:y.jsonl", "lang=en.jsonl"):
        shutil.copy(here / "a.jsonl", here / name)
        assert [s.files for s in parse_sources(str(here / name))] == [(str(here / name),)]


def test_a_corrupted_parquet_file_is_reported_once(cli_inproc, here, caplog):
    """`datasets` logs the failure before raising it (on its own handler and, propagated, on ours): the user
    saw it three times. Now no record of it is emitted, and the error line is the only line."""
    (here / "bad.parquet").write_bytes((here / "b.parquet").read_bytes()[:300] + b"garbage")
    res = cli_inproc("train", "--data", "bad.parquet", "--tokenizer", "tok", *SMALL)
    assert one_error(res) == ("error: --data bad.parquet: cannot read it: Parquet magic bytes not found in footer. "
                              "Either the file is corrupted or this is not a parquet file.")
    assert not [r for r in caplog.records if r.name.startswith("datasets")]


def test_text_field_forms():
    from paratrain.interop.text_fields import fields_for, parse_text_field

    assert parse_text_field("body") == ("body", {})
    assert parse_text_field("a.jsonl=text, code=content") == ("text", {"a.jsonl": "text", "code": "content"})
    assert parse_text_field("content,a.jsonl=text") == ("content", {"a.jsonl": "text"})
    assert parse_text_field("lang=en/x.parquet=body") == ("text", {"lang=en/x.parquet": "body"})
    sources = ["web/a.jsonl", "code.parquet"]
    for value in ("web/a.jsonl=body", "a.jsonl=body", "a=body"):  # as written, its file name, its stem
        assert fields_for(sources, value) == ["body", "text"], value
    assert fields_for(sources, "content,a=text") == ["text", "content"]
    for value, message in [("a=", "give NAME, or SOURCE=NAME"), ("=x", "give NAME"), ("a=x,,b=y", "give NAME"),
                           ("x,y", "two fields"), ("a=x,a=y", "a is named twice"),
                           ("zz=x", "zz names none of the sources (web/a.jsonl, code.parquet)")]:
        with pytest.raises(UserError, match=re.escape(message)):
            fields_for(sources, value)
    with pytest.raises(UserError, match="a.jsonl and a both name the source web/a.jsonl"):
        fields_for(sources, "a.jsonl=x,a=y")
    with pytest.raises(UserError, match="names several sources"):
        fields_for(["x/a.jsonl", "y/a.jsonl"], "a.jsonl=body")


def config(here, **overrides) -> TrainConfig:
    base = {"strategy": "single", "tokenizer": str(here / "tok"), "vocab_size": 320, "seq_len": 32,
            "global_batch": 4, "device": "cpu"}
    return TrainConfig(**{**base, **overrides})


def test_each_source_reads_its_own_text_field(here):
    """a.jsonl ('text') mixed with code.parquet ('content'), --text-field code.parquet=content: the same global
    batches as the mixture with same.parquet, which holds the same texts as 'text'."""
    reference = make_train_data(config(here, data=f"{here}/a.jsonl:0.6,{here}/same.parquet:0.4"), 320)
    for field in ("code.parquet=content", "code=content", f"{here}/code.parquet=content", "content,a.jsonl=text"):
        data = make_train_data(config(here, data=f"{here}/a.jsonl:0.6,{here}/code.parquet:0.4", text_field=field), 320)
        data.check()
        streams = reference.open(), data.open()
        for _ in range(3):
            want, got = (s.next_global_batch(4) for s in streams)
            assert all(np.array_equal(want[k], got[k]) for k in want), field
        assert min(streams[1].state.tokens_drawn) > 0  # both sources were read


def test_the_missing_field_error_shows_both_forms(cli_inproc, here):
    res = cli_inproc("train", "--data", "a.jsonl:0.7,code.parquet:0.3", "--tokenizer", "tok", *SMALL)
    assert one_error(res) == ("error: --data code.parquet: a record has no field 'text' (it has content, id); name "
                              "its text column with --text-field content, or --text-field code.parquet=content for "
                              "this source alone")
    res = cli_inproc("train", "--data", "a.jsonl:0.7,code.parquet:0.3", "--tokenizer", "tok", "--text-field",
                     "b.parquet=content", *SMALL)
    assert one_error(res) == ("error: --text-field 'b.parquet=content': b.parquet names none of the sources (a.jsonl, "
                              "code.parquet); give NAME, or SOURCE=NAME,SOURCE=NAME (SOURCE: a --data entry as "
                              "written, or its file name)")


def test_the_per_source_form_round_trips_through_print_config_and_toml(cli_inproc, here):
    res = cli_inproc("train", "--text-field", "code.parquet=content,a.jsonl=text", "--print-config")
    assert res.returncode == 0 and 'text_field = "code.parquet=content,a.jsonl=text"\n' in res.stdout
    (here / "run.toml").write_text(res.stdout)
    again = cli_inproc("train", "--config", "run.toml", "--print-config")
    assert again.returncode == 0 and again.stdout == res.stdout
    (here / "bad.toml").write_text('text_field = "code.parquet="\n')
    assert one_error(cli_inproc("train", "--config", "bad.toml", "--print-config")) == (
        "error: --text-field 'code.parquet=': give NAME, or SOURCE=NAME,SOURCE=NAME (SOURCE: a --data entry as "
        "written, or its file name)")


def test_data_tokenizer_reads_records_as_train_does(cli_inproc, here):
    """JSON Lines + Parquet (with its own --text-field): each record's text is a document, so no learned token
    holds JSON syntax or a field name, and the counts are the records'. (Before: the Parquet file failed as
    'not valid UTF-8', and a JSON Lines file alone taught '{"', '":' and 'text'.)"""
    from tokenizers import Tokenizer

    res = cli_inproc("data", "tokenizer", "a.jsonl", "b.parquet", "code.parquet", "--text-field", "code=content",
                     "--vocab-size", "400", "-o", "mine", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert [s["documents"] for s in doc["sources"]] == [120, 80, 120]
    tok = Tokenizer.from_file(str(here / "mine" / "tokenizer.json"))
    learned = [tok.decode([i]) for token, i in tok.get_vocab().items() if len(token) > 1 and i != 0]  # 0: EOT
    assert len(learned) > 40 and all(text.replace(" ", "").isalpha() for text in learned), learned
    assert tok.token_to_id("text") is None and tok.token_to_id("Ġcat") is not None
    res = cli_inproc("data", "tokenizer", "a.jsonl", "code.parquet", "-o", "mine")
    assert one_error(res) == ("error: code.parquet: a record has no field 'text' (it has content, id); name its "
                              "text column with --text-field content, or --text-field code.parquet=content for this "
                              "source alone")
