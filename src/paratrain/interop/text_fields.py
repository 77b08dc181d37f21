"""--text-field: which record field holds each source's text.

`NAME` names it for every source; `SOURCE=NAME,SOURCE=NAME` per source, where SOURCE is a --data entry as
written (without its :weight) or its file name or stem (`web/a.jsonl`, `a.jsonl` or `a`). A bare NAME among
them is the field of the sources not named; otherwise those read `text`.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import UserError

DEFAULT_FIELD = "text"
FORMS = "give NAME, or SOURCE=NAME,SOURCE=NAME (SOURCE: a --data entry as written, or its file name)"


def parse_text_field(value: str) -> tuple[str, dict[str, str]]:
    """'body' -> ('body', {}); 'a.jsonl=text,b.parquet=body' -> ('text', {'a.jsonl': 'text', 'b.parquet': 'body'})."""
    default, named = None, {}
    for entry in value.split(","):
        # the last '=' splits: a Hive-style path (lang=en/part.parquet) keeps its own
        source, sep, name = (part.strip() for part in entry.rpartition("="))
        if not name or (sep and not source):
            raise UserError(f"--text-field {value!r}: {FORMS}")
        if not sep:
            if default is not None:
                raise UserError(f"--text-field {value!r}: two fields for the sources not named ({default!r}, "
                                f"{name!r}); {FORMS}")
            default = name
        elif source in named:
            raise UserError(f"--text-field {value!r}: {source} is named twice")
        else:
            named[source] = name
    return default or DEFAULT_FIELD, named


def source_names(pattern: str) -> set[str]:
    """What names a source in --text-field: its --data entry as written, its file name, its stem."""
    path = Path(pattern)
    return {pattern, path.name, path.stem} - {""}


def fields_for(patterns: list[str], value: str, strict: bool = True) -> list[str]:
    """Each source's text field. `strict`: a SOURCE that names none of `patterns` is refused (a run checks
    --text-field against --data; a second list such as --val-data may name only some of them)."""
    default, named = parse_text_field(value)
    fields = []
    for pattern in patterns:
        keys = [key for key in named if key in source_names(pattern)]
        if len(keys) > 1:
            raise UserError(f"--text-field {value!r}: {' and '.join(keys)} both name the source {pattern}")
        fields.append(named[keys[0]] if keys else default)
    for key in named:
        owners = [p for p in patterns if key in source_names(p)]
        if len(owners) > 1:
            raise UserError(f"--text-field {value!r}: {key} names several sources ({', '.join(owners)}); "
                            "write the entry as --data has it")
        if strict and not owners:
            raise UserError(f"--text-field {value!r}: {key} names none of the sources ({', '.join(patterns)}); "
                            f"{FORMS}")
    return fields
