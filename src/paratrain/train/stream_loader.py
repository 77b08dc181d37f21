"""This rank's micro-batches from the global document stream (train/doc_stream.py), built in a worker process.

The worker reads, tokenizes and packs ahead of the step (a torch DataLoader with one worker process, so the
tokenizer never holds the training process's GIL) and hands each step's rows with the stream state *after*
that step. The trainer keeps the state of the last step it consumed, not of what the worker built ahead: that is
what a checkpoint saves, so a resume replays exactly the steps that were not trained yet.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import threading
import time

import numpy as np
import torch

from paratrain.errors import UserError
from paratrain.train.data import Batch, SlicedSource
from paratrain.train.doc_stream import DocumentStream, StreamConfig, StreamState, real_tokens


class DocumentData:
    """--data documents as a data set: the stream's definition and the model's vocabulary."""

    def __init__(self, cfg: StreamConfig, vocab_size: int):
        self.cfg, self.vocab_size = cfg, vocab_size
        self.path = ",".join(f"{s.pattern}:{s.weight:.3g}" for s in cfg.sources)

    def check(self) -> None:
        """Open the tokenizer and every source's first document: a bad file or field fails before any process."""
        from paratrain.train.doc_stream import open_source, open_tokenizer

        _, _, vocab = open_tokenizer(self.cfg.tokenizer)
        if vocab > self.vocab_size:
            raise UserError(f"--tokenizer {self.cfg.tokenizer}: its vocabulary ({vocab}) is larger than the "
                            f"model's ({self.vocab_size}); use --vocab-size {vocab} or more, or a larger model")
        for spec in self.cfg.sources:
            open_source(spec, self.cfg).first_document()

    def entropy_floor(self) -> None:
        return None

    def open(self, state: StreamState | None = None) -> DocumentStream:
        stream = DocumentStream(self.cfg, state)
        stream.vocab_limit = self.vocab_size
        return stream


def _tokenizer_threads(threads: int, worker_id: int) -> None:
    """In the fresh worker process, before its tokenizer first runs: the size of its thread pool."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    torch.set_num_threads(1)


class _RankSlices(torch.utils.data.IterableDataset):
    """In the worker: each step's rows for one rank, with the global real-token count and the state after it."""

    def __init__(self, data: DocumentData, state: dict | None, global_batch: int, offset: int, local: int):
        super().__init__()
        self.data, self.state = data, state
        self.global_batch, self.offset, self.local = global_batch, offset, local

    def __iter__(self):
        state = StreamState.from_json(self.state, len(self.data.cfg.sources)) if self.state else None
        stream = self.data.open(state)
        while True:
            rows = stream.next_global_batch(self.global_batch)
            mine = {k: torch.from_numpy(np.ascontiguousarray(v[self.offset:self.offset + self.local]))
                    for k, v in rows.items()}
            yield {**mine, "global_tokens": real_tokens(rows["targets"]), "state": stream.state_json()}


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


class StreamPrefetcher:
    """The Prefetcher (train/data.py) of a StreamBatchSource: next_step() -> (micro-batches, seconds waited)."""

    def __init__(self, source: StreamBatchSource, depth: int = 2, pin: bool = False, timeout_s: float | None = None,
                 before_batch=None):
        self.source, self.before_batch, self.timeout_s = source, before_batch, timeout_s
        self.position = source.step
        rows = _RankSlices(source.dataset, source.stream_state, source.global_batch, source.offset, source.local)
        # one worker process: the stream is sequential (packing carries over); its tokenizer runs `workers` threads
        process = 1 if source.workers else 0
        self.loader = torch.utils.data.DataLoader(
            rows, batch_size=None, num_workers=process, pin_memory=pin,
            prefetch_factor=depth if process else None, timeout=(timeout_s or 0) if process else 0,
            multiprocessing_context="fork" if process else None,
            worker_init_fn=functools.partial(_tokenizer_threads, source.workers) if process else None)
        self.iterator = iter(self.loader)
        # A thread takes each step's rows from the worker ahead of the step: the hand-over (the tensors' shared
        # memory, the state string) cost the fast CPU step 2-3 ms of data wait per step when done on demand.
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

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
        from paratrain.train.faults import RunFailed

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
        self.position += 1
        self.source.step = self.position
        self.source.stream_state, self.source.reader = json.loads(item["state"]), None
        return batch.split(self.source.micro_batch), waited

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        del self.iterator  # shuts the worker down
