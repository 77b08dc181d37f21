"""Document data in one process: packing (positions restart, document ids, no target across a boundary),
--no-pack, the stream's state (a resume continues the same global batches, at any data-parallel size, though
the worker prefetched past the saved step), the per-document loss of a packed row (the model's document mask)
and its fault (the mask dropped)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.models.presets import build_model, model_args_for
from paratrain.train.data.doc_sources import is_document_spec, parse_sources
from paratrain.train.data.packing import IGNORE, Packer, rows_to_batch
from paratrain.train.data.source import make_train_data
from support.doc_corpus import make_corpus

pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def cfg_for(corpus, **overrides) -> TrainConfig:
    base = {"strategy": "single", "data": f"{corpus['a']}:0.6,{corpus['b']}:0.4", "tokenizer": corpus["tok"],
            "vocab_size": 320, "seq_len": 32, "global_batch": 4, "steps": 8, "device": "cpu"}
    return TrainConfig(**{**base, **overrides})


def test_packing_restarts_positions_and_never_targets_across_documents():
    docs = iter([[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 9, 0]])
    packer = Packer(row_len=6, pack=True, eot=0)
    rows = [packer.next_row(lambda: next(docs)) for _ in range(2)]
    tokens, doc_ids, positions = (np.stack(x) for x in zip(*rows))
    assert tokens.tolist() == [[1, 2, 3, 0, 4, 5], [0, 6, 7, 8, 9, 0]]
    assert doc_ids.tolist() == [[0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1], [0, 0, 1, 2, 3, 4]]  # the carried tail restarts at 0
    batch = rows_to_batch(tokens, doc_ids, positions)
    assert batch["targets"].tolist() == [[2, 3, 0, IGNORE, 5], [IGNORE, 7, 8, 9, 0]]


def test_no_pack_puts_one_document_per_row_and_ignores_padding():
    docs = iter([[1, 2, 0], [3, 4, 5, 6, 7, 8, 0]])
    packer = Packer(row_len=5, pack=False, eot=0)
    (t0, d0, _), (t1, _, _) = packer.next_row(lambda: next(docs)), packer.next_row(lambda: next(docs))
    assert t0.tolist() == [1, 2, 0, 0, 0] and d0.tolist() == [0, 0, 0, -1, -1]
    assert t1.tolist() == [3, 4, 5, 6, 7]  # cut at the row
    assert rows_to_batch(np.stack([t0]), np.stack([d0]), np.stack([d0]))["targets"].tolist() == [[2, 0, IGNORE, IGNORE]]


def test_data_specs(corpus, tmp_path):
    assert is_document_spec(corpus["a"]) and is_document_spec(f"{corpus['a']}:1,{corpus['b']}:3")
    assert not is_document_spec("synthetic") and not is_document_spec("x.txt") and is_document_spec("x.txt", "tok")
    weights = [s.weight for s in parse_sources(f"{corpus['a']}:1,{corpus['b']}:3")]
    assert weights == [0.25, 0.75]
    with pytest.raises(UserError, match="no such file"):
        parse_sources(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="positive"):
        parse_sources(f"{corpus['a']}:-1")
    with pytest.raises(UserError, match="--tokenizer"):
        make_train_data(cfg_for(corpus, tokenizer=None), 320)
    with pytest.raises(UserError, match="--text-field"):
        make_train_data(cfg_for(corpus, text_field="body"), 320).check()


def global_batches(cfg, dp: int, steps: int, state: dict | None = None, workers: int = 1):
    """Hashes of `steps` global batches read through dp rank sources (each with its worker process), and the
    state after them (rank 0's; every rank's is the same)."""
    data = make_train_data(cfg, 320)
    sources = [data.batch_source(cfg.global_batch, r, dp, cfg.global_batch // dp, workers=workers) for r in range(dp)]
    if state is not None:
        for s in sources:
            s.load_state_dict(json.loads(json.dumps(state)))
    loaders = [s.prefetcher() for s in sources]
    hashes = []
    for _ in range(steps):
        parts = [loader.next_step()[0] for loader in loaders]
        rows = torch.cat([torch.cat([mb.inputs for mb in micro]) for micro in parts])
        hashes.append(hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16])
    states = [s.state_dict() for s in sources]
    for loader in loaders:
        loader.close()
    assert all(s == states[0] for s in states)
    return hashes, states[0]


def test_resume_continues_the_same_global_batches_at_any_data_parallel_size(corpus):
    """5 global batches uninterrupted, against 2 then a resume from the saved state, at dp 2 -> 1 and 1 -> 2.
    The workers prefetch past step 2 before the state is taken: it is still the state after step 2."""
    cfg = cfg_for(corpus)
    straight, _ = global_batches(cfg, 1, 5)
    for first, second in ((2, 1), (1, 2)):
        head, state = global_batches(cfg, first, 2)
        assert state["step"] == 2 and sum(state["stream"]["tokens_drawn"]) > 0
        tail, _ = global_batches(cfg, second, 3, state)
        assert head + tail == straight, (first, second)
    in_process, _ = global_batches(cfg, 1, 5, workers=0)
    assert in_process == straight


def test_worker_processes_tokenize_round_robin_into_the_same_stream(corpus, monkeypatch):
    """--data-workers 2 and 3: worker processes tokenize the chunks of documents in turn (3 documents a chunk
    here, so every worker has several), and the rows and the state are those of one worker, also across a
    resume from the state after step 2 at another worker count."""
    from paratrain.train.data import doc_stream

    monkeypatch.setattr(doc_stream, "LOOKAHEAD", 3)  # read by the forked workers as well
    cfg = cfg_for(corpus, data=f"{corpus['a']}:0.6,{corpus['b']}:0.4")
    straight, end = global_batches(cfg, 1, 6)
    assert end["stream"]["draws"] > 2 * 3 * 3  # the run spans several chunks of every worker
    for workers in (2, 3):
        assert global_batches(cfg, 2, 6, workers=workers) == (straight, end), workers
    head, state = global_batches(cfg, 1, 2, workers=3)
    tail, resumed_end = global_batches(cfg, 2, 4, state, workers=2)
    assert head + tail == straight and resumed_end == end


def test_no_pack_rows_hold_one_document_each(corpus):
    data = make_train_data(cfg_for(corpus, pack=False), 320)
    rows = data.open().next_global_batch(4)
    assert ((rows["doc_ids"] == 0) | (rows["doc_ids"] == -1)).all()
    assert (rows["positions"][:, 0] == 0).all()


def document_alone_loss(model, rows: dict) -> float:
    """The mean over the real targets of each document of each row, every document run alone (no mask)."""
    total, count = 0.0, 0
    for r in range(rows["inputs"].shape[0]):
        docs = rows["doc_ids"][r]
        for d in np.unique(docs):
            idx = np.flatnonzero(docs == d)
            inputs = torch.from_numpy(rows["inputs"][r, idx])[None]
            targets = torch.from_numpy(rows["targets"][r, idx])[None]
            logits = model(inputs)
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            count += int((targets != IGNORE).sum())
    return total / count


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_packed_rows_loss_equals_each_document_alone(corpus, preset):
    from paratrain.train.hooks import Hooks
    from paratrain.train.runtime import Runtime
    from paratrain.train.trainer import Trainer
    from support.drop_doc_mask import plugin

    cfg = cfg_for(corpus, model=preset, seq_len=48, data=corpus["a"], steps=1)
    rows = make_train_data(cfg, 320).open().next_global_batch(cfg.global_batch)
    assert (np.diff(rows["doc_ids"], axis=1) != 0).any()  # the rows do pack several documents
    reference = document_alone_loss(build_model(model_args_for(cfg), "cpu", seed=cfg.seed).eval(), rows)
    rt = Runtime(0, 1, 0, torch.device("cpu"), "gloo")  # one device: no process group needed
    losses = {}
    for fault in (False, True):
        hooks = Hooks()
        if fault:
            plugin(hooks)
        trainer = Trainer(cfg, rt, quiet=True, hooks=hooks)
        loader = trainer.source.prefetcher()
        losses[fault] = trainer.train_step(loader.next_step()[0])["loss"]
        loader.close()
    assert losses[False] == pytest.approx(reference, rel=1e-5)
    # the mask dropped (attention crosses documents): off by several times the tolerance (at init, near-uniform
    # attention: ~1e-4 relative for gpt2-tiny, ~4e-4 for tiny)
    assert abs(losses[True] - reference) > 5e-5 * reference


def test_transformers_models_take_the_document_mask(tmp_path):
    """hf: models get packed rows as a 4-D block-diagonal mask and per-document positions: equal to each document
    run alone (and the rows without the mask are not)."""
    pytest.importorskip("transformers")
    from models.hf_configs import write_config
    from paratrain.models.hf_model import build_hf_model

    gen = torch.Generator().manual_seed(1)
    first, second = torch.randint(0, 256, (1, 10), generator=gen), torch.randint(0, 256, (1, 14), generator=gen)
    tokens = torch.cat([first, second], 1)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14])
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    model = build_hf_model(f"hf:{write_config(tmp_path, 'llama')}", 0).eval()
    with torch.no_grad():
        alone = torch.cat([model(first), model(second)], 1)
        assert torch.allclose(model(tokens, positions, doc_ids), alone, atol=1e-5)
        assert not torch.allclose(model(tokens), alone, atol=1e-2)


def test_data_prepare_takes_each_record_as_a_document(corpus, tmp_path):
    """`data prepare` on JSON Lines + Parquet: one document per record, each followed by end-of-text, in the
    order the stream reads them (so the streamed and the pre-tokenized run see the same tokens)."""
    import json as _json

    from paratrain.train.data.doc_stream import open_tokenizer
    from paratrain.train.data.prepare_tokens import prepare_tokens

    meta = prepare_tokens(corpus["tok"], [corpus["a"], corpus["b"]], tmp_path / "t.bin")
    assert meta["documents"] == 120 + 80 and [s["documents"] for s in meta["sources"]] == [120, 80]
    tok, eot, _ = open_tokenizer(corpus["tok"])
    texts = [_json.loads(line)["text"] for line in open(corpus["a"])]
    expected = [i for text in texts for i in [*tok.encode(text, add_special_tokens=False).ids, eot]]
    tokens = np.fromfile(tmp_path / "t.bin", dtype=np.uint16)
    assert tokens[:len(expected)].tolist() == expected


def test_a_prepared_token_file_mixes_as_its_documents(corpus, tmp_path):
    """'a.jsonl:0.6,b.bin:0.4' with b.bin = `data prepare` of b.parquet: the same global batches as the mixture of
    the Parquet file itself; a token file without its sidecar is refused."""
    from paratrain.train.data.prepare_tokens import prepare_tokens

    prepare_tokens(corpus["tok"], [corpus["b"]], tmp_path / "b.bin")
    streamed = make_train_data(cfg_for(corpus), 320).open()
    prepared = make_train_data(cfg_for(corpus, data=f"{corpus['a']}:0.6,{tmp_path / 'b.bin'}:0.4"), 320).open()
    for _ in range(3):
        a, b = streamed.next_global_batch(4), prepared.next_global_batch(4)
        assert all((a[k] == b[k]).all() for k in a)
    (tmp_path / "b.bin.json").unlink()
    with pytest.raises(UserError, match="sidecar"):
        make_train_data(cfg_for(corpus, data=f"{corpus['a']}:0.6,{tmp_path / 'b.bin'}:0.4"), 320).check()
