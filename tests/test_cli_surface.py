"""Issue 46: the options of every command are one contract. Generating them from the config's fields must not
change a name, a flag, a type or a default; only help texts and the listing order may change, and new
options may come (a removed one would break users' scripts). The fixtures were written
from the hand-declared CLI (at 1806987) by tests/support/cli_surface.py."""

from __future__ import annotations

import json
from pathlib import Path

from support.cli_surface import surface

HERE = Path(__file__).parent / "support"


def test_every_command_lists_the_same_options_with_the_same_defaults():
    want = json.loads((HERE / "cli_surface.json").read_text())["options"]
    got = json.loads(json.dumps(surface()["options"], default=str))
    assert sorted(got) == sorted(want)
    for command in want:  # the order options are listed in --help may change; each option may not
        before = {o["name"]: o for o in want[command]}
        after = {o["name"]: o for o in got[command]}
        assert set(before) <= set(after), (command, set(before) - set(after))  # new options may come, none go
        for name in before:
            assert after[name] == before[name], (command, name)


def test_each_option_has_one_nonempty_help_text():
    for where, text in surface()["helps"].items():
        assert text and text.strip(), where


def test_print_config_is_unchanged(cli_inproc):
    res = cli_inproc("train", "--print-config")
    assert res.returncode == 0, res.stderr
    # every key with its default, in order; a new key may come between them
    lines = iter(res.stdout.splitlines())
    for want in (HERE / "cli_print_config.toml").read_text().splitlines():
        assert any(line == want for line in lines), want
