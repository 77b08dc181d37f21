"""This rank's micro-batches from the global document stream (train/data/doc_stream.py), built in worker processes.

--data-workers N, the loader's worker processes per rank (a torch DataLoader's, so the tokenizer never holds the
training process's GIL):
- 1 (the default): one worker reads, tokenizes and packs ahead of the step and hands each step's rows.
- N > 1: N workers tokenize the stream's chunks of documents round-robin (worker w: chunks w, w+N, ...; each
  reads past the others' chunks, since a source is read in order); the DataLoader hands the chunks back in
  order, and a thread of the training process packs them into rows. The token stream is the same for every N.
- 0: everything in the training process's loader thread (debugging).
Each step's rows come with the stream state *after* that step. The trainer keeps the state of the last step it
consumed, not of what the workers built ahead: that is what a checkpoint saves, so a resume replays exactly the
steps that were not trained yet.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time

import numpy as np
import torch

from paratrain.errors import UserError
from paratrain.train.data.doc_stream import (
    DocumentReader,
    DocumentStream,
    StreamConfig,
    StreamState,
    real_tokens,
)
from paratrain.train.data.indexed_sets import Batch, SlicedSource


class DocumentData:
    """--data documents as a data set: the stream's definition and the model's vocabulary."""

    def __init__(self, cfg: StreamConfig, vocab_size: int):
        self.cfg, self.vocab_size = cfg, vocab_size
        self.path = ",".join(f"{s.pattern}:{s.weight:.3g}" for s in cfg.sources)

    def check(self) -> None:
        """Open the tokenizer and every source's first document: a bad file or field fails before any process."""
        from paratrain.train.data.doc_stream import open_source, open_tokenizer

        _, _, vocab = open_tokenizer(self.cfg.tokenizer)
        if vocab > self.vocab_size:
            raise UserError(f"--tokenizer {self.cfg.tokenizer}: its vocabulary ({vocab}) is larger than the "
                            f"model's ({self.vocab_size}); use --vocab-size {vocab} or more, or a larger model")
        for spec in self.cfg.sources:
            open_source(spec, self.cfg).first_document()

    def entropy_floor(self) -> None:
        return None

    def num_tokens(self) -> None:
        return None

    def batch_source(self, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                     shares: tuple[int, ...] = (), workers: int = 1) -> StreamBatchSource:
        return StreamBatchSource(self, global_batch, dp_rank, dp_size, micro_batch, shares, workers)

    def open(self, state: StreamState | None = None, chunks=None) -> DocumentStream:
        stream = DocumentStream(self.cfg, state, chunks)
        stream.vocab_limit = self.vocab_size
        return stream


def _one_thread(worker_id: int) -> None:
    """In the fresh worker process, before its tokenizer first runs: the process is the unit of parallelism."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)


def _as_is(chunk):
    return chunk


def _stream_state(data: DocumentData, state: dict | None) -> StreamState | None:
    return StreamState.from_json(state, len(data.cfg.sources)) if state else None


def rank_items(stream: DocumentStream, global_batch: int, offset: int, local: int):
    """Each step's rows for one rank, with the global real-token count and the stream state after the step."""
    while True:
        rows = stream.next_global_batch(global_batch)
        mine = {k: torch.from_numpy(np.ascontiguousarray(v[offset:offset + local])) for k, v in rows.items()}
        yield {**mine, "global_tokens": real_tokens(rows["targets"]), "state": stream.state_json()}


class _Chunks(torch.utils.data.IterableDataset):
    """In worker w of N: the tokenized chunks w, w+N, ... of the stream from a state (DocumentReader)."""

    def __init__(self, data: DocumentData, state: dict | None):
        super().__init__()
        self.data, self.state = data, state

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        n = len(self.data.cfg.sources)
        state = _stream_state(self.data, self.state) or StreamState(0, [[0, 0] for _ in range(n)], [], [0] * n)
        reader = DocumentReader(self.data.cfg, state)
        yield from reader.chunks(info.id, info.num_workers)


class _RankSlices(torch.utils.data.IterableDataset):
    """In the worker: each step's rows for one rank, with the global real-token count and the state after it."""

    def __init__(self, data: DocumentData, state: dict | None, global_batch: int, offset: int, local: int):
        super().__init__()
        self.data, self.state = data, state
        self.global_batch, self.offset, self.local = global_batch, offset, local

    def __iter__(self):
        stream = self.data.open(_stream_state(self.data, self.state))
        yield from rank_items(stream, self.global_batch, self.offset, self.local)


class StreamBatchSource(SlicedSource):
    """The BatchSource of document data: the same slicing (global batch -> dp slices -> micro-batches); its state
    is the step and the stream's state after it."""

    def __init__(self, data: DocumentData, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                 shares: tuple[int, ...] = (), workers: int = 1):
        super().__init__(data, global_batch, dp_rank, dp_size, micro_batch, shares)
        self.workers, self.stream_state = workers, None
        self.reader = None  # next_step()'s in-process stream, at the current state

    def state_dict(self) -> dict:
        return {"step": self.step, "stream": self.stream_state}

    def load_state_dict(self, state: dict) -> None:
        if "stream" not in state:
            raise UserError("the checkpoint was saved with another --data (it has no document-stream position)")
        sources = len(self.dataset.cfg.sources)
        if state["stream"] is not None:
            StreamState.from_json(state["stream"], sources)  # refuses another number of sources in one line
        self.step, self.stream_state, self.reader = int(state["step"]), state["stream"], None

    def next_step(self) -> list[Batch]:
        """The next step's micro-batches, read in this process (verify, calibration), and advance."""
        if self.reader is None:
            state = self.stream_state and StreamState.from_json(self.stream_state, len(self.dataset.cfg.sources))
            self.reader = self.dataset.open(state)
        rows = self.reader.next_global_batch(self.global_batch)
        mine = {k: torch.from_numpy(np.ascontiguousarray(v[self.offset:self.offset + self.local]))
                for k, v in rows.items()}
        self.step += 1
        self.stream_state = json.loads(self.reader.state_json())
        batch = Batch(mine["inputs"], mine["targets"], mine["positions"], mine["doc_ids"], real_tokens(rows["targets"]))
        return batch.split(self.micro_batch)

    def tokens_drawn(self) -> dict[str, int]:
        counts = self.stream_state["tokens_drawn"] if self.stream_state else [0] * len(self.dataset.cfg.sources)
        return {s.pattern: int(n) for s, n in zip(self.dataset.cfg.sources, counts)}

    def prefetcher(self, pin: bool = False, timeout_s: float | None = None, before_batch=None) -> StreamPrefetcher:
        return StreamPrefetcher(self, pin=pin, timeout_s=timeout_s, before_batch=before_batch)


class StreamPrefetcher:
    """The Prefetcher (train/data/indexed_sets.py) of a StreamBatchSource: next_step() -> (micro-batches, seconds waited)."""

    def __init__(self, source: StreamBatchSource, depth: int = 2, pin: bool = False, timeout_s: float | None = None,
                 before_batch=None):
        self.source, self.before_batch, self.timeout_s = source, before_batch, timeout_s
        self.position, self.pin = source.step, pin
        self.iterator = self._chunked() if source.workers > 1 else self._packed_in_worker(depth)
        # A thread takes each step's rows from the worker ahead of the step: the hand-over (the tensors' shared
        # memory, the state string) cost the fast CPU step 2-3 ms of data wait per step when done on demand.
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _loader(self, dataset, workers: int, prefetch: int, pin: bool):
        return torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=workers, pin_memory=pin, collate_fn=_as_is,
            prefetch_factor=prefetch if workers else None, timeout=(self.timeout_s or 0) if workers else 0,
            multiprocessing_context="fork" if workers else None, worker_init_fn=_one_thread if workers else None)

    def _packed_in_worker(self, depth: int):
        """--data-workers 0 or 1: the rows, packed in one worker process (0: in this process)."""
        source = self.source
        rows = _RankSlices(source.dataset, source.stream_state, source.global_batch, source.offset, source.local)
        return iter(self._loader(rows, min(source.workers, 1), depth, self.pin))

    def _chunked(self):
        """--data-workers N > 1: chunks tokenized by N worker processes, in order, packed here (on the thread)."""
        source = self.source
        chunks = iter(self._loader(_Chunks(source.dataset, source.stream_state), source.workers, 2, False))
        stream = source.dataset.open(_stream_state(source.dataset, source.stream_state), chunks)
        return rank_items(stream, source.global_batch, source.offset, source.local)

    def _receive(self) -> None:
        while not self.stop.is_set():
            try:
                item = (next(self.iterator), None)
            except Exception as exc:  # noqa: BLE001 - handed to the training thread, raised there
                item = (None, exc)
            while not self.stop.is_set():
                try:
                    self.ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return

    def _stalled(self):
        from paratrain.train.recovery.run_failures import RunFailed

        return RunFailed(f"the data loader produced no batch for step {self.position + 1} within "
                         f"{self.timeout_s:g} s (--timeout-s); it stalled reading {self.source.describe()}")

    def next_step(self) -> tuple[list[Batch], float]:
        t0 = time.perf_counter()
        if self.before_batch is not None:  # here on the training thread: what it costs is the loader's (a wait)
            self.before_batch(self.position)
        try:
            item, exc = self.ready.get(timeout=self.timeout_s)
        except queue.Empty:
            raise self._stalled() from None
        if exc is not None:
            if isinstance(exc, RuntimeError) and "timed out" in str(exc):
                raise self._stalled() from None
            raise exc
        waited = time.perf_counter() - t0
        batch = Batch(item["inputs"], item["targets"], item["positions"], item["doc_ids"], int(item["global_tokens"]))
        if self.pin and self.source.workers > 1:  # packed on the thread: pinned here, as the DataLoader pins
            batch = batch.pin_memory()
        self.position += 1
        self.source.step = self.position
        self.source.stream_state, self.source.reader = json.loads(item["state"]), None
        return batch.split(self.source.micro_batch), waited

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        del self.iterator  # shuts the worker down
