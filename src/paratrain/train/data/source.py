"""Which data a run reads, and how: the one place that picks between the indexed data sets of train/data/indexed_sets.py
(synthetic, token files: any sample by index) and the document stream (train/data/stream_loader.py)."""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.interop.text_fields import fields_for
from paratrain.train.data.doc_sources import is_document_spec, parse_sources, refuse_mixture_mistakes
from paratrain.train.data.doc_stream import stream_config
from paratrain.train.data.indexed_sets import BatchSource, Prefetcher, make_dataset
from paratrain.train.data.stream_loader import DocumentData, StreamBatchSource, StreamPrefetcher
from paratrain.train.data.torch_data import TorchBatchSource, TorchData, TorchPrefetcher


def uses_documents(cfg) -> bool:
    return is_document_spec(cfg.data, getattr(cfg, "tokenizer", None))


def make_train_data(cfg, vocab_size: int):
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


def make_batch_source(dataset, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                      shares: tuple[int, ...] = (), workers: int = 1):
    if isinstance(dataset, DocumentData):
        return StreamBatchSource(dataset, global_batch, dp_rank, dp_size, micro_batch, shares, workers)
    if isinstance(dataset, TorchData):
        return TorchBatchSource(dataset, global_batch, dp_rank, dp_size, micro_batch, shares, workers)
    return BatchSource(dataset, global_batch, dp_rank, dp_size, micro_batch, shares)


def make_prefetcher(source, pin: bool = False, timeout_s: float | None = None, before_batch=None):
    kinds = {StreamBatchSource: StreamPrefetcher, TorchBatchSource: TorchPrefetcher}
    kind = kinds.get(type(source), Prefetcher)
    return kind(source, pin=pin, timeout_s=timeout_s, before_batch=before_batch)
