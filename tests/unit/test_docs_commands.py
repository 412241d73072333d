"""Every command and snippet users copy from README.md, docs/*.md and examples/**/README*.md,
checked against what it runs: this project's command lines take every option a document gives
them and get every option they require (the short ones, over files of this repository, run for
real), `vllm serve` takes every flag and the `piep` options are PiepConfig's, the scripts
handle their options, `pip` never installs this package from an index, Python snippets compile,
import what exists and guard `LLM(...)`, JSON parses. Placeholders (MODEL, DIR, PATH, <...>)
are fine as arguments. The checks that start interpreters (`--help`, the short runs, `vllm
serve --help=all`: about 30 s of CPU in all) are `slow`; the rest take about a second."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from _pytest.mark import ParameterSet
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from support.doc_blocks import SHELL_LANGS, Block, Command, Kind, blocks, commands, doc_files
from support.paths import ROOT

BLOCKS = blocks(ROOT, doc_files(ROOT))


def shell_commands() -> tuple[list[Command], list[str]]:
    """The commands of every shell block, and the lines shlex could not split."""
    found: list[Command] = []
    errors: list[str] = []
    for block in BLOCKS:
        if block.lang in SHELL_LANGS:
            try:
                found.extend(commands(block))
            except ValueError as e:
                errors.append(str(e))
    return found, errors


COMMANDS, PARSE_ERRORS = shell_commands()
PROJECT = ("vllm_piep", "kernels_trace")  # this repository's packages
PLACEHOLDER = re.compile(
    r"\b(?:MODEL|DIR|PATH|TRACE|URL|OUT|FILE|CSV|BUNDLE_DIR|DTYPE|DATA)\b|<[^>]*>|\.\.\.")
VENV_BIN = Path(sys.executable).parent  # .venv/bin: the tests run with the .venv's python
ENV = dict(os.environ, COLUMNS="200",
           PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
SUBCOMMAND = re.compile(r"[a-z][a-z0-9_-]*")  # a bare word first: a subcommand
PATH_LIKE = re.compile(r"[/*?\[]|\.(?:json|gz|jsonl|csv|png|html|sqlite3?|db|parquet|txt)$")
# The (module, subcommand) pairs that finish in seconds over the repository's examples, with
# no server, GPU or network; each with the options whose values it writes (into tmp_path).
# examples/README.md's commands run in tests/unit/test_examples.py.
RUNNABLE: dict[tuple[str, str | None], frozenset[str]] = {
    ("vllm_piep.spans", "show"): frozenset(),
    ("vllm_piep.spans", "tree"): frozenset(),
    ("kernels_trace", None): frozenset({"--json", "--spans-dir"}),
    ("vllm_piep.calibrate", "whatif"): frozenset({"--png", "--json"}),
}


def of_kind(*kinds: Kind) -> list[Command]:
    return [c for c in COMMANDS if c.kind in kinds]


def cases(items: list[Command]) -> list[ParameterSet]:
    return [pytest.param(c, id=f"{c.where} {c.text[:60]}") for c in items]


def block_cases(lang: str) -> list[ParameterSet]:
    return [pytest.param(b, id=b.where) for b in BLOCKS if b.lang == lang]


def names_option(text: str, option: str) -> bool:
    """`text` names `option` as a whole word (`--out` is not `--out-len`)."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def say(command: Command, why: str) -> str:
    return f"{command.where}: `{command.text}`: {why}"


# ---- python -m MODULE [SUBCOMMAND] and python FILE: their --help ----------------------------

def subcommand(command: Command) -> str | None:
    first = command.args[0] if command.args else ""
    return first if SUBCOMMAND.fullmatch(first) else None


def help_target(command: Command) -> tuple[str, ...] | None:
    """What follows `python` in the `--help` call that documents `command`'s options or
    subcommand: `-m MODULE [SUBCOMMAND]` of this project, or one of the repository's scripts.
    None for a command with neither (its module need only exist), another program's module
    or the user's own script."""
    sub = subcommand(command)
    if command.target is None or not (sub or command.options()):
        return None
    if command.kind is Kind.PYTHON_MODULE and command.target.split(".")[0] in PROJECT:
        return ("-m", command.target, *([sub] if sub else []))
    if command.kind is Kind.PYTHON_SCRIPT and (ROOT / Path(command.target).parts[0]).exists():
        return (command.target,)
    return None


HELPED = [c for c in of_kind(Kind.PYTHON_MODULE, Kind.PYTHON_SCRIPT) if help_target(c)]


@dataclass(frozen=True)
class Help:
    returncode: int
    text: str


def run_help(target: tuple[str, ...]) -> Help:
    proc = subprocess.run([sys.executable, *target, "--help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    return Help(proc.returncode, proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def helps() -> dict[tuple[str, ...], Help]:
    """Every distinct `--help` the documents need, run once, a few at a time."""
    targets = sorted({t for c in HELPED if (t := help_target(c))})
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(targets, pool.map(run_help, targets), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("command", cases(HELPED))
def test_every_option_is_in_the_help(command: Command,
                                     helps: dict[tuple[str, ...], Help]) -> None:
    target = help_target(command)
    assert target is not None
    if command.kind is Kind.PYTHON_SCRIPT:
        assert (ROOT / target[0]).is_file(), say(command, f"no script {target[0]}")
    shown = helps[target]
    last = shown.text.strip().splitlines()[-1:] or [""]
    assert shown.returncode == 0, say(
        command, f"`python {' '.join(target)} --help` exits {shown.returncode} (no such "
        f"module or subcommand?): {last[0]}")
    missing = [o for o in command.options() if not names_option(shown.text, o)]
    assert not missing, say(command, f"{missing} not in `python {' '.join(target)} --help`")
    if "..." not in command.args:  # `run ... --resume` leaves out the rest on purpose
        absent = [o for o in required_options(shown.text) if o not in command.options()]
        assert not absent, say(command, f"leaves out {absent}, which it requires")


def required_options(help_text: str) -> list[str]:
    """The options argparse's usage paragraph shows outside `[...]` and `(...)`: required."""
    usage = help_text.split("\n\n", 1)[0]
    if not usage.startswith("usage:"):
        return []
    previous = None
    while previous != usage:  # innermost groups first
        previous, usage = usage, re.sub(r"\[[^\[\]]*\]|\([^()]*\)", "", usage)
    return re.findall(r"(?<![\w-])--[\w-]+", usage)


def test_the_other_python_modules_and_scripts_exist() -> None:
    """Those with no option to look up (`python -m pytest ...`, `python -m
    vllm_piep.runtime.registry`): the module exists, and so does a script of the repository."""
    missing = []
    for command in of_kind(Kind.PYTHON_MODULE, Kind.PYTHON_SCRIPT):
        if help_target(command) is not None or command.target is None:
            continue
        if command.kind is Kind.PYTHON_MODULE and not is_module(command.target):
            missing.append(say(command, f"no module {command.target}"))
        in_repository = (ROOT / Path(command.target).parts[0]).exists()
        if command.kind is Kind.PYTHON_SCRIPT and in_repository and \
                not (ROOT / command.target).is_file():
            missing.append(say(command, f"no script {command.target}"))
    assert not missing, "\n".join(missing)


# ---- the short ones, run for real -----------------------------------------------------------

def roles(command: Command) -> list[tuple[str, str]]:
    """Each word after the subcommand as ("input", path), ("output", path) or ("word", w);
    `--opt=path` is split."""
    outputs = RUNNABLE.get((command.target or "", subcommand(command)), frozenset())
    words = command.args[1:] if subcommand(command) else command.args
    found: list[tuple[str, str]] = []
    writes = False
    for word in words:
        name, eq, value = word.partition("=")
        if writes:
            found.append(("output", word))
        elif word.startswith("--") and name in outputs and eq:
            found.extend([("word", name), ("output", value)])
        elif not word.startswith("-") and PATH_LIKE.search(word):
            found.append(("input", word))
        else:
            found.append(("word", word))
        writes = word.startswith("--") and word in outputs
    return found


def runs(command: Command) -> bool:
    """An allowlisted command whose inputs are all files of this repository (not the user's
    own, such as `spans/` or `rank0.json`)."""
    key = (command.target or "", subcommand(command))
    if command.kind is not Kind.PYTHON_MODULE or key not in RUNNABLE:
        return False
    if command.block.path.parts[0] == "examples" or \
            any(PLACEHOLDER.search(w) for w in command.args):
        return False
    inputs = [Path(w) for role, w in roles(command) if role == "input"]
    return all(not p.is_absolute() and (ROOT / p.parts[0]).exists() for p in inputs)


def copy_inputs(pattern: str, work: Path) -> list[str]:
    """The repository's paths that `pattern` names (a glob, expanded as a shell would in the
    repository root), copied into `work` at the same relative place."""
    matches = sorted(ROOT.glob(pattern)) if re.search(r"[*?\[]", pattern) else [ROOT / pattern]
    found = [m for m in matches if m.exists()]
    for match in found:
        dest = work / match.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if match.is_dir():
            shutil.copytree(match, dest, dirs_exist_ok=True)
        else:
            shutil.copy2(match, dest)
    return [str(m.relative_to(ROOT)) for m in found] or [pattern]


def prepared_argv(command: Command, work: Path) -> list[str]:
    """The command with its inputs copied into `work` and its outputs written there."""
    argv = [sys.executable, "-m", command.target or "", *filter(None, [subcommand(command)])]
    for role, word in roles(command):
        if role == "input":
            argv.extend(copy_inputs(word, work))
        elif role == "output":
            out = work / Path(word).name if Path(word).is_absolute() else work / word
            out.parent.mkdir(parents=True, exist_ok=True)
            argv.append(str(out))
        else:
            argv.append(word)
    return argv


@pytest.mark.slow
@pytest.mark.parametrize("command", cases([c for c in COMMANDS if runs(c)]))
def test_the_short_commands_run(command: Command, tmp_path: Path) -> None:
    argv = prepared_argv(command, tmp_path)
    proc = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, say(
        command, f"exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


# ---- vllm serve -------------------------------------------------------------------------------

SERVES = of_kind(Kind.VLLM_SERVE)


@pytest.fixture(scope="module")
def serve_help() -> str:
    """`vllm serve --help=all` with the plugin installed (it adds `--plugins`)."""
    proc = subprocess.run([str(VENV_BIN / "vllm"), "serve", "--help=all"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", cases(SERVES))
def test_vllm_serve_takes_every_flag(command: Command, serve_help: str) -> None:
    missing = [o for o in command.options() if not names_option(serve_help, o)]
    assert not missing, say(command, f"{missing} not in `vllm serve --help=all`")


def option_value(command: Command, option: str) -> str | None:
    for i, word in enumerate(command.args):
        if word == option and i + 1 < len(command.args):
            return command.args[i + 1]
        if word.startswith(f"{option}="):
            return word.split("=", 1)[1]
    return None


@pytest.mark.parametrize(
    "command", cases([c for c in SERVES if option_value(c, "--additional-config")]))
def test_the_additional_config_is_piep_options(command: Command) -> None:
    from vllm_piep.config import ConfigError, PiepConfig

    text = option_value(command, "--additional-config")
    assert text is not None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        pytest.fail(say(command, f"--additional-config is not JSON: {e}"))
    assert isinstance(config, dict), say(command, "--additional-config is not an object")
    piep = config.get("piep", {})
    assert isinstance(piep, dict), say(command, "`piep` is not an object")
    unknown = sorted(set(piep) - set(PiepConfig.model_fields))
    assert not unknown, say(command, f"{unknown} are not options of PiepConfig")
    if not PLACEHOLDER.search(text):  # a placeholder value means nothing to check
        try:
            PiepConfig.from_sources(config, environ={})
        except ConfigError as e:
            pytest.fail(say(command, f"PiepConfig refuses it: {e}"))


# ---- bash scripts ----------------------------------------------------------------------------

@pytest.mark.parametrize("command", cases(of_kind(Kind.BASH_SCRIPT)))
def test_scripts_exist_and_handle_their_options(command: Command) -> None:
    assert command.target is not None
    script = ROOT / command.target
    assert script.is_file(), say(command, f"no script {command.target}")
    text = script.read_text()
    missing = [o for o in command.options() if not names_option(text, o)]
    assert not missing, say(command, f"{command.target} never mentions {missing}")


# ---- pip ---------------------------------------------------------------------------------------

PIP_VALUE_OPTIONS = frozenset({
    "-w", "--wheel-dir", "-r", "--requirement", "-c", "--constraint", "-i", "--index-url",
    "--extra-index-url", "-f", "--find-links", "-t", "--target", "--python-version",
    "--platform", "--only-binary", "--no-binary", "--prefix", "--root", "--src"})
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"])


def pip_requirements(command: Command) -> list[str]:
    """What `pip install` / `pip wheel` is asked for (an `-e` value included)."""
    if not command.args or command.args[0] not in ("install", "wheel", "download"):
        return []
    found: list[str] = []
    skip = False
    for word in command.args[1:]:
        if skip:
            skip = False
        elif word in PIP_VALUE_OPTIONS:
            skip = True
        elif not word.startswith("-"):
            found.append(word)
    return found


def pip_problem(requirement: str) -> str | None:
    """Why `requirement` is wrong in a document: this package from an index, or an extra
    pyproject.toml does not declare."""
    is_path = requirement.startswith((".", "/")) or "/" in requirement or \
        requirement.endswith((".whl", ".tar.gz"))
    if is_path:
        named = re.search(r"\[([^\]]*)\]$", requirement)
        extras = [e.strip() for e in named.group(1).split(",")] if named else []
        unknown = [e for e in extras if e not in EXTRAS]
        return f"no extra {unknown} in pyproject.toml" if unknown else None
    try:
        name = canonicalize_name(Requirement(requirement).name)
    except InvalidRequirement:
        return f"{requirement} is neither a path nor a requirement"
    if name == "vllm-piep":
        return f"installs {requirement} from an index, where it is not: install from a path"
    return None


@pytest.mark.parametrize("command", cases(of_kind(Kind.PIP)))
def test_pip_installs_this_package_from_a_path(command: Command) -> None:
    problems = [p for r in pip_requirements(command) if (p := pip_problem(r))]
    assert not problems, say(command, "; ".join(problems))


# ---- Python snippets -------------------------------------------------------------------------

def is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__"
                    for c in node.test.comparators))


def unguarded_calls(node: ast.AST, name: str) -> list[int]:
    """Lines that call `name(...)` when the script runs: outside `if __name__ ==
    "__main__":` and outside function bodies (vLLM's CPU build starts its engine with spawn,
    which imports the script again)."""
    if is_main_guard(node) or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return []
    lines = []
    if isinstance(node, ast.Call):
        func = node.func
        if (isinstance(func, ast.Name) and func.id == name) or \
                (isinstance(func, ast.Attribute) and func.attr == name):
            lines.append(node.lineno)
    for child in ast.iter_child_nodes(node):
        lines.extend(unguarded_calls(child, name))
    return lines


def missing_project_names(tree: ast.AST) -> list[str]:
    """The names the snippet imports from this project that do not exist (imports the modules;
    runs nothing else of the snippet)."""
    missing: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted = [(node.module, a.name) for a in node.names if a.name != "*"]
        else:
            continue
        for module, attr in wanted:
            if module.split(".")[0] not in PROJECT:
                continue
            try:
                imported = importlib.import_module(module)
            except ImportError as e:
                missing.append(f"{module} ({e})")
                continue
            if attr and not hasattr(imported, attr) and not is_module(f"{module}.{attr}"):
                missing.append(f"{module}.{attr}")
    return missing


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent is not a package
        return False


def snippet_problems(code: str, where: str) -> list[str]:
    try:
        tree = ast.parse(code, filename=where)
        compile(tree, where, "exec")
    except SyntaxError as e:
        return [f"does not compile: {e}"]
    problems = [f"line {n}: LLM(...) outside `if __name__ == \"__main__\":`"
                for n in unguarded_calls(tree, "LLM")]
    return problems + [f"imports {m}: no such name" for m in missing_project_names(tree)]


@pytest.mark.parametrize("block", block_cases("python"))
def test_python_blocks_compile_guard_llm_and_import_what_exists(block: Block) -> None:
    problems = snippet_problems(block.text, block.where)
    assert not problems, f"{block.where}: " + "; ".join(problems)


@pytest.mark.parametrize("command", cases(of_kind(Kind.PYTHON_CODE)))
def test_python_c_code_compiles_and_imports_what_exists(command: Command) -> None:
    problems = snippet_problems(command.target or "", command.where)
    assert not problems, say(command, "; ".join(problems))


# ---- JSON, and the extraction itself ---------------------------------------------------------

@pytest.mark.parametrize("block", block_cases("json"))
def test_json_blocks_parse(block: Block) -> None:
    """A block is a JSON value, or members of an object (`"usage": {...}`, an excerpt of a
    response)."""
    try:
        json.loads(block.text)
    except json.JSONDecodeError:
        try:
            json.loads("{" + block.text + "}")
        except json.JSONDecodeError as e:
            pytest.fail(f"{block.where}: not JSON: {e}")


def test_every_shell_block_splits_into_commands() -> None:
    assert not PARSE_ERRORS, "\n".join(PARSE_ERRORS)


def test_the_documents_hold_every_checked_kind() -> None:
    """The extraction finds what the checks above check (an empty list would pass them)."""
    readme = [c for c in COMMANDS if c.block.path == Path("README.md")]
    kinds = {c.kind for c in readme}
    assert {Kind.PYTHON_MODULE, Kind.VLLM_SERVE, Kind.BASH_SCRIPT, Kind.PIP} <= kinds, kinds
    assert HELPED and any(runs(c) for c in readme)
    assert block_cases("python") and block_cases("json")


# ---- the environment the commands run in ------------------------------------------------------

ACTIVATE = "source .venv/bin/activate"
CLONE_FILES = ("examples/", "data/", ".cache/")  # what only a clone (set up) holds


def needs_the_setup_venv(command: Command) -> bool:
    """A bare `python`/`pytest`/`vllm` command that a clone's user runs after
    `scripts/setup.sh` (README.md's, and any over the clone's own files): without the `.venv`
    active it finds no vLLM, pandas or rich."""
    if command.program.startswith((".venv/", "./.venv/")):
        return False
    if command.program == "pytest":
        return True
    if command.kind not in (Kind.PYTHON_MODULE, Kind.VLLM_SERVE):
        return False
    if command.block.path == Path("README.md"):
        return True
    return any(word.startswith(CLONE_FILES) for word in command.args)


def test_commands_run_after_setup_say_to_activate_its_venv() -> None:
    """Each such command comes after its document says `source .venv/bin/activate` (or it
    calls `.venv/bin/python` itself)."""
    missing = []
    checked = [c for c in COMMANDS if needs_the_setup_venv(c)]
    assert {Path("README.md"), Path("examples/README.md")} <= {c.block.path for c in checked}
    for command in checked:
        lines = (ROOT / command.block.path).read_text().splitlines()[:command.line - 1]
        if not any(ACTIVATE in line for line in lines):
            missing.append(say(command, f"no `{ACTIVATE}` before it"))
    assert not missing, "\n".join(missing)
    readme = (ROOT / "README.md").read_text()
    assert "`pytest " not in readme, "README: `.venv/bin/python -m pytest ...`"


def test_a_ledger_in_a_folder_of_the_host_is_made_first() -> None:
    """`ledger` names a file whose folder must exist: a command that puts it in an absolute
    folder (`/var/lib/piep`) follows a `mkdir -p` of that folder in its block."""
    missing, ledgers = [], 0
    for command in SERVES:
        text = option_value(command, "--additional-config") or ""
        ledger = json.loads(text).get("piep", {}).get("ledger") if text.startswith("{") else None
        if not (isinstance(ledger, str) and ledger.startswith("/")):
            continue
        ledgers += 1
        folder = str(Path(ledger).parent)
        before = [c for c in commands(command.block) if c.line < command.line]
        if not any(c.program == "mkdir" and "-p" in c.args and folder in c.args for c in before):
            missing.append(say(command, f"no `mkdir -p {folder}` before it"))
    assert ledgers and not missing, "\n".join(missing)
