"""Training data: a synthetic Markov chain with a known entropy floor, token .bin files, raw text bytes.

Every sample is a pure function of (seed, global sample index). The batch for step t is the samples
[t*G, (t+1)*G); a data-parallel rank takes a contiguous slice of it. So the global batch order does not
depend on the world size, which is what parity with a single-device run rests on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from paratrain.errors import UserError
from paratrain.train.data.counter_hash import uniform_hash


@dataclass
class Batch:
    """A micro-batch: inputs and next-token targets, both (batch, seq) int64. Document data (packed rows) adds
    each token's position inside its document and its document id (attention stays inside a document), and the
    global batch's count of real targets (the loss is the mean over them: train/step.py)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    global_tokens: int | None = None

    def _map(self, fn) -> Batch:
        return Batch(fn(self.inputs), fn(self.targets), None if self.positions is None else fn(self.positions),
                     None if self.doc_ids is None else fn(self.doc_ids), self.global_tokens)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def split(self, micro_batch: int) -> list[Batch]:
        """Micro-batches of `micro_batch` rows."""
        count = self.inputs.shape[0] // micro_batch
        return [self._map(lambda t, i=i: t[i * micro_batch:(i + 1) * micro_batch]) for i in range(count)]

    def model_kwargs(self) -> dict:
        """What the model takes besides the tokens: per-document positions and document ids (packed rows)."""
        if self.doc_ids is None:
            return {}
        return {"positions": self.positions, "doc_ids": self.doc_ids}


class IndexedSet:
    """A data set that gives any sample by its global index (`samples(indices)`): the Source (train/data/source.py)
    of BatchSource. What a subclass does not know (its floor, its size) is None; it opens its files when built."""

    def entropy_floor(self) -> float | None:
        return None

    def num_tokens(self) -> int | None:
        return None

    def check(self) -> None:
        return None

    def batch_source(self, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                     shares: tuple[int, ...] = (), workers: int = 1) -> BatchSource:
        return BatchSource(self, global_batch, dp_rank, dp_size, micro_batch, shares)


class SyntheticMarkov(IndexedSet):
    """Sequences from a seeded Markov chain whose transition matrix is a mixture of K random permutations.

    A mixture of permutation matrices is doubly stochastic, so the stationary distribution is uniform and
    the entropy rate (the best achievable next-token loss, in nats) is exactly the mean row entropy.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, branches: int = 4):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        rng = np.random.default_rng(seed + 7919)
        self.successors = np.stack([rng.permutation(vocab_size) for _ in range(branches)])  # (K, V)
        weights = 0.5 ** np.arange(branches, dtype=np.float64)
        self.weights = weights / weights.sum()
        self.cdf = np.cumsum(self.weights)
        self.cdf[-1] = 1.0

    def entropy_floor(self) -> float:
        total = 0.0
        for row in range(self.vocab_size):
            probs: dict[int, float] = {}
            for k in range(len(self.weights)):
                nxt = int(self.successors[k, row])
                probs[nxt] = probs.get(nxt, 0.0) + float(self.weights[k])
            total -= sum(p * math.log(p) for p in probs.values())
        return total / self.vocab_size

    def samples(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), seq_len + 1) tokens."""
        # Every random draw at once (stream t for position t); only the chain itself is sequential. This keeps
        # the loader's Python time (which holds the GIL against the training thread) to ~1 op per position.
        draws = uniform_hash(self.seed, indices[:, None], np.arange(self.seq_len + 1))
        branch = np.minimum(np.searchsorted(self.cdf, draws[:, 1:], side="right"), len(self.cdf) - 1)
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        out[:, 0] = (draws[:, 0] * self.vocab_size).astype(np.int64)
        for t in range(1, self.seq_len + 1):
            out[:, t] = self.successors[branch[:, t - 1], out[:, t - 1]]
        return out


class TokenFile(IndexedSet):
    """Windows of a flat token array: nanoGPT-style .bin (uint16, or uint32 for vocabularies > 65536),
    or the raw bytes of any other file (tokens 0..255).

    A .bin with a sidecar `tokens.bin.json` (from `paratrain data prepare`) takes its dtype from there, and its
    tokenizer's vocabulary must fit the model's. `split=(a, b)` keeps the tokens [a*n, b*n): training reads
    random windows inside it, validation (`sequential=True`) consecutive non-overlapping ones from its start.
    """

    def __init__(self, path: str, vocab_size: int, seq_len: int, seed: int = 0, split: tuple[float, float] = (0.0, 1.0),
                 sequential: bool = False):
        p = Path(path)
        if p.is_dir():
            raise UserError(f"--data {path} is a directory; give a token .bin file or a text file")
        if not p.is_file():
            raise UserError(f"data file not found: {path}")
        self.meta = None
        if p.suffix == ".bin":
            from paratrain.train.data.prepare_tokens import read_sidecar, sidecar_path

            self.meta = read_sidecar(p)
            if self.meta is not None and self.meta["vocab_size"] > vocab_size:
                raise UserError(f"{sidecar_path(p)}: the tokenizer's vocabulary ({self.meta['vocab_size']}) is larger "
                                f"than the model's ({vocab_size}); use --vocab-size {self.meta['vocab_size']} or more, "
                                "or a larger model")
            dtype = np.dtype(self.meta["dtype"]) if self.meta else (np.uint32 if vocab_size > 65536 else np.uint16)
            if p.stat().st_size % np.dtype(dtype).itemsize:
                raise UserError(f"data file {path} is not a whole number of {np.dtype(dtype).name} tokens")
        else:
            dtype = np.uint8
            if vocab_size < 256:
                raise UserError(f"text data needs a vocabulary of at least 256 byte tokens; model has {vocab_size}")
        try:
            self.tokens = np.memmap(p, dtype=dtype, mode="r")
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read data file {path}: {exc}") from None
        if self.meta is not None and self.meta.get("tokens") not in (None, len(self.tokens)):
            raise UserError(f"data file {path} holds {len(self.tokens)} tokens but its sidecar says {self.meta['tokens']}")
        n = len(self.tokens)
        self.lo, self.hi = int(n * split[0]), int(n * split[1])
        part = "" if split == (0.0, 1.0) else f" (its held-out part, {self.hi - self.lo} tokens)" if sequential \
            else f" (its training part, {self.hi - self.lo} tokens)"
        if self.hi - self.lo < seq_len + 2:
            raise UserError(f"data file {path}{part} has {self.hi - self.lo} tokens; need more than "
                            f"seq_len+1={seq_len + 1}")
        self.seq_len, self.seed, self.vocab_size = seq_len, seed, vocab_size
        self.sequential = sequential
        self.path = str(p)

    def num_tokens(self) -> int:
        return self.hi - self.lo

    def num_windows(self) -> int:
        """Non-overlapping windows of seq_len + 1 tokens (sharing an end token with the next)."""
        return (self.hi - self.lo - 1) // self.seq_len

    def window_starts(self, indices: np.ndarray) -> np.ndarray:
        span = self.hi - self.lo - self.seq_len - 1
        return self.lo + (uniform_hash(self.seed, indices, 1 << 20) * span).astype(np.int64)

    def sequential_starts(self, indices: np.ndarray) -> np.ndarray:
        return self.lo + np.asarray(indices, dtype=np.int64) * self.seq_len

    def samples(self, indices: np.ndarray) -> np.ndarray:
        starts = self.sequential_starts(indices) if self.sequential else self.window_starts(indices)
        out = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts])
        if out.max(initial=0) >= self.vocab_size:
            raise UserError(f"data file {self.path} holds token id {out.max()} >= vocab size {self.vocab_size}")
        return out


class HeldOut(IndexedSet):
    """Synthetic validation data: the same chain, at sample indices no training step ever draws."""

    OFFSET = 1 << 40

    def __init__(self, dataset: SyntheticMarkov):
        self.dataset = dataset

    def samples(self, indices: np.ndarray) -> np.ndarray:
        return self.dataset.samples(np.asarray(indices, dtype=np.int64) + self.OFFSET)


def make_dataset(spec: str, vocab_size: int, seq_len: int, seed: int, val_fraction: float = 0.0):
    """The training data set; with val_fraction, a data file's tail is held out (see make_val_dataset)."""
    if spec == "synthetic":
        return SyntheticMarkov(vocab_size, seq_len, seed)
    return TokenFile(spec, vocab_size, seq_len, seed, split=(0.0, 1.0 - val_fraction))


def make_val_dataset(spec: str, val_data: str | None, val_fraction: float, eval_every: int, vocab_size: int,
                     seq_len: int, seed: int):
    """The validation data set (read sequentially), or None when the run does not validate."""
    if val_data:
        if val_fraction:
            raise UserError("give --val-data or --val-fraction, not both")
        return TokenFile(val_data, vocab_size, seq_len, seed, sequential=True)
    if spec == "synthetic":
        if val_fraction:
            raise UserError("--val-fraction holds out the tail of a data file; synthetic data validates on "
                            "held-out sequences with --eval-every alone")
        return HeldOut(SyntheticMarkov(vocab_size, seq_len, seed)) if eval_every else None
    if val_fraction:
        return TokenFile(spec, vocab_size, seq_len, seed, split=(1.0 - val_fraction, 1.0), sequential=True)
    if eval_every:
        raise UserError(f"--eval-every needs --val-data or --val-fraction with --data {spec}")
    return None


def rank_slice(global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
               shares: tuple[int, ...] = ()) -> tuple[int, int]:
    """(rows, first row) of a data-parallel rank's slice of each global batch."""
    if shares:
        if len(shares) != dp_size or sum(shares) != global_batch:
            raise UserError(f"per-rank batches {shares} do not split the global batch {global_batch} "
                            f"over {dp_size} data-parallel ranks")
        local, offset = shares[dp_rank], sum(shares[:dp_rank])
    elif global_batch % dp_size:
        raise UserError(f"global batch {global_batch} is not divisible by the data-parallel degree {dp_size}")
    else:
        local = global_batch // dp_size
        offset = dp_rank * local
    if local % micro_batch:
        raise UserError(f"per-rank batch {local} is not divisible by micro-batch {micro_batch}")
    return local, offset


class SlicedSource:
    """What every batch source shares (token windows here, documents in stream_loader.py, a user's data set in
    torch_data.py): global_batch samples per step cut into `dp` contiguous rank slices, then each slice into
    micro-batches of `micro_batch`. `shares` (--dp-batch-split): each rank's slice size, in rank order, instead
    of global_batch / dp for all."""

    def __init__(self, dataset, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int,
                 shares: tuple[int, ...] = ()):
        self.local, self.offset = rank_slice(global_batch, dp_rank, dp_size, micro_batch, shares)
        self.dataset, self.global_batch = dataset, global_batch
        self.dp_rank, self.micro_batch = dp_rank, micro_batch
        self.step = 0

    def describe(self) -> str:
        return getattr(self.dataset, "path", None) or type(self.dataset).__name__

    @property
    def accumulation_steps(self) -> int:
        return self.local // self.micro_batch

    def tokens_drawn(self) -> dict[str, int] | None:
        return None


class BatchSource(SlicedSource):
    """Yields this rank's micro-batches for each optimizer step. Position (step) is the only state, so resuming
    is exact."""

    def rank_indices(self, step: int) -> np.ndarray:
        """The global sample indices of this rank's rows of step `step`."""
        first = step * self.global_batch + self.offset
        return np.arange(first, first + self.local, dtype=np.int64)

    def rank_batch(self, step: int) -> Batch:
        tokens = torch.from_numpy(self.dataset.samples(self.rank_indices(step)))
        return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def prefetcher(self, pin: bool = False, timeout_s: float | None = None, before_batch=None) -> Prefetcher:
        return Prefetcher(self, pin=pin, timeout_s=timeout_s, before_batch=before_batch)

    def next_step(self) -> list[Batch]:
        """Micro-batches for the next optimizer step, and advance the position."""
        batch = self.rank_batch(self.step)
        self.step += 1
        return [Batch(i, t) for i, t in zip(batch.inputs.split(self.micro_batch), batch.targets.split(self.micro_batch))]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class Prefetcher:
    """Builds upcoming steps' micro-batches on a background thread so the step never waits on data.

    Resumable: `position` counts the steps handed out, not the ones built ahead.
    """

    def __init__(self, source: BatchSource, depth: int = 2, pin: bool = False, timeout_s: float | None = None,
                 before_batch=None):
        """`before_batch(step)`: called on the loader thread before each step's batch is read (the trainer's
        before_batch hook, train/hooks.py: e.g. a slow loader stood in by a sleep)."""
        import queue
        import threading

        self.source, self.pin, self.timeout_s, self.before_batch = source, pin, timeout_s, before_batch
        self.position = source.step
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._fill, args=(source.step,), daemon=True)
        self.thread.start()

    def _fill(self, step: int) -> None:
        while not self.stop.is_set():
            try:
                if self.before_batch is not None:
                    self.before_batch(step)
                batch = self.source.rank_batch(step)
                micro = [Batch(i, t) for i, t in zip(batch.inputs.split(self.source.micro_batch),
                                                      batch.targets.split(self.source.micro_batch))]
                if self.pin:
                    micro = [m.pin_memory() for m in micro]
                item = (step, micro, None)
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
                item = (step, None, exc)
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except Exception:  # noqa: BLE001 - queue.Full: retry until stopped
                    continue
            if item[2] is not None:
                return
            step += 1

    def next_step(self) -> tuple[list[Batch], float]:
        """This step's micro-batches and how long we waited for them (seconds)."""
        import queue
        import time

        t0 = time.perf_counter()
        try:
            step, micro, exc = self.queue.get(timeout=self.timeout_s)
        except queue.Empty:
            from paratrain.train.recovery.run_failures import RunFailed

            raise RunFailed(f"the data loader produced no batch for step {self.position + 1} within "
                            f"{self.timeout_s:g} s (--timeout-s); it stalled reading {self.source.describe()}") from None
        waited = time.perf_counter() - t0
        if exc is not None:
            raise exc
        assert step == self.position
        self.position += 1
        self.source.step = self.position
        return micro, waited

    def close(self) -> None:
        self.stop.set()
