"""The global document stream: sources mixed by weight, tokenized, packed, cut into global batches.

The stream is a pure function of its state, which is small and JSON: how many documents have been drawn, each
source's (epoch, offset), the packer's carry-over and the tokens drawn per source. Which source the i-th draw
takes is a hash of (seed, i) against the weights, so no RNG state needs saving. Every data-parallel rank runs
the same global stream and keeps its own rows of each global batch: the state is the same on every rank and
does not depend on the world size, so a resume at another data-parallel size continues the same global batches.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field

import numpy as np

from paratrain.errors import UserError
from paratrain.train.data.doc_sources import DocumentSource, SourceSpec, parse_sources
from paratrain.train.data.packing import IGNORE, Packer, rows_to_batch
from paratrain.train.data.token_documents import TokenDocuments

MIX_STREAM = 515151  # the hash stream that picks each draw's source
LOOKAHEAD = 64  # documents read and tokenized at once (one encode_batch call); never part of the state
LOOKAHEAD_CHARS = 1 << 18  # ... or fewer, once their text reaches this (long documents)


@dataclass
class StreamConfig:
    """What defines a stream (picklable: it travels to the loader's worker process)."""

    sources: list[SourceSpec]
    tokenizer: str
    seq_len: int
    seed: int = 0
    pack: bool = True
    part: str = "all"  # 'train' / 'val' with val_fraction: which documents of each source (doc_sources.py)
    val_fraction: float = 0.0

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.sources]


@dataclass
class StreamState:
    draws: int = 0
    positions: list[list[int]] = field(default_factory=list)  # per source: [epoch, offset]
    carry: list[int] = field(default_factory=list)
    tokens_drawn: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"draws": self.draws, "positions": self.positions, "carry": self.carry,
                "tokens_drawn": self.tokens_drawn}

    @classmethod
    def from_json(cls, state: dict, sources: int) -> StreamState:
        out = cls(int(state["draws"]), [[int(e), int(o)] for e, o in state["positions"]],
                  [int(t) for t in state["carry"]], [int(t) for t in state["tokens_drawn"]])
        if len(out.positions) != sources:
            raise UserError(f"the checkpoint's data state has {len(out.positions)} sources; --data names {sources}")
        return out


def stream_config(spec: str, tokenizer: str | None, seq_len: int, seed: int, pack: bool = True,
                  text_field: str = "text", part: str = "all", val_fraction: float = 0.0) -> StreamConfig:
    if not tokenizer:
        raise UserError(f"--data {spec} holds documents to tokenize: give --tokenizer DIR (a tokenizer.json)")
    return StreamConfig(parse_sources(spec, text_field), tokenizer, seq_len, seed, pack, part, val_fraction)


def open_source(spec: SourceSpec, cfg: StreamConfig, part: str = "all"):
    """A source's reader: documents as text (DocumentSource), or already tokenized (a token .bin)."""
    if spec.fmt == "tokens":
        from paratrain.train.data.prepare_tokens import tokenizer_file

        return TokenDocuments(spec, tokenizer_file(cfg.tokenizer), cfg.seed, part, cfg.val_fraction)
    return DocumentSource(spec, cfg.seed, part, cfg.val_fraction)


def open_tokenizer(path: str):
    """(tokenizer, its end-of-text id, its vocabulary size)."""
    from paratrain.train.data.prepare_tokens import load_tokenizer, pick_eot

    _, tok = load_tokenizer(path)
    eot = pick_eot(tok, None)
    if eot is None:
        raise UserError(f"--tokenizer {path}: its vocabulary has no end-of-text token (<|endoftext|>, </s>, ...) "
                        "to separate packed documents")
    return tok, eot, tok.get_vocab_size(with_added_tokens=True)


class DocumentReader:
    """The stream's documents in order from a state, read LOOKAHEAD (or LOOKAHEAD_CHARS) at a time and tokenized a
    chunk at a time (one encode_batch call). Chunks depend only on the state and the files, never on who
    tokenizes them: loader worker w of N tokenizes chunks w, w+N, ... and reads past the others."""

    def __init__(self, cfg: StreamConfig, state: StreamState):
        self.cfg = cfg
        self.tok, self.eot, self.vocab_size = open_tokenizer(cfg.tokenizer)
        self.cdf = np.cumsum(cfg.weights)
        self.cdf[-1] = 1.0
        self.docs = [open_source(s, cfg, cfg.part).documents(*pos) for s, pos in zip(cfg.sources, state.positions)]
        self.draws = state.draws

    def source_of(self, draw: int) -> int:
        from paratrain.train.data.counter_hash import uniform_hash

        if len(self.cdf) == 1:
            return 0
        u = uniform_hash(self.cfg.seed, np.array([draw]), MIX_STREAM)[0]
        return int(min(np.searchsorted(self.cdf, u, side="right"), len(self.cdf) - 1))

    def read(self) -> list[tuple]:
        """The next chunk's documents: (source, epoch, offset after, text or a token file's tokens)."""
        picked, chars = [], 0
        while len(picked) < LOOKAHEAD and chars < LOOKAHEAD_CHARS:
            src = self.source_of(self.draws)
            self.draws += 1
            epoch, offset, text = next(self.docs[src])
            picked.append((src, epoch, offset, text))
            chars += len(text)
        return picked

    def tokenize(self, picked: list[tuple]) -> list[tuple]:
        """(source, epoch, offset after, tokens + end-of-text) of each document of a chunk."""
        texts = [doc for *_, doc in picked if isinstance(doc, str)]
        encoded = iter(self.tok.encode_batch(texts, add_special_tokens=False) if texts else [])
        # a token file's documents come tokenized, end-of-text included
        return [(src, epoch, offset, next(encoded).ids + [self.eot] if isinstance(doc, str) else doc)
                for src, epoch, offset, doc in picked]

    def chunks(self, worker: int = 0, workers: int = 1):
        """Tokenized chunks worker, worker + workers, ... (all of them by default)."""
        index = 0
        while True:
            picked = self.read()
            if index % workers == worker:
                yield self.tokenize(picked)
            index += 1


class DocumentStream:
    """Iterates global batches of packed rows from a state. Not thread-safe; one per process.

    `chunks`: the tokenized chunks of DocumentReader from this state, when other processes tokenize them (the
    loader's worker processes, in order); by default this stream reads and tokenizes them itself."""

    def __init__(self, cfg: StreamConfig, state: StreamState | None = None, chunks=None):
        self.cfg = cfg
        n = len(cfg.sources)
        self.state = state or StreamState(0, [[0, 0] for _ in range(n)], [], [0] * n)
        if chunks is None:
            reader = DocumentReader(cfg, self.state)
            self.eot, self.vocab_size, chunks = reader.eot, reader.vocab_size, reader.chunks()
        else:
            _, self.eot, self.vocab_size = open_tokenizer(cfg.tokenizer)
        self.chunks = chunks
        self.ahead: collections.deque = collections.deque()  # (source, epoch, offset after, tokens)
        self.packer = Packer(cfg.seq_len + 1, cfg.pack, self.eot)
        self.packer.carry = list(self.state.carry)

    def _next_document(self) -> list[int]:
        if not self.ahead:
            self.ahead.extend(next(self.chunks))
        src, epoch, offset, tokens = self.ahead.popleft()
        s = self.state
        s.draws += 1
        s.positions[src] = [epoch, offset]
        s.tokens_drawn[src] += len(tokens)
        return tokens

    def next_global_batch(self, rows: int) -> dict[str, np.ndarray]:
        """`rows` packed rows as inputs / targets / positions / doc_ids (rows, seq_len), advancing the state."""
        tokens, docs, positions = zip(*(self.packer.next_row(self._next_document) for _ in range(rows)))
        self.state.carry = list(self.packer.carry)
        out = rows_to_batch(np.stack(tokens), np.stack(docs), np.stack(positions))
        if out["inputs"].max(initial=0) >= self.vocab_limit:
            raise UserError(f"the tokenizer produced token id {out['inputs'].max()} >= the model's vocabulary "
                            f"({self.vocab_limit})")
        return out

    vocab_limit = 1 << 62  # the model's vocabulary size, set by the caller

    def state_json(self) -> str:
        return json.dumps(self.state.to_json())


def real_tokens(targets: np.ndarray) -> int:
    return int((targets != IGNORE).sum())
