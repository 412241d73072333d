"""The fenced code blocks of the Markdown files users copy from (README.md, docs/*.md,
examples/**/README*.md), each with its file and line, and the shell commands they hold, each
classified by the program it runs."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from markdown_it import MarkdownIt  # rich's Markdown parser: a base dependency's own

SHELL_LANGS = frozenset({"bash", "sh", "shell", "console", ""})  # "": an untagged block
KEPT_LANGS = SHELL_LANGS | {"python", "json"}
OPERATORS = frozenset({"&&", "||", ";", "|"})  # split a line into its commands
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # `VAR=value cmd`: the environment
PYTHONS = frozenset({"python", "python3", "python3.11"})


def doc_files(root: Path) -> list[Path]:
    """The Markdown files users copy commands from."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            *sorted((root / "examples").glob("**/README*.md"))]


@dataclass(frozen=True)
class Block:
    """One fenced code block: `line` is its opening fence's line (1-based)."""

    path: Path  # relative to the repository
    line: int
    lang: str  # the info string's first word; "" when untagged
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(root: Path, files: Iterable[Path]) -> list[Block]:
    """The fenced blocks of `files` whose language is one of KEPT_LANGS."""
    found: list[Block] = []
    for path in files:
        for token in MarkdownIt("commonmark").parse(path.read_text()):
            lang = token.info.split()[0].lower() if token.info.strip() else ""
            if token.type == "fence" and token.map and lang in KEPT_LANGS:
                found.append(Block(path.relative_to(root), token.map[0] + 1, lang,
                                   token.content))
    return found


class Kind(StrEnum):
    """The program a command runs."""

    PYTHON_MODULE = "python -m"  # python -m MODULE ... (any interpreter path)
    PYTHON_CODE = "python -c"
    PYTHON_SCRIPT = "python FILE"
    VLLM_SERVE = "vllm serve"
    BASH_SCRIPT = "bash FILE"
    PIP = "pip"  # pip install / pip wheel, also as python -m pip
    DOCKER = "docker"
    CURL = "curl"
    OTHER = "other"


@dataclass(frozen=True)
class Command:
    """One command of a shell block. `target` is the module, script or code it runs (None for
    the other kinds) and `args` the words after it; `line` is where the command starts."""

    block: Block
    line: int
    text: str  # as written (continuations joined)
    program: str  # its first word
    kind: Kind
    target: str | None
    args: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.block.path}:{self.line}"

    def options(self) -> list[str]:
        """The `--option`s it names, before a `--` that ends them (`--opt=v` gives `--opt`)."""
        words = self.args[:self.args.index("--")] if "--" in self.args else self.args
        return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def classify(words: list[str]) -> tuple[Kind, str | None, tuple[str, ...]]:
    """The kind of the command `words` (environment assignments already removed), its target
    and the words after the target."""
    program, rest = Path(words[0]).name, words[1:]
    if program in PYTHONS and rest:
        if rest[0] in ("-m", "-c") and len(rest) > 1:
            if rest[0] == "-m" and rest[1] == "pip":
                return Kind.PIP, None, tuple(rest[2:])
            kind = Kind.PYTHON_MODULE if rest[0] == "-m" else Kind.PYTHON_CODE
            return kind, rest[1], tuple(rest[2:])
        if not rest[0].startswith("-"):
            return Kind.PYTHON_SCRIPT, rest[0], tuple(rest[1:])
    if program == "vllm" and rest[:1] == ["serve"]:
        return Kind.VLLM_SERVE, None, tuple(rest[1:])
    if program in ("bash", "sh") and rest and rest[0].endswith(".sh"):
        return Kind.BASH_SCRIPT, rest[0], tuple(rest[1:])
    if program in ("pip", "pip3"):
        return Kind.PIP, None, tuple(rest)
    if program in ("docker", "curl"):
        return Kind(program), None, tuple(rest)
    return Kind.OTHER, None, tuple(rest)


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """The block's lines with `\\` continuations joined, each with its first line's number;
    in a console block only the `$ ` prompt lines (the others are output)."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, raw in enumerate(block.text.splitlines()):
        number = block.line + 1 + offset
        if pending is None:
            if block.lang == "console":
                if not raw.startswith("$ "):
                    continue
                raw = raw[2:]
            pending = (number, "")
        text = pending[1] + raw
        if raw.rstrip().endswith("\\"):
            pending = (pending[0], text.rstrip()[:-1] + " ")
            continue
        joined.append((pending[0], text))
        pending = None
    if pending is not None:
        joined.append(pending)
    return joined


def split_words(words: list[str]) -> list[list[str]]:
    """`a && b | c; d` as its commands, each without its leading `VAR=value` assignments."""
    commands: list[list[str]] = [[]]
    for word in words:
        if word in OPERATORS:
            commands.append([])
        elif commands[-1] or not ASSIGNMENT.match(word):
            commands[-1].append(word)
    return [c for c in commands if c]


def commands(block: Block) -> list[Command]:
    """The commands of a shell block (shlex, POSIX rules, `#` comments dropped). A line of a
    tagged block that shlex cannot split raises ValueError naming it; in an untagged block,
    which may hold a diagram or a listing, such a line is not a command."""
    found: list[Command] = []
    for number, text in logical_lines(block):
        try:
            words = shlex.split(text, comments=True, posix=True)
        except ValueError as e:
            if block.lang:
                raise ValueError(f"{block.path}:{number}: {e}: {text.strip()}") from None
            continue
        for command in split_words(words):
            kind, target, args = classify(command)
            found.append(Command(block, number, text.strip(), command[0], kind, target, args))
    return found
