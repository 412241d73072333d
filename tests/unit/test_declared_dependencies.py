"""Every third-party package a module imports is declared in pyproject.toml: in the base
install, or in the extra that owns the module's package (read from the source: every import
statement, at module level or inside functions)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "vllm_piep", ROOT / "kernels_trace")
# Import name -> distribution name, where they differ.
DISTRIBUTION = {"sklearn": "scikit-learn", "pynvml": "nvidia-ml-py", "yaml": "pyyaml",
                "opentelemetry": "opentelemetry-api", "zmq": "pyzmq"}
# What each extra brings beyond what it lists: vLLM installs torch, Hugging Face's libraries
# and pyzmq.
BROUGHT_BY = {"vllm": {"torch", "transformers", "tokenizers", "safetensors",
                        "opentelemetry-sdk", "opentelemetry-api", "pyzmq"}}
# The extra that owns a package: its modules may import the extra's packages. Offline code
# that runs a model on a vLLM host (the span recorder's tree walk, the tiny models) belongs there.
OWNER = {"runtime": "vllm", "tools": "vllm", "model": "vllm", "meters": "vllm",
         "calibrate": "calibrate", "datasets": "calibrate", "spans": "calibrate"}


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {name: requirement_names(reqs) | BROUGHT_BY.get(name, set())
              for name, reqs in project["optional-dependencies"].items()}
    return requirement_names(project["dependencies"]), extras


def third_party_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names)
    return {n for n in found if n not in sys.stdlib_module_names
            and n not in ("vllm_piep", "kernels_trace", "__future__")}


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in package.rglob("*.py"))


# Modules that also need an extra of their own: the AMD meter runs in vLLM's processes on ROCm.
# The ledger's command line writes Parquet with the toolkit's pyarrow (CSV needs none).
MODULE_EXTRA = {"vllm_piep/meters/amdsmi.py": "amd", "vllm_piep/ledger/__main__.py": "calibrate"}


def owner_of(path: Path) -> str | None:
    parts = path.relative_to(ROOT).parts
    return OWNER.get(parts[1]) if parts[0] == "vllm_piep" and len(parts) > 2 else None


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_is_declared(path: Path) -> None:
    base, extras = declared()
    owner = owner_of(path)
    allowed = base | (extras[owner] if owner else set())
    extra = MODULE_EXTRA.get(path.relative_to(ROOT).as_posix())
    if extra is not None:
        allowed |= extras[extra]
    undeclared = {name for name in third_party_imports(path)
                  if DISTRIBUTION.get(name, name).lower().replace("_", "-") not in
                  {a.replace("_", "-") for a in allowed}}
    assert undeclared == set(), (
        f"{path.relative_to(ROOT)} imports {sorted(undeclared)}: declare them in pyproject.toml "
        f"(base, or the {owner or 'base'} extra)")


def test_the_check_sees_an_undeclared_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import numpy\n\ndef f():\n    from leftpad_only_here import x\n")
    assert third_party_imports(module) == {"numpy", "leftpad_only_here"}
