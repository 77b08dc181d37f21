"""The doctor's data_loading finding on document data names the fixes that exist: more --data-workers, or
tokenizing once (`data prepare`) and training on the .bin. Contexts built as in tests/doctor/test_doctor_units.py.

End to end: a run whose on-the-fly tokenizer is slow (support/slow_tokenizer.py, a sleep per document) gets the
data_loading finding from `paratrain doctor`; the same run on the data pre-tokenized as the finding says
(`paratrain data prepare ... -o tokens.bin`, then --data tokens.bin) does not.
"""

from __future__ import annotations

import pytest

from doctor.test_doctor_units import capture, context
from helpers import plugin_env
from paratrain.doctor.rules import diagnose
from support.doc_corpus import make_corpus

# what these tests measure is a share of a step's time: under -n no other test runs beside them (conftest.py)
pytestmark = pytest.mark.alone


def test_data_loading_fix_names_workers_and_pre_tokenized_data():
    slow = [capture(iteration=0.2, data=0.1)]
    finding = diagnose(context(slow, data="docs.jsonl", tokenizer="tok"))[0]
    assert finding.cause == "data_loading"
    assert "--data-workers" in finding.fix and "data prepare" in finding.fix and "tokens.bin" in finding.fix
    plain = diagnose(context(slow))[0]
    assert "--data-workers" not in plain.fix and ".bin" in plain.fix


def data_loading(cli, data: str) -> list[dict]:
    # 8 steps: the first batches are tokenized before any step is timed, at the fixed delay alone; the later ones
    # at 3 x the longest step (support/step_share.py), which a busy machine's slow steps cannot outgrow
    res = cli("doctor", "--json", "--timeout-s", "120", "--strategy", "single", "--nproc", "1", "--model", "tiny",
              "--seq-len", "64", "--global-batch", "4", "--vocab-size", "320", "--steps", "8", "--data", data,
              "--tokenizer", "corpus/tok", timeout=240,
              env=plugin_env("support.slow_tokenizer:plugin", PARATRAIN_TEST_TOKENIZE_DELAY_S="0.01",
                             PARATRAIN_TEST_DELAY_STEP_SHARE="3"))
    assert res.returncode == 0, res.stderr[-3000:]
    return [f for f in res.json()["findings"] if f["cause"] == "data_loading"]


@pytest.mark.timeout(300)
def test_pre_tokenized_data_removes_the_slow_tokenizers_finding(cli_here, tmp_path):
    cli = cli_here  # one rank, in this process: no interpreter start
    pytest.importorskip("datasets")
    corpus = make_corpus(tmp_path / "corpus")
    slow = data_loading(cli, corpus["a"])
    assert slow and slow[0]["severity"] in ("high", "medium"), slow
    fix = slow[0]["fix"]
    assert "paratrain data prepare" in fix and "--data tokens.bin" in fix
    prepared = cli("data", "prepare", "--tokenizer", "corpus/tok", corpus["a"], "-o", "tokens.bin")
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert data_loading(cli, "tokens.bin") == []
