"""The repository's documents speak to its users about the project as it is: no tracker
numbers, no notes on how a change was made or who asked for it, no file that is not in the
repository; and the examples name no directory of the machine that made them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support.paths import ROOT

# How a change was made rather than what it does: "issue 51", "this session", a design file
# the repository does not hold, "the budget" (a bug tracker's "issue threads" are
# sources, and may be named).
MAKING = re.compile(r"\b[Ii]ssues? #?\d+\b|\bthis session\b|\bDESIGN\.md\b|\bin review\b"
                    r"|\b[Tt]he issue(?:'s)?\b(?! threads?| tracker)")
# An absolute path into a checkout's own folders (`/home/me/clone/.cache/tiny-llama`,
# `/srv/x/.venv/lib/...`): the machine that wrote the file, not the reader's.
BUILD_PATH = re.compile(r"(?<![\w.~-])/(?:[^\s\"'/]+/)+\.(?:cache|venv)/")


def tracked(*patterns: str) -> list[Path]:
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout: no list of tracked files")
    listed = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


# Files that name these words to test for them.
QUOTING = {"tests/unit/test_docs_speak_to_users.py", "tests/unit/test_layout.py"}


def test_no_document_speaks_of_how_it_was_made() -> None:
    """The documents, and the code's comments and docstrings."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
             for path in tracked("*.md", "*.py")
             if str(path.relative_to(ROOT)) not in QUOTING
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if MAKING.search(line)]
    assert not found, "say what changed and why, for users:\n" + "\n".join(found)


def test_the_examples_name_no_directory_of_the_machine_that_made_them() -> None:
    found = []
    for path in tracked("examples"):
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # compressed traces, images
            continue
        text = data.decode(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if BUILD_PATH.search(line) or f"{ROOT}/" in line:
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, ("paths of the build machine (scripts/make_examples.py writes them "
                       "relative to the checkout):\n" + "\n".join(found[:20]))


def test_the_guards_see_what_they_look_for() -> None:
    for line in ("### Ledger (2026-11-28: issue 51)", "this session had none",
                 "budget (DESIGN.md)", "proposed in review", "the ~10 µs the issue allows",
                 "Issue 7 fixed"):
        assert MAKING.search(line), line
    for line in ("the issue threads below", "ROCm's issue tracker", "issues: []",
                 "tissue 5", "a session server"):
        assert not MAKING.search(line), line
    for line in ('"model":"/work/main/.cache/tiny-llama"',
                 "/home/u/clone/.venv/lib/python3.11/site-packages/vllm/x.py:1: Warning"):
        assert BUILD_PATH.search(line), line
    for line in ('"model":".cache/tiny-llama"', ".venv/lib/python3.11/site-packages/x.py",
                 "--model .cache/tiny-llama"):
        assert not BUILD_PATH.search(line), line
