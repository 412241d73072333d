"""The package's layout rules, read from the source (every import statement, at module level or
inside functions): only `runtime/` imports vLLM; the pure and hardware packages never import the
runtime; serving never imports the offline toolkit or its dependencies; no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_piep"
# What runs inside vLLM's processes, and what it may import from the project.
SERVING = ("vllm_piep.plugin", "vllm_piep.config", "vllm_piep.once", "vllm_piep.clock",
           "vllm_piep.runtime", "vllm_piep.predict", "vllm_piep.model", "vllm_piep.meters")
OFFLINE_ONLY = ("vllm_piep.calibrate", "vllm_piep.datasets", "vllm_piep.tools", "sklearn",
                "scipy", "skl2onnx", "matplotlib", "pyarrow", "tqdm")
# Serving modules that are command-line tools, run by hand, never inside vLLM.
SERVING_CLIS = ("vllm_piep.meters.__main__",)


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
        "vllm_piep.datasets"))))
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
