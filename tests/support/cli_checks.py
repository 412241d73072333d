"""What the command-line tests share: writing a bad input, checking that a CLI refuses it in one
line with exit 2, and checking that a parser documents every option and its default."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest


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


def check_usage_error(main: Callable[[list[str]], int], argv: list[str], prog: str, named: str,
                      capsys: pytest.CaptureFixture[str]) -> None:
    """`main(argv)` exits 2 with exactly one stderr line, `prog...: error: ...`, naming `named`,
    and no traceback."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from parse_args
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prog) and ": error: " in lines[0], lines[0]
    assert named in lines[0], (named, lines[0])
    assert "Traceback" not in err
