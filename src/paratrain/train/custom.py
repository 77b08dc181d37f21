"""A user's own nn.Module under paratrain: what the Trainer needs to know about a model that is not a preset.

`CustomModel` bundles a model factory with its loss, its data and (for tensor parallelism) its TP plan. The
Trainer builds the model once per rank from `build()` after seeding torch with the run's seed, so every rank
starts from the same weights, then shards it like a preset. Data-parallel strategies (ddp, zero1/2/3, hsdp)
need nothing more; tp needs `tp_plan` (module path -> ParallelStyle). Pipelines and context parallelism need
the structure of paratrain's model families, so they are refused with one line.

Data: a callable `data(indices: np.ndarray) -> (inputs, targets)`, a pure function of the sample indices (so
every strategy sees the same global batch, as with presets), or a paratrain data spec string ("synthetic" or
a token file) for language models taking (batch, seq) token ids; then `vocab_size` must be set. Also a torch
Dataset (train/data/torch_data.py), or an object of one's own implementing the Source protocol
(train/data/source.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.train.data.indexed_sets import Batch, BatchSource, IndexedSet
from paratrain.train.loss_choice import check_fused_loss


@dataclass
class CustomModel:
    build: Callable[[], nn.Module]
    loss_fn: Callable | None = None  # (outputs, targets) -> scalar loss; default: next-token cross entropy
    data: object = None  # callable(indices) -> (inputs, targets), or a data spec string
    tp_plan: Callable[[nn.Module], dict] | dict | None = None
    name: str = "custom"

    def check(self, layout, cfg) -> None:
        for what, on in (("pipeline parallelism (pp)", layout.splits_stages),
                         ("context parallelism (cp)", layout.splits_sequences)):
            if on:
                raise UserError(f"{what} needs a paratrain model family; a custom model ({self.name}) trains under "
                                "single, ddp, zero1/2/3, hsdp, or tp with a tp_plan")
        if layout.splits_within_layers and self.tp_plan is None:
            raise UserError(f"tensor parallelism needs a TP plan for the custom model {self.name} (tp_plan=...)")
        if cfg.init_from:
            raise UserError("--init-from loads Hugging Face weights into a paratrain preset, not a custom model")
        check_fused_loss(cfg, layout, custom_name=self.name)
        if cfg.eval_every or cfg.val_data or cfg.val_fraction:
            raise UserError("validation (--eval-every, --val-*) is for paratrain's language-model data, not a "
                            "custom model's")

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # the same initial weights on every rank, and in the single-device reference
        model = self.build()
        if not isinstance(model, nn.Module):
            raise UserError(f"{self.name} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def plan_for(self, model: nn.Module) -> dict:
        return self.tp_plan(model) if callable(self.tp_plan) else dict(self.tp_plan)

    def dataset(self, cfg):
        from paratrain.train.data.source import Source
        from paratrain.train.data.torch_data import TorchData, is_torch_dataset

        if isinstance(self.data, Source):  # the user's own implementation of the protocol (train/data/source.py)
            return self.data
        if is_torch_dataset(self.data):  # a torch Dataset / IterableDataset: read by a DataLoader, sharded by us
            return TorchData(self.data)
        if callable(self.data):
            return FunctionDataset(self.data)
        from paratrain.train.data.indexed_sets import make_dataset

        if cfg.vocab_size is None:
            raise UserError(f"custom model {self.name} on token data: set vocab_size (--vocab-size)")
        return make_dataset(self.data or cfg.data, cfg.vocab_size, cfg.seq_len, cfg.seed)

    def describe(self, model: nn.Module) -> dict:
        """What a checkpoint records as the model: its name and every parameter's shape (the fingerprint)."""
        shapes = {n: list(p.shape) for n, p in model.named_parameters()}
        digest = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]
        return {"custom": self.name, "parameters": len(shapes), "shapes_sha256": digest}


class FunctionDataset(IndexedSet):
    """A user's data function as a data set: batch(indices) -> Batch(inputs, targets)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def batch(self, indices: np.ndarray) -> Batch:
        out = self.fn(indices)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise UserError("a custom data function must return (inputs, targets)")
        inputs, targets = (torch.as_tensor(x) for x in out)
        return Batch(inputs, targets)

    def batch_source(self, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                     shares: tuple[int, ...] = (), workers: int = 1) -> FunctionBatches:
        return FunctionBatches(self, global_batch, dp_rank, dp_size, micro_batch, shares)


class FunctionBatches(BatchSource):
    """BatchSource over a data function: a step's rows are the function's batch of their indices, not token
    windows."""

    def rank_batch(self, step: int) -> Batch:
        return self.dataset.batch(self.rank_indices(step))


def check_custom_run(cfg, world_size: int, custom: CustomModel):
    """validate_run for a custom model: the layout resolves and suits a model without a paratrain family."""
    from paratrain.parallel.strategies import resolve_layout

    if cfg.strategy == "auto":
        raise UserError("--strategy auto plans for paratrain's model families; name a strategy for a custom model")
    layout = resolve_layout(cfg, world_size)
    custom.check(layout, cfg)
    if cfg.ckpt_every and cfg.ckpt_every > cfg.steps:
        raise UserError(f"--ckpt-every {cfg.ckpt_every} is larger than --steps {cfg.steps}: no checkpoint would be saved")
    return layout


def load_script(spec: str) -> CustomModel:
    """`my_model.py:build` -> CustomModel(build, plus the file's optional `loss_fn`, `data`, `tp_plan`)."""
    path_text, sep, attr = spec.rpartition(":")
    if not sep or not path_text or not attr:
        raise UserError(f"--script {spec!r}: expected FILE.py:FUNCTION, e.g. my_model.py:build")
    path = Path(path_text)
    if not path.is_file():
        raise UserError(f"--script: file not found: {path}")
    name = f"paratrain_user_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)  # the user's own code, which they asked us to run
    except Exception as exc:  # noqa: BLE001 - any error in the user's file: one line naming it
        raise UserError(f"--script {path} failed to import: {type(exc).__name__}: {exc}") from None
    build = getattr(module, attr, None)
    if not callable(build):
        raise UserError(f"--script {path} has no function {attr!r}")
    return CustomModel(build, getattr(module, "loss_fn", None), getattr(module, "data", None),
                       getattr(module, "tp_plan", None), name=f"{path.name}:{attr}")
