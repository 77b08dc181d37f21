"""Every command-line option declared once.

The run options come from the run config's fields (config.py: TrainConfig), as torchtitan drives its command line
from its config dataclasses: the flag from the field's name (`seq_len` -> `--seq-len`, a bool as `--x/--no-x`),
the type from its annotation (a Literal takes text: the config checks the value, with the config file's message),
the help from its description. On the command line their default is None, "not given": the config file, or the
embedded default, decides (config.load_config). A field marked CONFIG_ONLY has no flag; one marked TRAIN_ONLY is a
flag of `train` alone. Options that are no config field are declared once in cli.py, as an OptionSpec.

A command whose contract gives an option another default or type (`plan --dtype` bf16, `bench --nproc 1,2,4`)
overrides just that where it takes the option, `spec(default="bf16")`, and keeps the option's one help text; where
the option means something else there, `spec.noting(how)` adds how to that text.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from dataclasses import dataclass
from typing import Literal, Optional

import typer

from paratrain.config import CONFIG_ONLY, TRAIN_ONLY, TrainConfig
from paratrain.errors import flag_of


@dataclass(frozen=True)
class OptionSpec:
    name: str  # the command's parameter
    annotation: object  # what the text is parsed into
    help: str
    default: object = None
    flags: tuple[str, ...] = ()  # empty: --name, "_" as "-"

    def __post_init__(self) -> None:
        if not self.flags:
            object.__setattr__(self, "flags", (flag_of(self.name),))

    def but(self, **changes) -> OptionSpec:
        return dataclasses.replace(self, **changes)

    def noting(self, how: str) -> OptionSpec:
        """This option in a command where its meaning differs: the one help text, then how."""
        return self.but(help=f"{self.help} ({how})")

    def __call__(self, **changes):
        """typer's Option, the default of a command's parameter; `changes` as for but()."""
        spec = self.but(**changes) if changes else self
        return typer.Option(spec.default, *spec.flags, help=spec.help, show_default=spec.default is not None)

    def param(self, **changes) -> tuple[str, object, object]:
        """(name, type, typer Option): an entry of the lists with_options() adds to a command."""
        spec = self.but(**changes) if changes else self
        return spec.name, spec.annotation, spec()


def _text_type(annotation) -> type:
    """What a flag parses: `int | None` -> int; a Literal of strings -> str."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0])
    return annotation


def _from_field(name: str, info) -> OptionSpec:
    if not info.description:
        raise TypeError(f"TrainConfig.{name} is a command-line option: give it Field(description=...), its --help "
                        f"text, or json_schema_extra=CONFIG_ONLY")
    kind = _text_type(info.annotation)
    flag = flag_of(name)
    return OptionSpec(name, Optional[kind], info.description,
                      flags=(f"{flag}/--no-{flag[2:]}",) if kind is bool else (flag,))


@functools.cache
def run_options() -> dict[str, OptionSpec]:
    """Every TrainConfig field that is a flag, by name, in the fields' order."""
    return {name: _from_field(name, info) for name, info in TrainConfig.model_fields.items()
            if info.json_schema_extra != CONFIG_ONLY}


def shared_run_options() -> list[OptionSpec]:
    """The run options of every command that runs the training (train, verify, doctor, launch)."""
    return [spec for name, spec in run_options().items()
            if TrainConfig.model_fields[name].json_schema_extra != TRAIN_ONLY]


def with_options(options: list[tuple[str, object, object]], into: str):
    """Give a command every option of `options` it does not declare itself (after its own); they arrive as one
    dict in its `into` argument."""
    def decorate(func):
        sig = inspect.signature(func)
        own = [p for p in sig.parameters.values() if p.name != into]
        taken = {p.name for p in own}
        extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
                 for n, a, d in options if n not in taken]

        @functools.wraps(func)
        def wrapper(**kwargs):
            opts = {n: kwargs.pop(n) for n, _, _ in options if n in kwargs and n not in taken}
            return func(**kwargs, **{into: opts})

        wrapper.__signature__ = sig.replace(parameters=own + extra)
        return wrapper

    return decorate
