"""Document sources: local JSON Lines / Parquet / Arrow / text files streamed through Hugging Face `datasets`.

`--data 'web/*.jsonl:0.7,code.parquet:0.3'` names one or more sources, each a file, a glob or a directory,
with an optional weight. A source yields its documents' text in file order, forever (epoch after epoch), and can
start at any (epoch, offset): that pair is its whole position, so a resumed run reopens it exactly there.
Nothing is downloaded: `datasets.load_dataset(<format>, data_files=..., streaming=True)` reads local files.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.errors import UserError
from paratrain.interop.text_fields import DEFAULT_FIELD, fields_for

# file suffix -> the `datasets` packaged builder that reads it
FORMAT_OF = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text",
             ".text": "text", ".md": "text", ".bin": "tokens"}
TOKEN_SUFFIXES = (".bin",)
HELD_OUT_STREAM = 424242  # the hash stream that decides which documents --val-fraction holds out
MIXTURE_SYNTAX = "a mixture is written A:w,B:w, e.g. 'web/*.jsonl:0.7,code.parquet:0.3'"


@dataclass(frozen=True)
class SourceSpec:
    """One entry of --data: its pattern, its files (sorted), its builder, its mixture weight, its records' text
    field, and the option that named it (how messages call it: '--data', or '' for a command's file argument)."""

    pattern: str
    files: tuple[str, ...]
    fmt: str
    weight: float
    text_field: str = DEFAULT_FIELD
    origin: str = "--data"

    @property
    def label(self) -> str:
        return f"{self.origin} {self.pattern}" if self.origin else self.pattern


def is_document_spec(spec: str, tokenizer: str | None = None) -> bool:
    """True when --data names documents to tokenize: JSON Lines / Parquet / Arrow files, a glob, a directory, a
    weighted mixture, or anything but a token .bin with --tokenizer (a lone text file without one is raw bytes)."""
    if spec == "synthetic":
        return False
    if tokenizer:
        return Path(spec).suffix.lower() not in TOKEN_SUFFIXES
    entries = [split_weight(part)[0] for part in spec.split(",")]
    if len(entries) > 1 or spec != entries[0]:
        return True
    path = Path(entries[0])
    if path.is_dir() or any(ch in entries[0] for ch in "*?["):
        return True
    return path.suffix.lower() in FORMAT_OF and path.suffix.lower() not in (".txt", ".text", ".md", *TOKEN_SUFFIXES)


def split_weight(entry: str) -> tuple[str, float | None]:
    """'a.jsonl:0.7' -> ('a.jsonl', 0.7); 'a.jsonl' -> ('a.jsonl', None)."""
    head, sep, tail = entry.rpartition(":")
    if sep and head:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return entry, None


def mixture_mistake(entry: str) -> str | None:
    """Why an --data entry that names no file looks like a mixture written wrong (None: it does not)."""
    if ";" in entry:
        return "sources are separated by ','"
    head, sep, tail = entry.rpartition("=")
    if sep and head and split_weight(f"{head}:{tail}")[1] is not None:
        return "a weight follows ':'"
    head, sep, tail = entry.rpartition(":")
    if sep and "/" not in tail and Path(head).suffix.lower() in FORMAT_OF and split_weight(entry)[1] is None:
        return f"the weight {tail!r} is not a number"
    return None


def refuse_mixture_mistakes(spec: str) -> None:
    """UserError, with the mixture syntax, for an entry that names no file and looks like a mixture written wrong."""
    for entry in (part.strip() for part in spec.split(",")):
        mistake = mixture_mistake(entry) if entry else None
        if mistake and not _exists(split_weight(entry)[0]):
            raise UserError(f"--data {entry}: no such file ({mistake}); {MIXTURE_SYNTAX}")


def _exists(pattern: str) -> bool:
    try:
        return os.path.exists(pattern) or bool(glob.glob(pattern, recursive=True))
    except (OSError, ValueError):  # a name the OS refuses (too long, a NUL byte)
        return False


def expand_files(pattern: str) -> list[str]:
    path = Path(pattern)
    if path.is_dir():
        found = [str(p) for p in sorted(path.rglob("*")) if p.is_file() and p.suffix.lower() in FORMAT_OF]
    elif any(ch in pattern for ch in "*?["):
        found = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
    else:
        found = [pattern] if path.is_file() else []
    if not found:
        raise UserError(f"--data {pattern}: no such file, or no JSON Lines / Parquet / Arrow / text files there")
    return found


def parse_sources(spec: str, text_field: str = DEFAULT_FIELD) -> list[SourceSpec]:
    """--data 'A:w,B:w' -> the sources with normalised weights (an entry without a weight counts 1), each with
    its text field (text_fields.py; a --text-field SOURCE that names none of them is not checked here)."""
    refuse_mixture_mistakes(spec)
    entries = [split_weight(part.strip()) for part in spec.split(",") if part.strip()]
    if not entries:
        raise UserError("--data is empty")
    fields = fields_for([pattern for pattern, _ in entries], text_field, strict=False)
    out = []
    for (pattern, weight), field in zip(entries, fields):
        if weight is not None and not (weight > 0 and np.isfinite(weight)):
            raise UserError(f"--data {pattern}:{weight:g}: a mixture weight must be a positive number")
        files = expand_files(pattern)
        suffixes = {Path(f).suffix.lower() for f in files}
        formats = {FORMAT_OF.get(s) for s in suffixes}
        if None in formats or len(formats) != 1:
            raise UserError(f"--data {pattern}: its files must all be one of JSON Lines / Parquet / Arrow / text / "
                            f"token .bin (found {', '.join(sorted(suffixes))})")
        out.append(SourceSpec(pattern, tuple(files), formats.pop(), 1.0 if weight is None else weight, field))
    total = sum(s.weight for s in out)
    return [SourceSpec(s.pattern, s.files, s.fmt, s.weight / total, s.text_field) for s in out]


def file_sources(files: list[Path], text_field: str = DEFAULT_FIELD) -> list[SourceSpec]:
    """A `data` command's input files as sources: JSON Lines / Parquet / Arrow records, any other file text."""
    out = []
    for path, field in zip(files, fields_for([str(f) for f in files], text_field)):
        fmt = FORMAT_OF.get(path.suffix.lower(), "text")
        if fmt == "tokens":
            raise UserError(f"{path}: a token file; give the text files it was prepared from")
        out.append(SourceSpec(str(path), (str(path),), fmt, 1.0, field, origin=""))
    return out


def held_out(seed: int, index: int, fraction: float) -> bool:
    """Whether document `index` of a source belongs to the --val-fraction held-out part (a pure hash)."""
    from paratrain.train.data.counter_hash import uniform_hash

    return bool(uniform_hash(seed, np.array([index]), HELD_OUT_STREAM)[0] < fraction)


class DocumentSource:
    """A source's documents as text, from position (epoch, offset) on. `part`: 'all', 'train' or 'val' (the
    documents --val-fraction keeps for training or holds out; offsets count the source's documents in file order,
    held-out ones included, so the position does not depend on the fraction's draw)."""

    def __init__(self, spec: SourceSpec, seed: int = 0, part: str = "all", fraction: float = 0.0):
        self.spec, self.seed, self.part, self.fraction = spec, seed, part, fraction

    def _open(self):
        if getattr(self, "_opened", None) is None:  # once: each epoch iterates the same streaming data set again
            self._opened = self._load()
        return self._opened

    def _load(self):
        from paratrain.interop.optional import require

        # local files only: datasets never asks the Hub (set before its first import reads them)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        datasets = require("datasets", "reading JSON Lines / Parquet / Arrow / text documents")
        datasets.disable_progress_bars()
        if "DATASETS_VERBOSITY" not in os.environ:
            # its readers log a failure before raising it, on its own handler and on ours: the user gets it
            # once, as our one error line
            datasets.utils.logging.set_verbosity(logging.CRITICAL)
        if all(os.path.getsize(f) == 0 for f in self.spec.files):
            raise UserError(f"{self.spec.label}: holds no documents "
                            f"({'the file is' if len(self.spec.files) == 1 else 'its files are'} empty)")
        kwargs = {"sample_by": "document"} if self.spec.fmt == "text" else {}
        try:
            return datasets.load_dataset(self.spec.fmt, data_files=list(self.spec.files), split="train",
                                         streaming=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the library raises many types for an unreadable file
            raise UserError(f"{self.spec.label}: cannot read it: {first_line(exc)}") from None

    def _text(self, row: dict) -> str:
        field = "text" if self.spec.fmt == "text" else self.spec.text_field
        if field not in row:
            raise UserError(f"{self.spec.label}: a record has no field {field!r} (it has "
                            f"{', '.join(sorted(row)) or 'none'}); name its text column with --text-field "
                            f"{self._field_hint(row)}")
        value = row[field]
        if not isinstance(value, str):
            raise UserError(f"{self.spec.label}: field {field!r} holds {type(value).__name__}, not text")
        return value

    def _field_hint(self, row: dict) -> str:
        """How to name the field: for every source, or for this one alone (a record's first text field)."""
        name = next((key for key, value in row.items() if isinstance(value, str)), "NAME")
        return f"{name}, or --text-field {Path(self.spec.pattern).name}={name} for this source alone"

    def _keep(self, index: int) -> bool:
        if self.part == "all" or self.fraction == 0:
            return self.part != "val"
        return held_out(self.seed, index, self.fraction) == (self.part == "val")

    def _epoch(self, epoch: int, offset: int):
        """Yields (epoch, offset after this document, text) to the end of the files."""
        stream = self._open()
        if offset:
            stream = stream.skip(offset)
        kept_any, whole_epoch = False, offset == 0
        for row in self._rows(stream):
            index = offset
            offset += 1
            if self._keep(index):
                kept_any = True
                yield epoch, offset, self._text(row)
        if not kept_any and whole_epoch:
            what = "documents" if self.part == "all" else f"{self.part} documents (--val-fraction)"
            raise UserError(f"{self.spec.label}: holds no {what}")

    def documents(self, epoch: int = 0, offset: int = 0):
        """Yields (epoch, offset after this document, text), forever; offset counts every document read."""
        while True:
            yield from self._epoch(epoch, offset)
            epoch, offset = epoch + 1, 0

    def texts(self):
        """Every document's text once, in file order (what the `data` commands read)."""
        for *_, text in self._epoch(0, 0):
            yield text

    def first_document(self) -> str:
        """The first document's text (checks the files and --text-field before any process starts)."""
        for row in self._rows(self._open()):
            return self._text(row)
        raise UserError(f"{self.spec.label}: holds no documents")

    def _rows(self, stream):
        """A streaming dataset's records, one dict each. Through `iter()`: plain iteration inside a DataLoader
        worker shards the files across the workers, and every loader worker here reads the whole stream in
        order. A file that fails part-way (bad UTF-8, a truncated record) is one error line."""
        try:
            for batch in stream.iter(batch_size=1):
                yield {key: values[0] for key, values in batch.items()}
        except Exception as exc:  # noqa: BLE001 - the library raises many types for an unreadable file
            raise UserError(f"{self.spec.label}: cannot read it: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    """An exception's first line for an error message (its type when it has no text, as StopIteration)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__
