"""Validation loss: the same held-out batches, reduced the same way, under every strategy.

The held-out set is a fixed list of `batches` global batches (sample indices 0, 1, ... of the validation
data set), cut into data-parallel slices and micro-batches exactly like training batches. Each rank computes
the mean loss of its slice without gradients; the global value then goes through the trainer's own loss
reduction (over dp x cp, and from the last pipeline stage). So single, ddp, zero*, tp, cp and pp all report the
mean over the same tokens.
"""

from __future__ import annotations

import math

import torch

from paratrain.errors import UserError
from paratrain.train.data.doc_sources import is_document_spec
from paratrain.train.data.doc_stream import real_tokens, stream_config
from paratrain.train.data.indexed_sets import Batch, BatchSource, make_val_dataset, rank_slice
from paratrain.train.data.source import uses_documents
from paratrain.train.data.stream_loader import DocumentData
from paratrain.train.step import autocast_context, batch_inputs, plain_loss, real_token_loss


class Validator:
    def __init__(self, dataset, global_batch: int, dp_rank: int, dp: int, micro_batch: int, batches: int,
                 shares: tuple[int, ...] = (), seq_len: int = 0):
        self.source = BatchSource(dataset, global_batch, dp_rank, dp, micro_batch, shares)
        self.batches = batches
        self.tokens = batches * global_batch * seq_len  # the targets in all the batches: a window's all count

    def micro_batches(self, index: int) -> list[Batch]:
        batch = self.source.rank_batch(index)
        mb = self.source.micro_batch
        return [Batch(i, t) for i, t in zip(batch.inputs.split(mb), batch.targets.split(mb))]


class DocumentValidator:
    """Validation on documents: the first `batches` global batches of the held-out stream (a --val-data file,
    or the documents --val-fraction holds out of each --data source), packed as in training, built once."""

    def __init__(self, data: DocumentData, global_batch: int, dp_rank: int, dp: int, micro_batch: int,
                 batches: int, shares: tuple[int, ...] = ()):
        self.local, self.offset = rank_slice(global_batch, dp_rank, dp, micro_batch, shares)
        self.data, self.global_batch, self.micro_batch, self.batches = data, global_batch, micro_batch, batches
        self.rows: list[dict] | None = None

    @property
    def tokens(self) -> int:
        """The targets that count (IGNORE ones, across documents and on padding, do not) in all the batches."""
        return sum(real_tokens(self._rows()[i]["targets"]) for i in range(self.batches))

    def _rows(self) -> list[dict]:
        if self.rows is None:
            stream = self.data.open()
            self.rows = [stream.next_global_batch(self.global_batch) for _ in range(self.batches)]
        return self.rows

    def micro_batches(self, index: int) -> list[Batch]:
        rows = self._rows()[index]
        mine = {k: torch.from_numpy(v[self.offset:self.offset + self.local].copy()) for k, v in rows.items()}
        batch = Batch(mine["inputs"], mine["targets"], mine["positions"], mine["doc_ids"], real_tokens(rows["targets"]))
        return batch.split(self.micro_batch)


def build_document_validator(cfg, vocab_size: int, dp_rank: int, dp: int, micro: int, shares: tuple[int, ...]):
    if cfg.val_data and cfg.val_fraction:
        raise UserError("give --val-data or --val-fraction, not both")
    if cfg.val_data:
        stream = stream_config(cfg.val_data, cfg.tokenizer, cfg.seq_len, cfg.seed, cfg.pack, cfg.text_field)
    elif cfg.val_fraction:
        stream = stream_config(cfg.data, cfg.tokenizer, cfg.seq_len, cfg.seed, cfg.pack, cfg.text_field, "val",
                               cfg.val_fraction)
    elif cfg.eval_every:
        raise UserError(f"--eval-every needs --val-data or --val-fraction with --data {cfg.data}")
    else:
        return None
    return DocumentValidator(DocumentData(stream, vocab_size), cfg.global_batch, dp_rank, dp, micro,
                             cfg.val_batches, shares)


def validation_batches(cfg, dataset) -> int:
    """How many global batches one validation uses: --val-batches, fewer if the held-out data is short."""
    if not hasattr(dataset, "num_windows"):
        return cfg.val_batches
    available = dataset.num_windows() // cfg.global_batch
    if available == 0:
        raise UserError(f"the held-out data ({dataset.path}, {dataset.num_tokens()} tokens) holds "
                        f"{dataset.num_windows()} windows of seq_len+1 tokens; one validation batch needs "
                        f"global_batch={cfg.global_batch} of them (raise --val-fraction or lower --global-batch)")
    return min(cfg.val_batches, available)


def build_validator(cfg, vocab_size: int, dp_rank: int = 0, dp: int = 1, micro_batch: int | None = None,
                    shares: tuple[int, ...] = ()):
    """The run's Validator, or None when it does not validate. Raises UserError on bad validation options."""
    if uses_documents(cfg) or (cfg.val_data and is_document_spec(cfg.val_data, cfg.tokenizer)):
        return build_document_validator(cfg, vocab_size, dp_rank, dp, micro_batch or cfg.global_batch // dp, shares)
    dataset = make_val_dataset(cfg.data, cfg.val_data, cfg.val_fraction, cfg.eval_every, vocab_size, cfg.seq_len,
                               cfg.seed)
    if dataset is None:
        return None
    micro = micro_batch or cfg.global_batch // dp
    return Validator(dataset, cfg.global_batch, dp_rank, dp, micro, validation_batches(cfg, dataset), shares,
                     cfg.seq_len)


def _plain_loss(runner, micro: list[Batch]) -> torch.Tensor:
    """This rank's share of the mean, each micro-batch weighted as in training (parallel/loss_weighting.py)."""
    weighting, total = runner.loss_weighting, torch.zeros((), device=runner.device)
    for mb in micro:
        inputs, targets, extra = batch_inputs(runner.prepare_batch, mb)
        with runner.loss_context():  # TP: the logits stay vocab-sharded, as in training
            with autocast_context(runner.device.type, runner.dtype, runner.use_autocast):
                logits = runner.model_output(inputs, targets, extra)
            if mb.global_tokens is not None:  # document data: the mean over the real tokens
                total += plain_loss(real_token_loss(runner.loss_fn, logits, targets, mb, weighting).detach().float())
                continue
            loss = runner.loss_fn(logits, targets).detach().float()
        total += weighting.dense_loss(plain_loss(loss), len(micro))
    return total


def _pipeline_loss(runner, micro: list[Batch]) -> torch.Tensor:
    return runner.evaluate_loss(micro)


def evaluate(trainer, validator=None, progress=None) -> float:
    """Mean validation loss over the held-out batches (a collective: every rank calls it). `validator`: another
    held-out set than the trainer's (paratrain eval's per-source losses); `progress(done, batches, mean so far)`
    is called after each batch."""
    runner, validator = trainer.step_runner, validator or trainer.validator
    local_loss = _pipeline_loss if hasattr(runner, "schedule") else _plain_loss
    losses = []
    with torch.no_grad():
        for index in range(validator.batches):
            micro = [mb.to(trainer.rt.device) for mb in validator.micro_batches(index)]
            losses.append(trainer.global_loss(local_loss(runner, micro)))
            if progress is not None:
                progress(index + 1, validator.batches, sum(losses) / len(losses))
    return sum(losses) / len(losses)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
