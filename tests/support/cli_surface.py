"""Every command's options as data (names, flags, type, default, required, multiple), help texts apart: the CLI
contract users' scripts depend on (tests/test_cli_surface.py compares it with tests/support/cli_surface.json).

    python tests/support/cli_surface.py > tests/support/cli_surface.json   # only for a deliberate contract change
"""

from __future__ import annotations

import json


def _commands(group, path: tuple[str, ...] = ()):
    yield path, group
    if hasattr(group, "list_commands"):  # typer's own click: duck-typed, not click.Group
        ctx = group.context_class(group)
        for name in sorted(group.list_commands(ctx)):
            yield from _commands(group.get_command(ctx, name), (*path, name))


def _type_name(param) -> str:
    """The declared Python type (typer keeps it on type_descriptor, and builds the click type at parse time)."""
    described = getattr(param, "type_descriptor", None)
    annotation = described.annotation if described is not None else getattr(param, "type", None)
    return getattr(annotation, "__name__", None) or repr(annotation)


def _default(param):
    value = param.default
    if callable(value):
        return "<callable>"
    return value if isinstance(value, (str, int, float, bool, type(None), list, tuple)) else repr(value)


def surface() -> dict:
    """{"train": [{"name": ..., "opts": [...], ...}, ...], ...}: options in their declared order, plus helps."""
    import typer

    from paratrain.cli import app

    root = typer.main.get_command(app)
    out, helps = {}, {}
    for path, command in _commands(root):
        rows = []
        for param in command.params:
            rows.append({"name": param.name, "kind": type(param).__name__, "opts": list(param.opts),
                         "secondary_opts": list(getattr(param, "secondary_opts", [])),
                         "type": _type_name(param),
                         "default": _default(param), "required": param.required, "multiple": param.multiple,
                         "nargs": param.nargs, "is_flag": bool(getattr(param, "is_flag", False))})
            helps[f"{' '.join(path)} {param.name}"] = getattr(param, "help", None)
        out[" ".join(path) or "paratrain"] = rows
    return {"options": out, "helps": helps}


if __name__ == "__main__":
    print(json.dumps(surface(), indent=1, default=str))
