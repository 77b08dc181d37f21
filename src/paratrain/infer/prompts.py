"""Prompts for `paratrain generate`: --prompt TEXT, or --prompts FILE.jsonl with one {"text": ...} or {"ids": [...]}
object a line, read and checked in the CLI process (so bad input is one line before any worker starts), then
token ids for every rank. Text needs the checkpoint's tokenizer; ids suit the synthetic-data presets."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import UserError

KEYS = ("text", "ids")


@dataclass(frozen=True)
class Prompt:
    index: int  # its place in the input: outputs come back in this order, and it seeds its sampling stream
    ids: tuple[int, ...]
    text: str | None = None  # as the user wrote it (None: given as ids)

    @property
    def given(self) -> str | list[int]:
        """The prompt as the user gave it: the text, or the ids."""
        return self.text if self.text is not None else list(self.ids)

    def to_dict(self) -> dict:
        return {"index": self.index, "ids": list(self.ids), "text": self.text}

    @classmethod
    def from_dict(cls, values: dict) -> Prompt:
        return cls(values["index"], tuple(values["ids"]), values["text"])


def read_prompts(prompt: str | None, prompts_file: Path | None) -> list[dict]:
    """The raw prompts ({"text": str} or {"ids": [int]}), each with "where" (how an error names it)."""
    if (prompt is None) == (prompts_file is None):
        raise UserError("give --prompt TEXT or --prompts FILE.jsonl (one of them)")
    if prompt is not None:
        if not prompt:
            raise UserError("--prompt is empty: give some text")
        return [{"text": prompt, "where": "--prompt"}]
    try:
        lines = Path(prompts_file).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UserError(f"--prompts {prompts_file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"--prompts {prompts_file}: cannot read it: {exc.strerror or exc}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            out.append(parse_line(line, f"{prompts_file} line {number}"))
    if not out:
        raise UserError(f"--prompts {prompts_file} holds no prompt (one JSON object a line: {{\"text\": ...}} "
                        "or {\"ids\": [...]})")
    return out


def parse_line(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object {{\"text\": ...}} or {{\"ids\": [...]}}, "
                        f"got {type(record).__name__}")
    unknown = sorted(set(record) - set(KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a prompt is "
                        "{\"text\": ...} or {\"ids\": [...]}")
    if len(record) != 1:
        raise UserError(f"{where}: give \"text\" or \"ids\", not both" if record else
                        f"{where}: an empty object; a prompt is {{\"text\": ...}} or {{\"ids\": [...]}}")
    if "text" in record and (not isinstance(record["text"], str) or not record["text"]):
        raise UserError(f"{where}: \"text\" must be a non-empty string")
    if "ids" in record:
        ids = record["ids"]
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            raise UserError(f"{where}: \"ids\" must be a non-empty list of integer token ids")
    return {**record, "where": where}


def to_prompts(raw: list[dict], vocab_size: int, tokenizer: str | None) -> list[Prompt]:
    """Token ids for every raw prompt: ids checked against the vocabulary, text through the tokenizer."""
    tok = None
    if any("text" in r for r in raw):
        tok = open_prompt_tokenizer(tokenizer, next(r["where"] for r in raw if "text" in r))
    prompts = []
    for index, record in enumerate(raw):
        if "ids" in record:
            ids = record["ids"]
            bad = next((i for i in ids if not 0 <= i < vocab_size), None)
            if bad is not None:
                raise UserError(f"{record['where']}: token id {bad} is outside the model's vocabulary "
                                f"(0..{vocab_size - 1})")
            prompts.append(Prompt(index, tuple(ids)))
            continue
        ids = tok.encode(record["text"]).ids
        if not ids:
            raise UserError(f"{record['where']}: the text encodes to no token")
        if max(ids) >= vocab_size:
            raise UserError(f"{record['where']}: the tokenizer gives id {max(ids)}, past the model's vocabulary "
                            f"({vocab_size}): the tokenizer is not this model's")
        prompts.append(Prompt(index, tuple(ids), record["text"]))
    return prompts


def open_prompt_tokenizer(tokenizer: str | None, where: str):
    if tokenizer is None:
        raise UserError(f"{where}: a text prompt needs the checkpoint's tokenizer, and this model has none (it "
                        "trained on token ids): give the prompt as {\"ids\": [...]} in --prompts FILE.jsonl")
    from paratrain.train.data.prepare_tokens import load_tokenizer

    return load_tokenizer(tokenizer)[1]


def check_lengths(prompts: list[Prompt], max_new_tokens: int, max_positions: int) -> None:
    """Every prompt plus --max-new-tokens within the model's positions."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    longest = max(prompts, key=lambda p: len(p.ids))
    if len(longest.ids) + max_new_tokens > max_positions:
        raise UserError(f"prompt {longest.index} has {len(longest.ids)} tokens; with --max-new-tokens "
                        f"{max_new_tokens} it needs {len(longest.ids) + max_new_tokens} positions, past the model's "
                        f"{max_positions}: shorten the prompt or lower --max-new-tokens")


def decoder(tokenizer: str | None):
    """fn(generated ids) -> their text (None without a tokenizer)."""
    if tokenizer is None:
        return lambda ids: None
    from paratrain.train.data.prepare_tokens import load_tokenizer

    return load_tokenizer(tokenizer)[1].decode
