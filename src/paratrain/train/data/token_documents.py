"""A token .bin file (from `paratrain data prepare`) as a document source of a mixture: its documents are the
runs of tokens its sidecar's end-of-text id ends, already tokenized. Same interface and position (epoch, offset)
as doc_sources.DocumentSource, so it mixes with JSON Lines / Parquet / Arrow / text sources by weight."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from paratrain.errors import UserError
from paratrain.train.data.doc_sources import SourceSpec, held_out


class TokenDocuments:
    def __init__(self, spec: SourceSpec, tokenizer_file: Path | None = None, seed: int = 0, part: str = "all",
                 fraction: float = 0.0):
        from paratrain.train.data.prepare_tokens import read_sidecar, sidecar_path

        self.spec, self.seed, self.part, self.fraction = spec, seed, part, fraction
        self.files = []
        for name in spec.files:
            meta = read_sidecar(name)
            if meta is None or meta.get("eot_id") is None:
                raise UserError(f"--data {name}: a token file in a mixture needs its sidecar {sidecar_path(name)} "
                                "with an end-of-text id (paratrain data prepare writes one) to find its documents")
            if tokenizer_file is not None and meta.get("tokenizer_sha256") not in (None, _sha256(tokenizer_file)):
                raise UserError(f"--data {name} was tokenized with another tokenizer ({meta.get('tokenizer')}) than "
                                f"--tokenizer ({tokenizer_file}); mixed sources must share one vocabulary")
            tokens = np.memmap(name, dtype=np.dtype(meta["dtype"]), mode="r")
            ends = np.flatnonzero(tokens == meta["eot_id"]) + 1
            self.files.append((tokens, np.concatenate([[0], ends]).astype(np.int64)))
        if not any(len(bounds) > 1 for _, bounds in self.files):
            raise UserError(f"--data {spec.pattern}: holds no documents (no end-of-text token)")

    def _keep(self, index: int) -> bool:
        if self.part == "all" or self.fraction == 0:
            return self.part != "val"
        return held_out(self.seed, index, self.fraction) == (self.part == "val")

    def _all(self):
        for tokens, bounds in self.files:
            for start, stop in zip(bounds[:-1], bounds[1:]):
                yield tokens[start:stop]

    def documents(self, epoch: int = 0, offset: int = 0):
        """Yields (epoch, offset after this document, its tokens with their end-of-text), forever."""
        while True:
            kept_any, whole_epoch = False, offset == 0
            for index, doc in enumerate(self._all()):
                if index < offset:
                    continue
                offset = index + 1
                if self._keep(index):
                    kept_any = True
                    yield epoch, offset, [int(t) for t in doc]
            if not kept_any and whole_epoch:
                raise UserError(f"--data {self.spec.pattern}: holds no {self.part} documents (--val-fraction)")
            epoch, offset = epoch + 1, 0

    def first_document(self) -> list[int]:
        return next(self.documents())[2]


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
