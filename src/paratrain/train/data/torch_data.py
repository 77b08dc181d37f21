"""A user's torch.utils.data Dataset or IterableDataset as paratrain's data (the Python API, docs/api.md).

Sharding is paratrain's, as for every other source: the global stream of samples is cut into global batches
of `global_batch`, and data-parallel rank r takes its rows [offset, offset + local) of each. So the samples of
step t do not depend on the data-parallel size, and a resume at step t (at any size) continues the same stream.

- A map-style Dataset: step t's global batch is samples t*G .. t*G+G-1 (modulo len(dataset): epochs repeat in
  order). Read by a torch DataLoader with `data_workers` worker processes (each builds whole steps).
- An IterableDataset: read in order; every rank iterates it whole and keeps its rows; a resume skips t*G samples.
  One worker process at most (the stream's order is its content), none with data_workers=0.
Each sample is (inputs, targets); the default collate stacks them.
"""

from __future__ import annotations

import itertools
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

from paratrain.errors import UserError
from paratrain.train.data.indexed_sets import Batch, SlicedSource


def is_torch_dataset(data) -> bool:
    return isinstance(data, torch.utils.data.Dataset)


class TorchData:
    """The user's data set, as the trainer's data set (no entropy floor, its own loader)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.path = type(dataset).__name__
        if not isinstance(dataset, IterableDataset):
            try:
                self.length = len(dataset)
            except TypeError:
                raise UserError(f"{self.path}: a map-style Dataset needs __len__ (or make it an IterableDataset)")\
                    from None
            if self.length == 0:
                raise UserError(f"{self.path} is empty")

    def entropy_floor(self) -> None:
        return None

    def num_tokens(self) -> None:
        return None

    def check(self) -> None:
        return None  # nothing to open: the data set is the user's object, checked when it was wrapped

    def batch_source(self, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                     shares: tuple[int, ...] = (), workers: int = 1) -> TorchBatchSource:
        return TorchBatchSource(self, global_batch, dp_rank, dp_size, micro_batch, shares, workers)


class _StepBatches(torch.utils.data.Sampler):
    """Map-style: this rank's sample indices of each step, from `start` on."""

    def __init__(self, start: int, global_batch: int, offset: int, local: int, length: int):
        self.start, self.global_batch, self.offset, self.local, self.length = start, global_batch, offset, local, length

    def __iter__(self):
        for step in itertools.count(self.start):
            first = step * self.global_batch + self.offset
            yield [(first + j) % self.length for j in range(self.local)]


class _RankRows(IterableDataset):
    """Iterable: the dataset's samples from sample `skip` on, this rank's rows of each global batch."""

    def __init__(self, dataset, skip: int, global_batch: int, offset: int, local: int):
        super().__init__()
        self.dataset, self.skip, self.global_batch, self.offset, self.local = dataset, skip, global_batch, offset, local

    def __iter__(self):
        samples = itertools.islice(iter(self.dataset), self.skip, None)
        while True:
            rows = list(itertools.islice(samples, self.global_batch))
            if len(rows) < self.global_batch:
                return
            yield from rows[self.offset:self.offset + self.local]


class TorchBatchSource(SlicedSource):
    """The BatchSource of a user's data set: step is its whole state."""

    def __init__(self, data: TorchData, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                 shares: tuple[int, ...] = (), workers: int = 1):
        super().__init__(data, global_batch, dp_rank, dp_size, micro_batch, shares)
        self.workers = workers

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    def prefetcher(self, pin: bool = False, timeout_s: float | None = None, before_batch=None) -> TorchPrefetcher:
        return TorchPrefetcher(self, pin=pin, timeout_s=timeout_s, before_batch=before_batch)


class TorchPrefetcher:
    """next_step() -> (micro-batches, seconds waited), from a torch DataLoader over the user's data set."""

    def __init__(self, source: TorchBatchSource, depth: int = 2, pin: bool = False, timeout_s: float | None = None,
                 before_batch=None):
        self.source, self.before_batch, self.position = source, before_batch, source.step
        data = source.dataset.dataset
        if isinstance(data, IterableDataset):
            rows = _RankRows(data, source.step * source.global_batch, source.global_batch, source.offset,
                             source.local)
            workers = min(source.workers, 1)
            loader = DataLoader(rows, batch_size=source.local, num_workers=workers, pin_memory=pin,
                                prefetch_factor=depth if workers else None, timeout=(timeout_s or 0) if workers else 0)
        else:
            sampler = _StepBatches(source.step, source.global_batch, source.offset, source.local,
                                   source.dataset.length)
            loader = DataLoader(data, batch_sampler=sampler, num_workers=source.workers, pin_memory=pin,
                                prefetch_factor=depth if source.workers else None,
                                timeout=(timeout_s or 0) if source.workers else 0)
        self.iterator = iter(loader)

    def next_step(self) -> tuple[list[Batch], float]:
        t0 = time.perf_counter()
        if self.before_batch is not None:  # here on the training thread: what it costs is the loader's (a wait)
            self.before_batch(self.position)
        try:
            item = next(self.iterator)
        except StopIteration:
            raise UserError(f"{self.source.describe()} ran out of samples at step {self.position + 1}") from None
        waited = time.perf_counter() - t0
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise UserError(f"{self.source.describe()}: each sample must be (inputs, targets)")
        self.position += 1
        self.source.step = self.position
        return Batch(torch.as_tensor(item[0]), torch.as_tensor(item[1])).split(self.source.micro_batch), waited

    def close(self) -> None:
        del self.iterator
