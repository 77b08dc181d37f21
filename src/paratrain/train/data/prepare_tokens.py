"""`paratrain data prepare`: text files -> nanoGPT-style flat tokens (tokens.bin) + a JSON sidecar.

Tokenizes with a local `tokenizer.json` (the `tokenizers` library; nothing is downloaded). Each record of a JSON
Lines / Parquet / Arrow file is one document (its --text-field), and so is each other input file; every document
is followed by the end-of-text token when the vocabulary has one. Large files are encoded in
chunks cut at line ends, written as they go; a progress bar shows on stderr for inputs over 8 MB. The sidecar
`tokens.bin.json` (written last) says how to read the tokens and what made them: dtype, vocab size, token and
document counts, and the tokenizer's sha256, so `train` can check the vocabulary against the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from paratrain.errors import UserError
from paratrain.interop.optional import require

SIDECAR_SUFFIX = ".json"
FORMAT = "paratrain-tokens"
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>")
CHUNK_CHARS = 1 << 20  # encode ~1M characters at a time
PROGRESS_BYTES = 8 << 20


def sidecar_path(tokens: str | Path) -> Path:
    return Path(str(tokens) + SIDECAR_SUFFIX)


def tokenizer_file(path: str | Path) -> Path:
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise UserError(f"--tokenizer {path}: no tokenizer.json there")
    return f


def load_tokenizer(path: str | Path):
    tokenizers = require("tokenizers", "paratrain data prepare")
    f = tokenizer_file(path)
    try:
        return f, tokenizers.Tokenizer.from_file(str(f))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception subclasses
        raise UserError(f"{f} is not a readable tokenizer.json: {str(exc).splitlines()[0][:200]}") from None


def pick_eot(tok, eot: str | None) -> int | None:
    if eot is not None:
        token_id = tok.token_to_id(eot)
        if token_id is None:
            raise UserError(f"--eot {eot!r} is not in the tokenizer's vocabulary")
        return token_id
    for name in EOT_CANDIDATES:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _cut(text: str) -> int:
    """Where to end a chunk: just before a line break that follows a non-space character (0: nowhere).

    Byte-level BPE pre-tokenizers (GPT-2's regex) never join a non-space character with the whitespace after
    it, and a whitespace run is split the same way wherever it starts after one; so there the chunks encode
    exactly as the whole text does. (A cut right after the line break would not: "\\n\\n" at the end of a chunk
    is one pre-token, inside the text it is two.)"""
    i = text.rfind("\n")
    while i > 0 and text[i - 1].isspace():
        i = text.rfind("\n", 0, i - 1)
    return max(i, 0)


def read_chunks(path: Path, chunk_chars: int):
    """The file's text in pieces of about chunk_chars characters, cut as _cut() says (or at EOF)."""
    try:
        with path.open(encoding="utf-8", errors="replace", newline="") as f:
            carry = ""
            while True:
                block = f.read(chunk_chars)
                if not block:
                    if carry:
                        yield carry
                    return
                text = carry + block
                cut = _cut(text)
                if cut == 0:
                    carry = text
                    continue
                yield text[:cut]
                carry = text[cut:]
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


class _Progress:
    def __init__(self, total_bytes: int, enabled: bool):
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]tokenize"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("tokenize", total=total_bytes)
            self.bar.start()

    def advance(self, nbytes: int) -> None:
        if self.bar:
            self.bar.advance(self.task, nbytes)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


def input_files(files: list[str | Path], command: str) -> list[Path]:
    """The text files a `data` command reads: at least one, each an existing file."""
    paths = [Path(f) for f in files]
    if not paths:
        raise UserError(f"{command} needs at least one input file")
    for p in paths:
        if not p.is_file():
            raise UserError(f"input file not found: {p}")
    return paths


def documents_of(spec, chunk_chars: int):
    """A file's documents, each as text pieces: every record of a JSON Lines / Parquet / Arrow file, read as
    `train` reads it (train/data/doc_sources.py), or the whole of any other file (in chunks)."""
    from paratrain.train.data.doc_sources import DocumentSource

    if spec.fmt != "text":
        for text in DocumentSource(spec).texts():
            yield [text]
    else:
        yield read_chunks(Path(spec.pattern), chunk_chars)


def prepare_tokens(tokenizer: str | Path, files: list[str | Path], out: str | Path, eot: str | None = None,
                   progress: bool | None = None, chunk_chars: int = CHUNK_CHARS, text_field: str = "text") -> dict:
    """Tokenize `files` into `out` (flat uint16/uint32) and write the sidecar; returns the sidecar dict. A JSON
    Lines / Parquet / Arrow file holds one document per record (its `text_field`: NAME or SOURCE=NAME,...);
    any other file is one."""
    from paratrain.train.data.doc_sources import file_sources

    tok_file, tok = load_tokenizer(tokenizer)
    paths = input_files(files, "data prepare")
    specs = file_sources(paths, text_field)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    eot_id = pick_eot(tok, eot)
    total_bytes = sum(p.stat().st_size for p in paths)
    if progress is None:
        progress = total_bytes > PROGRESS_BYTES and sys.stderr.isatty()
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    bar = _Progress(total_bytes, progress)
    count, sources, documents = 0, [], 0
    try:
        with partial.open("wb") as f:
            for p, spec in zip(paths, specs):
                n_before, docs_before = count, documents
                for pieces in documents_of(spec, chunk_chars):
                    for chunk in pieces:
                        ids = np.asarray(tok.encode(chunk, add_special_tokens=False).ids, dtype=dtype)
                        ids.tofile(f)
                        count += len(ids)
                        bar.advance(len(chunk.encode("utf-8", errors="replace")))
                    if eot_id is not None:
                        np.asarray([eot_id], dtype=dtype).tofile(f)
                        count += 1
                    documents += 1
                sources.append({"path": str(p), "bytes": p.stat().st_size, "tokens": count - n_before,
                                "documents": documents - docs_before})
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    except BaseException:  # a bad input file part-way (one error line) leaves nothing behind
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    meta = {"format": FORMAT, "version": 1, "dtype": np.dtype(dtype).name, "vocab_size": vocab, "tokens": count,
            "documents": documents, "eot_id": eot_id, "tokenizer": str(tok_file),
            "tokenizer_sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest(), "sources": sources}
    os.replace(partial, out)
    side = sidecar_path(out)
    side.with_name(side.name + ".tmp").write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(side.with_name(side.name + ".tmp"), side)
    return meta


def read_sidecar(tokens: str | Path) -> dict | None:
    """The sidecar of a token file, or None when there is none (a plain nanoGPT .bin)."""
    side = sidecar_path(tokens)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        raise UserError(f"{side} is not readable JSON") from None
    if not isinstance(meta, dict) or meta.get("dtype") not in ("uint16", "uint32") or \
            not isinstance(meta.get("vocab_size"), int):
        raise UserError(f"{side} is not a paratrain token sidecar (needs dtype uint16|uint32 and vocab_size)")
    return meta
