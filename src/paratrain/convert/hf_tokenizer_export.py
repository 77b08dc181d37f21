"""The tokenizer beside an exported transformers model: the one the run's ids came from, loadable by AutoTokenizer.

Which files: the run's own `--tokenizer` (recorded in the manifest) when it trained on documents, else the
source directory's tokenizer files. A bare `tokenizer.json` (what `paratrain data tokenizer` writes) gets a
`tokenizer_config.json` naming transformers' generic class, which takes the file as it is. Left to itself,
AutoTokenizer would pick the model type's own class (Qwen2Tokenizer for qwen2 / qwen3_moe), whose constructor
builds its own normalizer and pre-tokenizer over the file's vocabulary: other ids for the same text.

transformers 5 maps some model types (qwen2 among them) to their own class whatever the tokenizer_config.json
names. Its generic loader still takes tokenizer.json as it is when the config sets `trust_remote_code`; that key
runs no code (an export holds no auto_map and no .py file: there is no code to run), so it is written only when
the plain config did not do it. Either way the export loads the directory with AutoTokenizer and compares its
pipeline (normalizer, pre-tokenizer, model) with the file's; if they still differ, one warning says so and how to
load the tokenizer exactly.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from paratrain.convert.export_plan import write_json
from paratrain.errors import UserError

log = logging.getLogger("paratrain")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
PIPELINE = ("normalizer", "pre_tokenizer", "model")


def copy_files(names, src_dir: Path, out: Path) -> list[str]:
    """Copy each named file of `src_dir` that exists into `out` (never code files); returns the names copied."""
    written = []
    for name in names:
        if (src_dir / name).is_file():
            _copy(src_dir / name, out / name)
            written.append(name)
    return written


def _copy(src: Path, dst: Path) -> None:
    try:
        if not (dst.exists() and dst.samefile(src)):  # exporting into the source directory itself
            shutil.copyfile(src, dst)
    except OSError as exc:
        raise UserError(f"cannot copy {src} to {dst.parent}: {exc.strerror or exc}") from None


def write_tokenizer(out: Path, run_tokenizer: str | None, source_dir: Path | None, spec: str) -> list[str]:
    """The tokenizer files for `out`; returns the names written."""
    if run_tokenizer:
        given = Path(run_tokenizer)
        if given.is_file():  # --tokenizer FILE: a tokenizer.json of any name
            _copy(given, out / "tokenizer.json")
            written = ["tokenizer.json"]
        elif given.is_dir():
            written = copy_files(TOKENIZER_FILES, given, out)
        else:
            log.warning("the tokenizer %s was trained with is gone: no tokenizer written (put it back and export "
                        "again)", run_tokenizer)
            return []
    elif source_dir is not None:
        written = copy_files(TOKENIZER_FILES, source_dir, out)
    else:
        return []
    if "tokenizer.json" in written and "tokenizer_config.json" not in written:
        written.append(_make_auto_tokenizer_take_it(out, spec))
    return written


def _make_auto_tokenizer_take_it(out: Path, spec: str) -> str:
    import transformers

    generic = "TokenizersBackend" if hasattr(transformers, "TokenizersBackend") else "PreTrainedTokenizerFast"
    doc = {"tokenizer_class": generic}
    write_json(out / "tokenizer_config.json", doc)
    if _loads_as_written(out) is not None:
        write_json(out / "tokenizer_config.json", {**doc, "trust_remote_code": True})  # see the module docstring
        differs = _loads_as_written(out)
        if differs is not None:
            log.warning("transformers %s's AutoTokenizer builds its own %s for %s over this tokenizer.json, so "
                        "its ids differ from training's: load it with PreTrainedTokenizerFast(tokenizer_file="
                        "'%s')", transformers.__version__, differs, spec, out / "tokenizer.json")
    return "tokenizer_config.json"


def _loads_as_written(out: Path) -> str | None:
    """None when AutoTokenizer on `out` runs tokenizer.json's own pipeline, else the first part it replaces."""
    import transformers

    from paratrain.models.hf_model import quiet_transformers

    try:
        with quiet_transformers():
            backend = getattr(transformers.AutoTokenizer.from_pretrained(str(out)), "backend_tokenizer", None)
    except Exception as exc:  # noqa: BLE001 - whatever transformers refuses, said in its words
        return f"nothing ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    if backend is None:
        return "tokenizer"
    theirs, ours = json.loads(backend.to_str()), json.loads((out / "tokenizer.json").read_text())
    return next((part for part in PIPELINE if theirs.get(part) != ours.get(part)), None)
