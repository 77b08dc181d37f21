"""`paratrain eval SOURCE --data D`: a model's loss and perplexity on held-out data, under any layout.

The held-out batches and their reduction are training's own validation (train/evaluate.py): the same samples,
sliced over the data-parallel ranks (unevenly with --dp-batch-split, each sample on exactly one rank), reduced
over dp x cp and from the last pipeline stage. So a checkpoint's eval at the run's data flags equals the val_loss
its training run logged at that step, and every layout gives the one-device number.

Held-out data: --val-data V, or the --val-fraction F of --data that training held out; with neither, all of
--data (a token file read in order, or a document stream). Synthetic data has its own held-out samples. A
mixture's sources are also evaluated one by one (`per_source`: each source's held-out documents alone).
"""

from __future__ import annotations

import logging
import time

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.infer.source_loader import resolve_source, run_ranks
from paratrain.models.presets import model_args_for
from paratrain.train.data.doc_sources import is_document_spec, parse_sources
from paratrain.train.evaluate import build_validator, evaluate, perplexity

log = logging.getLogger("paratrain")
PROGRESS_EVERY_S = 5.0


def eval_config(source: str, overrides: dict) -> TrainConfig:
    """The run config of an eval of `source` (source_loader.py's resolve_source), with its held-out data decided and
    checked here, before any rank starts."""
    cfg = resolve_source(source, overrides)
    held_out = {"eval_every": 1}  # the trainer builds its validator only for a run that validates
    if cfg.data != "synthetic" and not cfg.val_data and not cfg.val_fraction:
        held_out["val_data"] = cfg.data
    cfg = TrainConfig(**{**cfg.model_dump(), **held_out})
    build_validator(cfg, model_args_for(cfg).vocab_size)  # bad held-out options: one line, here
    return cfg


def held_out_spec(cfg: TrainConfig) -> str:
    return cfg.val_data or cfg.data


def source_configs(cfg: TrainConfig) -> dict[str, TrainConfig]:
    """A mixture's sources, each as a config whose held-out data is that source alone ({} for one source)."""
    spec = held_out_spec(cfg)
    if not is_document_spec(spec, cfg.tokenizer):
        return {}
    sources = parse_sources(spec, cfg.text_field)
    if len(sources) < 2:
        return {}
    field = "val_data" if cfg.val_data else "data"
    # "PATTERN:1", a mixture of one: its documents held out as in the mixture, whatever the files' format
    return {s.pattern: TrainConfig(**{**cfg.model_dump(), field: f"{s.pattern}:1"}) for s in sources}


def run_eval(cfg: TrainConfig) -> dict | None:
    """Evaluate on every rank of cfg's layout; rank 0's eval --json document (None on other ranks of a torchrun
    job)."""
    results = run_ranks(cfg, eval_rank)
    return results.get(0)


def eval_rank(loaded) -> dict:
    """One rank's part of the eval (a collective); the document on every rank."""
    trainer, cfg = loaded.trainer, loaded.cfg
    progress = Progress(held_out_spec(cfg)) if trainer.rt.is_main else None
    loss = evaluate(trainer, progress=progress)
    tokens = trainer.validator.tokens
    per_source = {}
    sub = source_configs(cfg)
    for name, source_cfg in sub.items():
        validator = validator_for(trainer, source_cfg)
        source_progress = Progress(name) if progress else None
        per_source[name] = {"loss": evaluate(trainer, validator, source_progress), "tokens": validator.tokens}
    if not sub:
        per_source[held_out_spec(cfg)] = {"loss": loss, "tokens": tokens}
    checkpoint = cfg.resume if loaded.step is not None else cfg.model  # the step directory, or hf:DIR
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": tokens, "per_source": per_source,
            "layout": trainer.layout.to_dict(), "checkpoint": checkpoint}


def validator_for(trainer, cfg: TrainConfig):
    """`cfg`'s held-out set, cut for this rank as the trainer cuts its own."""
    from paratrain.parallel.uneven_split import dp_shares

    layout, dp_rank = trainer.layout, trainer.dp_rank
    validator = build_validator(cfg, trainer.args.vocab_size, dp_rank, layout.dp, layout.micro_batch_of(dp_rank),
                                dp_shares(layout))
    if validator is None:
        raise UserError(f"{held_out_spec(cfg)}: no held-out data to evaluate")
    return validator


class Progress:
    """A line on stderr now and then while a long eval runs (rank 0), and the last one."""

    def __init__(self, what: str):
        self.what, self.start = what, time.perf_counter()
        self.last = self.start

    def __call__(self, done: int, batches: int, mean: float) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S or (done == batches and now - self.start >= PROGRESS_EVERY_S):
            self.last = now
            log.info("eval %s: %d/%d batches, loss so far %.4f (%.0f s)", self.what, done, batches, mean,
                     now - self.start)
