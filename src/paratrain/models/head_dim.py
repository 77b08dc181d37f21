"""The attention width a Hugging Face config asks for: its head_dim where given, else hidden_size split into the
heads. Read by both config parsers (hf_shape.py for the planner, hf_args.py through transformers' classes)."""

from __future__ import annotations

from paratrain.errors import UserError


def head_dim_of(value, dim: int, heads: int, where: str) -> int | None:
    """The config's head_dim (`value`), else hidden_size // heads as transformers takes it, when heads x head_dim is
    not hidden_size (Qwen3, GPT-OSS, GLM-4.5: the query is that wide, not the residual), else None; refused when
    neither gives heads of an even size (RoPE)."""
    if value is None:
        if dim < heads:
            raise UserError(f"{where}: hidden_size {dim} is narrower than its {heads} heads and the config gives no "
                            "head_dim")
        value = dim // heads  # what transformers builds then, a remainder or not (GLM-4.5's 96 heads of 42)
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{where}: 'head_dim' must be a positive integer, got {value!r}")
    if value % 2:
        raise UserError(f"{where}: heads of {value} (head_dim) must have an even size for rotary positions")
    return None if value * heads == dim else value
