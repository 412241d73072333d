"""The package's layout rules, read from the source (every import statement, at module level or
inside functions): only `runtime/` imports vLLM; the pure and hardware packages never import the
runtime; serving never imports the offline toolkit or its dependencies; no import circles. And
the repository stands alone: no file names a folder beside the clone, and the published data the
tests read is in `data/`."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from support.paths import PUBLISHED_DATA

ROOT = Path(__file__).resolve().parents[2]  # the repository
PACKAGE = ROOT / "vllm_piep"
# What runs inside vLLM's processes, and what it may import from the project.
SERVING = ("vllm_piep.plugin", "vllm_piep.config", "vllm_piep.once", "vllm_piep.clock",
           "vllm_piep.runtime", "vllm_piep.predict", "vllm_piep.model", "vllm_piep.meters",
           "vllm_piep.ledger")
OFFLINE_ONLY = ("vllm_piep.calibrate", "vllm_piep.datasets", "vllm_piep.tools", "sklearn",
                "scipy", "skl2onnx", "matplotlib", "pyarrow", "tqdm")
# Serving modules that are command-line tools, run by hand, never inside vLLM.
SERVING_CLIS = ("vllm_piep.meters.__main__", "vllm_piep.ledger.__main__",
                "vllm_piep.ledger.summary")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module an import statement in the file names (`from a.b import c` names `a.b` and,
    when it is a module of ours, `a.b.c`)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else \
        module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if MODULES.get(candidate):
                    found.add(candidate)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_only_the_runtime_imports_vllm(module: str) -> None:
    if within(module, ("vllm_piep.runtime",)):
        return
    assert not [m for m in GRAPH[module] if within(m, ("vllm",))], module


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if within(
    m, ("vllm_piep.predict", "vllm_piep.model", "vllm_piep.meters", "vllm_piep.spans",
        "vllm_piep.datasets", "vllm_piep.ledger"))))
def test_pure_and_hardware_packages_never_import_the_runtime(module: str) -> None:
    assert not [m for m in GRAPH[module] if within(m, ("vllm_piep.runtime", "vllm"))]


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if within(m, SERVING)
                                          and m not in SERVING_CLIS))
def test_serving_never_imports_the_offline_toolkit(module: str) -> None:
    assert not [m for m in GRAPH[module] if within(m, OFFLINE_ONLY)], module


def test_no_import_circles() -> None:
    ours = {m: {i for i in deps if i in GRAPH and i != m} for m, deps in GRAPH.items()}
    # A package's __init__ is imported with its submodules: an edge to it is not a circle
    # unless the __init__ itself imports back.
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(ours[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(ours):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


# A path into a folder named "shared" beside the clone (two dots before it, or data, papers, notes
# or DESIGN.md after it), in prose or built in Python: a user's clone has nothing beside it.
BESIDE_THE_CLONE = re.compile(
    r"\.\./shared\b|\bshared/(?:data|papers|notes|DESIGN\.md)\b|[\"']shared[\"']\s*/")
# Files that may name such paths: the published data's own notes, and the history of changes.
MAY_NAME_BESIDE = ("data/", "CHANGELOG.md")
# Every published data file the tests read (through tests/support/paths.py's PUBLISHED_DATA).
PUBLISHED_FILES = (
    "irene/device_1/model_level_features.csv", "irene/device_1/module_level_features.csv",
    "irene/device_1/ml1_level_features.csv", "irene/device_1/ml2_level_features.csv",
    "mlenergy-v2/a100_configs.csv", "mlenergy-v3/h100_configs.csv", "model_structures.csv",
    "wilkins/all-stats.csv", "wilkins/all-input-stats.csv", "wilkins/all-output-stats.csv",
    "wilkins/all-input-scale-stats.csv", "wilkins/all-output-scale-stats.csv",
)


def tracked_text_files() -> list[Path]:
    """The repository's tracked files (`git ls-files`) that exist and hold text."""
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout: no list of tracked files")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    files = [ROOT / name for name in listed if name and not name.startswith(MAY_NAME_BESIDE)]
    return [f for f in files if f.is_file() and b"\0" not in f.read_bytes()[:8192]]


def test_no_file_names_a_folder_beside_the_clone() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
             for path in tracked_text_files()
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if BESIDE_THE_CLONE.search(line)]
    assert not found, "paths beside the clone:\n" + "\n".join(found)


def test_the_guard_sees_paths_beside_the_clone() -> None:
    beside = "shared"  # spelled apart here, so that this file does not name such a path itself
    for line in (f"see ../{beside}/data/x.csv", f"`{beside}/papers/irene.txt`",
                 f"{beside}/DESIGN.md", f'DATA = ROOT.parent / "{beside}" / "data"',
                 f"read {beside}/notes/a.md"):
        assert BESIDE_THE_CLONE.search(line), line
    for line in ("shared experts", "shared_expert_intermediate_size", "shared/dev/shm",
                 "GPUs shared with others", "data/model_structures.csv"):
        assert not BESIDE_THE_CLONE.search(line), line


@pytest.mark.parametrize("name", PUBLISHED_FILES)
def test_the_published_data_the_tests_read_is_in_the_repository(name: str) -> None:
    assert PUBLISHED_DATA == ROOT / "data"
    path = PUBLISHED_DATA / name
    assert path.is_file() and path.stat().st_size > 0, f"{path} is missing or empty"
