"""`hybridize --help` and every group's list of commands: each command is listed with a summary of one sentence.

Typer's rich help lists a command by the first paragraph of its docstring and keeps that paragraph's line breaks, so a
summary written across source lines breaks mid-sentence in the list; such a command gives a `short_help`."""
import inspect

import typer.main

from hybridize.cli import app


def _commands(group, path: tuple = ()):
    for name, cmd in group.commands.items():
        yield path + (name,), cmd
        if hasattr(cmd, "commands"):   # a group (typer's own click, not necessarily the installed one)
            yield from _commands(cmd, path + (name,))


def test_every_command_is_listed_with_an_unbroken_summary():
    listed = {" ".join(path): cmd.short_help or inspect.cleandoc(cmd.help or "").split("\n\n")[0]
              for path, cmd in _commands(typer.main.get_command(app))}
    assert {"demo", "distill align", "eval speed", "grpo", "recipes"} <= set(listed)
    broken = {name: text for name, text in listed.items() if not text.strip() or "\n" in text}
    assert not broken, f"give these a one-line first docstring paragraph or short_help: {sorted(broken)}"
