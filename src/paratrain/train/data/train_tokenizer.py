"""`paratrain data tokenizer`: a byte-level BPE tokenizer.json trained on your own documents (nothing is
downloaded), read as `train` reads them: each JSON Lines / Parquet / Arrow record's --text-field, each other file
whole (train/data/doc_sources.py). Byte-level: every byte has a token, so any text encodes; `<|endoftext|>` is its first token, which
`data prepare` puts after each document. For small experiments on a corpus of your own; for a published
model's vocabulary, pass that model's tokenizer.json to `data prepare` instead.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import UserError
from paratrain.interop.optional import require
from paratrain.train.data.prepare_tokens import input_files

EOT = "<|endoftext|>"
BYTES = 256
MAX_VOCAB = 1 << 20


def train_tokenizer(files: list[str | Path], out: str | Path, vocab_size: int, text_field: str = "text") -> dict:
    """Train on the documents of `files`, write OUT/tokenizer.json; returns a summary (path, vocab size reached,
    inputs with their documents)."""
    tokenizers = require("tokenizers", "paratrain data tokenizer")
    if not BYTES + 1 <= vocab_size <= MAX_VOCAB:
        raise UserError(f"--vocab-size {vocab_size}: give {BYTES + 1}..{MAX_VOCAB} (the {BYTES} bytes, "
                        f"{EOT}, then the merges)")
    paths = input_files(files, "data tokenizer")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: exists and is not a directory (the tokenizer.json goes inside)")

    from tokenizers import decoders, models, pre_tokenizers, trainers

    from paratrain.train.data.doc_sources import DocumentSource, file_sources, first_line

    sources = file_sources(paths, text_field)
    counts = [0] * len(sources)

    def documents():
        for i, spec in enumerate(sources):
            for text in DocumentSource(spec).texts():
                counts[i] += 1
                yield text

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    try:
        tok.train_from_iterator(documents(), trainer)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception subclasses
        raise UserError(f"cannot train a tokenizer on {', '.join(map(str, paths))}: {first_line(exc)}") from None
    out.mkdir(parents=True, exist_ok=True)
    target = out / "tokenizer.json"
    tok.save(str(target))
    return {"tokenizer": str(target), "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "requested_vocab_size": vocab_size, "eot": EOT,
            "sources": [{"path": str(p), "bytes": p.stat().st_size, "documents": n} for p, n in zip(paths, counts)]}
