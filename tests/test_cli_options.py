"""Issue 46: every option is declared once. The run options are the config's fields (their help the field's
description), and an option name has one help text in every command that takes it: the same text, or that text
with a note on how this command differs (`OptionSpec.noting`), or plan's "fix: " of it."""

from __future__ import annotations

from paratrain.config import CONFIG_ONLY, TrainConfig
from paratrain.parallel.dims import all_dims
from support.cli_surface import surface

# an option that means something else in this command than the run option of its name (its help says what)
OWN_MEANING = {("export", "dtype"), ("export", "out"), ("generate", "out"), ("generate", "seed"), ("data prepare", "out"), ("data tokenizer", "out"),
               ("data tokenizer", "vocab_size")}


def helps_by_option() -> dict[str, dict[str, str]]:
    """{option name: {command: its help there}}."""
    out: dict[str, dict[str, str]] = {}
    for where, text in surface()["helps"].items():
        command, name = where.rsplit(" ", 1)
        out.setdefault(name, {})[command] = text
    return out


def test_each_config_field_is_a_train_flag_with_its_description_as_help_unless_config_only():
    helps = helps_by_option()
    for name, field in TrainConfig.model_fields.items():
        if field.json_schema_extra == CONFIG_ONLY:
            assert name not in helps, name
        else:
            assert helps[name]["train"] == field.description, name


def test_an_option_has_one_help_text_in_every_command_that_takes_it():
    plan_words = {d.name: d.plan_help for d in all_dims()}  # plan fixes a degree in its Dim's own words
    for name, by_command in helps_by_option().items():
        texts = {command: text.removeprefix("fix: ") for command, text in by_command.items()
                 if (command, name) not in OWN_MEANING}
        if name in plan_words:
            assert by_command["plan"] == plan_words[name]
            texts.pop("plan")
        base = min(texts.values(), key=len)
        for command, text in texts.items():
            assert text == base or text.startswith(base + " ("), (name, command, text, base)
