"""JSON with comments as hjson allows them (`//` and `#` to the end of the line, `/* ... */`), as DeepSpeed reads
its config with hjson: the comments are blanked outside strings, then the text is parsed by json (data only,
nothing evaluated), refusing a key given twice in one object."""

from __future__ import annotations

import json

from paratrain.errors import UserError


def strip_comments(text: str) -> str:
    """`text` with every comment outside a string replaced by spaces (newlines kept, so json's line numbers stay)."""
    out, i, n = [], 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            end = i + 1
            while end < n and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            out.append(text[i:end + 1])
            i = end + 1
        elif ch == "#" or text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise ValueError("a /* comment is not closed")
            out.append("".join(c if c == "\n" else " " for c in text[i:end + 2]))
            i = end + 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


class _Duplicate(Exception):
    pass


def load_commented_json(text: str, label: str) -> object:
    """The document in `text` (comments allowed); UserError naming `label` when it is not JSON or repeats a key."""
    try:
        return json.loads(strip_comments(text), object_pairs_hook=_refuse_duplicates)
    except _Duplicate as dup:
        raise UserError(f"{label} gives the key {dup.args[0]!r} twice in one object; keep one") from None
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{label} is not valid JSON: {exc}") from None
