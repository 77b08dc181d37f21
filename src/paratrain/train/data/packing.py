"""Packing: tokenized documents -> rows of seq_len + 1 tokens, with document ids and per-document positions.

Packed (the default): documents follow each other, each ended by the end-of-text token; a document that does
not fit the row's rest carries over into the next row, where its positions start again at 0. Unpacked
(--no-pack): one document per row, cut at seq_len + 1 tokens, padded with end-of-text tokens whose document id
is -1. A row's inputs are its first seq_len tokens and its targets the last seq_len; a target counts only when
it continues the same document (never across a boundary, never padding): `IGNORE` marks the others.
"""

from __future__ import annotations

import numpy as np

IGNORE = -100  # cross_entropy's default ignore_index
PAD_DOC = -1


class Packer:
    """Fills rows from `next_document()` (token lists that end with end-of-text). Its only state is `carry`,
    the unplaced tail of the last document it started (empty when unpacked: a row never continues)."""

    def __init__(self, row_len: int, pack: bool, eot: int):
        self.row_len, self.pack, self.eot = row_len, pack, eot
        self.carry: list[int] = []

    def next_row(self, next_document) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, document ids, positions), each (row_len,)."""
        tokens = np.full(self.row_len, self.eot, dtype=np.int64)
        docs = np.full(self.row_len, PAD_DOC, dtype=np.int64)
        positions = np.zeros(self.row_len, dtype=np.int64)
        if not self.pack:
            doc = next_document()[:self.row_len]
            tokens[:len(doc)], docs[:len(doc)], positions[:len(doc)] = doc, 0, np.arange(len(doc))
            positions[len(doc):] = np.arange(self.row_len - len(doc))
            return tokens, docs, positions
        filled, doc_index = 0, 0
        while filled < self.row_len:
            doc = self.carry or next_document()
            take = min(len(doc), self.row_len - filled)
            tokens[filled:filled + take] = doc[:take]
            docs[filled:filled + take] = doc_index
            positions[filled:filled + take] = np.arange(take)
            self.carry = list(doc[take:])
            filled, doc_index = filled + take, doc_index + 1
        return tokens, docs, positions


def rows_to_batch(tokens: np.ndarray, docs: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """(rows, row_len) arrays -> inputs, targets (IGNORE across documents and on padding), positions, doc_ids."""
    targets = tokens[:, 1:].copy()
    keep = (docs[:, :-1] == docs[:, 1:]) & (docs[:, 1:] != PAD_DOC)
    targets[~keep] = IGNORE
    return {"inputs": tokens[:, :-1].copy(), "targets": targets, "positions": positions[:, :-1].copy(),
            "doc_ids": docs[:, :-1].copy()}
