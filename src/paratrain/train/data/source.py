"""Which data a run reads, and the one protocol every kind of data implements.

The loop asks a data object for this rank's batch source, and the batch source for a loader of its steps'
micro-batches; it never asks which kind of data it holds. The kinds: the indexed data sets of
train/data/indexed_sets.py (synthetic, token files; a custom model's data function, train/custom.py), the
document stream (train/data/stream_loader.py) and a user's torch data (train/data/torch_data.py). A class of
one's own that implements these three protocols trains too (the Python API takes it as `data`, docs/api.md).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from paratrain.errors import UserError
from paratrain.interop.text_fields import fields_for
from paratrain.train.data.doc_sources import is_document_spec, parse_sources, refuse_mixture_mistakes
from paratrain.train.data.doc_stream import stream_config
from paratrain.train.data.indexed_sets import Batch, make_dataset
from paratrain.train.data.stream_loader import DocumentData


@runtime_checkable
class StepLoader(Protocol):
    """Hands each step's micro-batches in order, built ahead of the step where it can."""

    position: int  # the steps handed out (not the ones built ahead)

    def next_step(self) -> tuple[list[Batch], float]:
        """This step's micro-batches and the seconds the caller waited for them."""

    def close(self) -> None:
        """Stop building ahead (worker processes, threads)."""


@runtime_checkable
class RankSource(Protocol):
    """One data-parallel rank's slice of every global batch, cut into micro-batches of `micro_batch` rows.
    Its state (`step`, and whatever else state_dict holds) is what a checkpoint saves, so a resume continues the
    same stream; a loader advances `step` as it hands steps out, and a hook may move it (a healed replica)."""

    step: int
    micro_batch: int

    def prefetcher(self, pin: bool = False, timeout_s: float | None = None, before_batch=None) -> StepLoader:
        """A loader from `step` on. `pin`: page-locked batches (CUDA); `timeout_s`: how long a step may wait
        before the run fails naming the stall; `before_batch(step)`: the trainer's before_batch hook."""

    def state_dict(self) -> dict:
        """The position, as plain JSON values (it goes into the checkpoint's manifest)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's state_dict(); one clear UserError where it does not fit this data."""

    def tokens_drawn(self) -> dict[str, int] | None:
        """Tokens each named source gave so far (a mixture's), or None where the data has no named sources."""


@runtime_checkable
class Source(Protocol):
    """A run's training data, before it is split across ranks."""

    def entropy_floor(self) -> float | None:
        """The best loss achievable on it (nats), where that is known (synthetic data); else None."""

    def num_tokens(self) -> int | None:
        """Its size in tokens where it has one (a token file: the epoch line); None for a stream."""

    def check(self) -> None:
        """Open what it reads (files, tokenizer) so a bad one fails before any process starts."""

    def batch_source(self, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                     shares: tuple[int, ...] = (), workers: int = 1) -> RankSource:
        """Rank `dp_rank` of `dp_size`'s source: `shares` (--dp-batch-split), each rank's rows instead of
        global_batch / dp_size; `workers` (--data-workers), the loader's processes where it has any."""


def uses_documents(cfg) -> bool:
    return is_document_spec(cfg.data, getattr(cfg, "tokenizer", None))


def make_train_data(cfg, vocab_size: int) -> Source:
    """The training data set of a run config: DocumentData for documents, else make_dataset's."""
    if cfg.data != "synthetic":
        refuse_mixture_mistakes(cfg.data)
    if not uses_documents(cfg):
        if not getattr(cfg, "pack", True):
            raise UserError("--no-pack applies to document data (JSON Lines / Parquet / Arrow / text with "
                            "--tokenizer); token files and synthetic data are plain windows already")
        return make_dataset(cfg.data, vocab_size, cfg.seq_len, cfg.seed, cfg.val_fraction)
    part = "train" if cfg.val_fraction else "all"
    stream = stream_config(cfg.data, cfg.tokenizer, cfg.seq_len, cfg.seed, cfg.pack, cfg.text_field, part,
                           cfg.val_fraction)
    check_text_field_names(cfg, [s.pattern for s in stream.sources])
    return DocumentData(stream, vocab_size)


def check_text_field_names(cfg, patterns: list[str]) -> None:
    """Every SOURCE of --text-field SOURCE=NAME names a source of --data or of --val-data."""
    if cfg.val_data and is_document_spec(cfg.val_data, cfg.tokenizer):
        patterns = patterns + [s.pattern for s in parse_sources(cfg.val_data)]
    fields_for(list(dict.fromkeys(patterns)), cfg.text_field, strict=True)
