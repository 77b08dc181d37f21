"""A tiny corpus in JSON Lines and Parquet, and a byte-level BPE tokenizer trained on it (nothing downloaded)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the cat sat on a mat while dogs ran far away from home and ate some bread with jam under a "
         "grey sky as rain fell on old roofs").split()
VOCAB = 300  # the tokenizer's; models run with --vocab-size 320


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_corpus(root: Path, seed: int = 0, jsonl_docs: int = 120, parquet_docs: int = 80) -> dict[str, str]:
    """root/a.jsonl, root/b.parquet (both with a "text" field), root/val.jsonl and root/tok/tokenizer.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from paratrain.train.data.train_tokenizer import train_tokenizer

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "a.jsonl", "w") as f:
        for i in range(jsonl_docs):
            f.write(json.dumps({"id": i, "text": document(rng, rng.randint(2, 30))}) + "\n")
    with open(root / "val.jsonl", "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": document(rng, rng.randint(2, 30))}) + "\n")
    pq.write_table(pa.table({"text": [document(rng, rng.randint(2, 30)) for _ in range(parquet_docs)]}),
                   root / "b.parquet")
    (root / "train.txt").write_text("\n".join(document(rng, 40) for _ in range(60)))
    train_tokenizer([root / "train.txt"], root / "tok", VOCAB)
    return {"a": str(root / "a.jsonl"), "b": str(root / "b.parquet"), "val": str(root / "val.jsonl"),
            "tok": str(root / "tok")}
