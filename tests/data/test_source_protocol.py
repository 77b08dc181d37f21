"""The Source protocol (train/data/source.py): every kind of data implements it with the protocol's own
signatures (indexed sets, a data function, the document stream, a user's torch data), and a class of one's own
that implements nothing else trains through Trainer.fit, checkpoints its position and resumes from it, with the
losses of the same rows given as a data function."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from paratrain.config import TrainConfig
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.custom import CustomModel, FunctionDataset
from paratrain.train.data.indexed_sets import Batch, SyntheticMarkov, TokenFile
from paratrain.train.data.source import RankSource, Source, StepLoader, make_train_data
from paratrain.train.data.torch_data import TorchData
from paratrain.train.runtime import Runtime
from paratrain.train.trainer import Trainer
from support.doc_corpus import make_corpus

VOCAB, SEQ = 64, 8


def row(index: int) -> torch.Tensor:
    """Global sample `index`: seq_len + 1 tokens, a pure function of it."""
    return (torch.arange(SEQ + 1) * 5 + index * 11) % VOCAB


def rows(indices) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.stack([row(int(i)) for i in indices])
    return tokens[:, :-1], tokens[:, 1:]


class Samples(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        tokens = row(i)
        return tokens[:-1], tokens[1:]


# -- a user's own source: the protocol's members and nothing else ----------------------------------------------
class CountingRows:
    """Step t's global batch is samples t*G .. t*G+G-1 (row() above), sliced by rank."""

    def entropy_floor(self) -> float | None:
        return None

    def num_tokens(self) -> int | None:
        return None

    def check(self) -> None:
        return None

    def batch_source(self, global_batch, dp_rank, dp_size, micro_batch, shares=(), workers=1):
        return CountingRankRows(global_batch, dp_rank, dp_size, micro_batch)


class CountingRankRows:
    def __init__(self, global_batch, dp_rank, dp_size, micro_batch):
        self.local = global_batch // dp_size
        self.global_batch, self.offset, self.micro_batch, self.step = global_batch, dp_rank * self.local, micro_batch, 0
        self.loaders: list[CountingLoader] = []

    def prefetcher(self, pin=False, timeout_s=None, before_batch=None):
        self.loaders.append(CountingLoader(self))
        return self.loaders[-1]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]

    def tokens_drawn(self) -> dict[str, int] | None:
        return None


class CountingLoader:
    def __init__(self, source: CountingRankRows):
        self.source, self.position, self.served, self.closed = source, source.step, [], False

    def next_step(self) -> tuple[list[Batch], float]:
        first = self.position * self.source.global_batch + self.source.offset
        inputs, targets = rows(range(first, first + self.source.local))
        self.served.append(self.position)
        self.position += 1
        self.source.step = self.position
        return Batch(inputs, targets).split(self.source.micro_batch), 0.0

    def close(self) -> None:
        self.closed = True


def same_signature(method, protocol_method) -> bool:
    """The parameter names and defaults of `method` are the protocol's (self aside)."""
    ours = [(p.name, p.default) for p in inspect.signature(method).parameters.values()]
    theirs = [(p.name, p.default) for p in list(inspect.signature(protocol_method).parameters.values())[1:]]
    return ours == theirs


def check_protocol(data) -> list[int]:
    """Assert `data` and what it gives implement the three protocols; read two steps: the first token of each
    row of rank 1 of 2."""
    assert isinstance(data, Source), type(data).__name__
    assert same_signature(data.batch_source, Source.batch_source), type(data).__name__
    source = data.batch_source(8, 1, 2, 2, workers=0)
    assert isinstance(source, RankSource) and same_signature(source.prefetcher, RankSource.prefetcher)
    source.load_state_dict(json.loads(json.dumps(source.state_dict())))  # its state is plain JSON
    loader = source.prefetcher()
    try:
        assert isinstance(loader, StepLoader), type(loader).__name__
        firsts = []
        for step in range(2):
            micro, waited = loader.next_step()
            assert len(micro) == 2 and all(isinstance(mb, Batch) and mb.inputs.shape[0] == 2 for mb in micro)
            assert waited >= 0 and loader.position == source.step == step + 1
            firsts += [int(mb.inputs[r, 0]) for mb in micro for r in range(2)]
    finally:
        loader.close()
    assert source.state_dict()["step"] == 2
    return firsts


def test_every_kind_of_data_implements_the_source_protocol(tmp_path):
    expected = [int(row(i)[0]) for t in range(2) for i in range(t * 8 + 4, t * 8 + 8)]  # rank 1's rows
    assert check_protocol(FunctionDataset(rows)) == expected
    assert check_protocol(TorchData(Samples())) == expected
    check_protocol(SyntheticMarkov(VOCAB, SEQ, seed=0))
    tokens = tmp_path / "tokens.bin"
    (np.arange(4096) % VOCAB).astype(np.uint16).tofile(tokens)
    check_protocol(TokenFile(str(tokens), VOCAB, SEQ))
    corpus = make_corpus(tmp_path / "corpus", jsonl_docs=30, parquet_docs=10)
    cfg = TrainConfig(strategy="single", data=corpus["a"], tokenizer=corpus["tok"], vocab_size=320, seq_len=SEQ)
    documents = make_train_data(cfg, 320)
    check_protocol(documents)
    assert documents.batch_source(8, 0, 2, 2).tokens_drawn() == {corpus["a"]: 0}  # nothing drawn yet
    assert check_protocol(CountingRows()) == expected
    # what is not a Source: a torch Dataset (the Python API wraps it in TorchData), a loader
    assert not isinstance(Samples(), Source) and not isinstance(CountingLoader(CountingRankRows(8, 0, 1, 2)), Source)


def build() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))


def fit(rt, data, run_dir, **overrides) -> tuple[Trainer, dict]:
    base = {"strategy": "single", "nproc": 1, "device": "cpu", "steps": 3, "seq_len": SEQ, "global_batch": 4,
            "micro_batch": 2, "lr": 1e-2, "resume": "never", "metrics": False}
    cfg = TrainConfig(**{**base, **overrides})
    trainer = Trainer(cfg, rt, run_dir, quiet=True, layout=resolve_layout(cfg, 1), custom=CustomModel(build, data=data))
    return trainer, trainer.fit()


def test_a_source_of_ones_own_trains_checkpoints_and_resumes(tmp_path):
    rt = Runtime(0, 1, 0, torch.device("cpu"), "gloo")  # one device: no process group needed
    data = CountingRows()
    trainer, summary = fit(rt, data, tmp_path / "own", ckpt_every=2)
    assert trainer.source.loaders[0].served == [0, 1, 2] and trainer.source.loaders[0].closed
    _, reference = fit(rt, rows, tmp_path / "function")  # the same rows, as a data function
    assert summary["steps"] == 3 and summary["losses"] == reference["losses"]
    assert "tokens_per_source" not in summary and "data_tokens" not in summary
    manifest = json.loads((tmp_path / "own" / "checkpoints" / "step-2" / "manifest.json").read_text())
    assert manifest["extra"]["data"] == {"step": 2}  # the source's state_dict, in the checkpoint
    resumed, again = fit(rt, CountingRows(), tmp_path / "own", resume="auto", ckpt_every=2)
    assert resumed.source.loaders[0].served == [2]  # loaded from the checkpoint: continues at step 3
    assert again["losses"] == pytest.approx(summary["losses"][2:], rel=1e-6)
