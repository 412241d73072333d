"""How the toolkit's command lines fail: bad input is one line and exit 2, a bug a traceback.

Every CLI (`python -m vllm_piep.calibrate`, `.meters`, `.spans`, `kernels_trace`) runs its
work through `run_cli`: a `UsageError` (raised where the bad file, field or value is found,
naming it and what was expected) prints `prog: message` on stderr and exits 2, as argparse
does for a bad option; anything else is a bug and keeps its traceback (exit 1). `prog` is the
command as the user typed it (`python -m vllm_piep.meter` for the singular spelling of
`.meters`). An output file whose directory does not exist is bad input (`output_file`); an
output directory may be created.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

USAGE_EXIT = 2
# The `calibrate` extra's packages (pyproject.toml): a command that needs one imports it when it
# runs, so that `--help` and the base install work without them.
CALIBRATE_EXTRA = frozenset({"sklearn", "scipy", "skl2onnx", "pyarrow", "matplotlib", "tqdm"})


class UsageError(Exception):
    """Bad input from the user: a missing or malformed file, a wrong field, a value out of
    range. The message names it and says what was expected."""


def missing_extra(module: str, extra: str = "calibrate") -> UsageError:
    """The error for a command whose optional dependency is not installed."""
    return UsageError(f"this command needs the {module!r} package: "
                      f"pip install 'vllm-piep[{extra}]'")


def existing_file(path: str | Path, what: str = "file") -> Path:
    """`path` as a Path if it is a readable, non-empty file; else a UsageError naming it."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such {what}")
    if p.is_dir():
        raise UsageError(f"{p}: is a directory, expected a {what}")
    if p.stat().st_size == 0:
        raise UsageError(f"{p}: the {what} is empty")
    return p


def output_file(path: str | Path, option: str) -> Path:
    """`path` as a Path if a file can be written there; else a UsageError naming `option`.
    An output file's directory must exist (a typo in it is refused, not created); an output
    directory option (`--out DIR`) may create its directory and does not come here."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {p}: is a directory, expected a file to write")
    if not p.parent.is_dir():
        raise UsageError(f"{option} {p}: its directory {p.parent} does not exist")
    return p


def run_cli(prog: str, work: Callable[[], int | None]) -> int:
    """Run a CLI's work: its exit code, or 2 with one line on stderr for a `UsageError`."""
    try:
        return int(work() or 0)
    except UsageError as exc:
        print(f"{prog}: error: {one_line(str(exc))}", file=sys.stderr)
        return USAGE_EXIT
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root in CALIBRATE_EXTRA:
            print(f"{prog}: error: {missing_extra(root)}", file=sys.stderr)
            return USAGE_EXIT
        raise


def one_line(message: str) -> str:
    """A message's lines joined by '; ' (a list of bad rows, say), so that it stays one line."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line too (`prog: error: ...`, exit 2),
    pointing at `--help` instead of printing the usage block; its subparsers are the same."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and appends `(default: ...)` to every option with a
    default worth saying (not None, not a flag's False) whose help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or any(action.default is v
                                       for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)
