"""What the command-line tests share: writing a bad input, and checking that a parser documents
every option and its default."""

from __future__ import annotations

import argparse
from pathlib import Path


def write_input(tmp: Path, name: str, text: str | bytes) -> Path:
    """`text` (or bytes) as the file `tmp/name`, its directory made."""
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def check_options_documented(name: str, parser: argparse.ArgumentParser) -> None:
    """The parser has a description; every option has help text, and the help the formatter
    renders names the option's default whenever it has one."""
    assert parser.description, f"{name}: no description"
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        label = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"{name} {label}: no help text"
        if not (action.default is None or action.default is False or action.required):
            formatted = parser.formatter_class(parser.prog)._get_help_string(action) or ""
            assert "default" in formatted, f"{name} {label}: default {action.default!r} unsaid"
        assert label in text
