"""Data: the synthetic floor is exact, and the global batch order does not depend on the world size."""

import math

import numpy as np
import pytest
import torch

from paratrain.errors import UserError
from paratrain.train.data.indexed_sets import (
    BatchSource,
    Prefetcher,
    SyntheticMarkov,
    TokenFile,
    make_dataset,
)


def test_entropy_floor_is_the_empirical_conditional_entropy():
    ds = SyntheticMarkov(vocab_size=32, seq_len=256, seed=1)
    tokens = ds.samples(np.arange(400))
    counts = np.zeros((32, 32))
    np.add.at(counts, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
    probs = counts / counts.sum(1, keepdims=True).clip(min=1)
    row_h = -(np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1)), 0)).sum(1)
    weights = counts.sum(1) / counts.sum()
    empirical = float((weights * row_h).sum())
    assert abs(empirical - ds.entropy_floor()) < 0.02
    assert 0 < ds.entropy_floor() < math.log(32)


def test_samples_are_a_function_of_index_only():
    ds = SyntheticMarkov(vocab_size=64, seq_len=16, seed=5)
    whole = ds.samples(np.arange(10))
    part = ds.samples(np.arange(4, 10))
    assert np.array_equal(whole[4:], part)
    assert not np.array_equal(whole, SyntheticMarkov(64, 16, seed=6).samples(np.arange(10)))


@pytest.mark.parametrize("dp", [2, 4])
def test_global_batch_split_over_ranks_equals_single_device_batch(dp):
    ds = SyntheticMarkov(vocab_size=64, seq_len=8, seed=0)
    single = BatchSource(ds, global_batch=8, dp_rank=0, dp_size=1, micro_batch=8)
    ranks = [BatchSource(ds, 8, r, dp, micro_batch=2) for r in range(dp)]
    for _ in range(3):
        ref = single.next_step()[0]
        pieces = [torch.cat([mb.inputs for mb in src.next_step()]) for src in ranks]
        assert torch.equal(torch.cat(pieces), ref.inputs)
        assert torch.equal(ref.targets[:, :-1], ref.inputs[:, 1:])


def test_batch_source_rejects_indivisible_batches():
    ds = SyntheticMarkov(vocab_size=16, seq_len=8)
    with pytest.raises(UserError, match="not divisible by the data-parallel degree"):
        BatchSource(ds, 10, 0, 4, 1)
    with pytest.raises(UserError, match="micro-batch"):
        BatchSource(ds, 8, 0, 2, 3)


def test_prefetcher_yields_the_same_batches_and_resumes_exactly():
    ds = SyntheticMarkov(vocab_size=16, seq_len=8)
    direct = BatchSource(ds, 4, 0, 1, 2)
    expected = [direct.next_step() for _ in range(5)]
    src = BatchSource(ds, 4, 0, 1, 2)
    pf = Prefetcher(src)
    for step in range(3):
        got, _ = pf.next_step()
        assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(got, expected[step]))
    pf.close()
    assert src.state_dict() == {"step": 3}
    resumed = BatchSource(ds, 4, 0, 1, 2)
    resumed.load_state_dict(src.state_dict())
    assert torch.equal(resumed.next_step()[0].inputs, expected[3][0].inputs)


def test_token_bin_and_text_files(tmp_path):
    tokens = (np.arange(1000) % 300).astype(np.uint16)
    binfile = tmp_path / "train.bin"
    tokens.tofile(binfile)
    ds = make_dataset(str(binfile), vocab_size=512, seq_len=16, seed=0)
    s = ds.samples(np.arange(3))
    assert s.shape == (3, 17)
    assert all(np.array_equal(np.diff(row) % 300, np.ones(16)) or 299 in row for row in s)
    text = tmp_path / "corpus.txt"
    text.write_text("hello paratrain " * 20)
    tds = make_dataset(str(text), vocab_size=256, seq_len=8, seed=0)
    assert bytes(tds.samples(np.arange(1))[0].astype(np.uint8)).decode().replace(" ", "").isalpha()
    assert tds.entropy_floor() is None


def test_bad_data_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        make_dataset(str(tmp_path / "missing.bin"), 256, 8, 0)
    short = tmp_path / "short.bin"
    np.arange(5, dtype=np.uint16).tofile(short)
    with pytest.raises(UserError, match="tokens"):
        TokenFile(str(short), 256, 8)
    big = tmp_path / "big.bin"
    np.full(100, 400, dtype=np.uint16).tofile(big)
    with pytest.raises(UserError, match="vocab size"):
        TokenFile(str(big), 256, 8).samples(np.arange(1))
