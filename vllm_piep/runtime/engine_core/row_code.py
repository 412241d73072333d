"""Engine core: the row arithmetic of the request table and the decode runs, written out as
straight-line Python for one layout (the split's live components) when the engine loads its
predictor. A loop over a dozen values costs the interpreter several times the arithmetic; each
function here is one line per value, made once and cached by layout. What each computes is in
its docstring, in plain terms; `tests/unit/runtime/test_row_code.py` holds each to that. No
vLLM imports."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from vllm_piep.runtime.record import COLUMN

_DECODE = COLUMN["decode"]


def _compile(source: str, name: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<row code: {name}>", "exec"), namespace)  # noqa: S102
    function = namespace[name]
    function.source = source
    return function


@cache
def shares_adder(columns: tuple[int, ...]) -> Callable[..., None]:
    """`add(rows, slots, shares)`: each share's values added to `columns` of its slot's row."""
    body = "\n".join(f"        row[{c}] += share[{k}]" for k, c in enumerate(columns)) or \
        "        pass"
    return _compile(f"def add(rows, slots, shares):\n"
                    f"    for slot, share in zip(slots, shares):\n"
                    f"        row = rows[slot]\n{body}\n", "add")


@cache
def scaled_adder(columns: tuple[int, ...]) -> Callable[..., None]:
    """`add(row, share, ratio)`: a share's values times `ratio` added to `columns` of a row."""
    body = "\n".join(f"    row[{c}] += ratio * share[{k}]" for k, c in enumerate(columns))
    return _compile(f"def add(row, share, ratio):\n{body or '    pass'}\n", "add")


@cache
def decode_adder(columns: tuple[int, ...]) -> Callable[..., None]:
    """`add(row, parts)`: decode joules per component into `columns` of a row, and their sum
    into its decode column."""
    body = "\n".join(f"    row[{c}] += parts[{k}]" for k, c in enumerate(columns))
    total = " + ".join(f"parts[{k}]" for k in range(len(columns)))
    return _compile(f"def add(row, parts):\n{body}\n    row[{_DECODE}] += {total}\n", "add")


@cache
def run_row(width: int) -> Callable[..., tuple[float, ...]]:
    """`row(prev, terms, j)`: the decode runs' next prefix row from the last one and a step's
    terms (A.U then A.V for `width` components; the step's number `j` in its segment): prev
    plus (A.U, A.V, j A.V)."""
    parts = [f"prev[{k}] + terms[{k}]" for k in range(2 * width)]
    parts += [f"prev[{2 * width + k}] + j * terms[{width + k}]" for k in range(width)]
    return _compile("def row(prev, terms, j):\n    return (" + ", ".join(parts) + ",)\n", "row")


@cache
def run_joules(width: int) -> Callable[..., tuple[float, ...]]:
    """`joules(a, b, at)`: per component, a run's joules between prefix rows b and a (later),
    its context at the segment's step 0 being `at`: dU + at dV + d(j V)."""
    parts = [f"a[{k}] - b[{k}] + at * (a[{width + k}] - b[{width + k}]) + "
             f"(a[{2 * width + k}] - b[{2 * width + k}])" for k in range(width)]
    return _compile("def joules(a, b, at):\n    return (" + ", ".join(parts) + ",)\n",
                    "joules")


@cache
def run_per_token(width: int) -> Callable[..., tuple[float, ...]]:
    """`per_token(a, b, x)`: per component, `x` times a run's joules per token of context
    between prefix rows b and a (later): x dV."""
    parts = [f"x * (a[{width + k}] - b[{width + k}])" for k in range(width)]
    return _compile("def per_token(a, b, x):\n    return (" + ", ".join(parts) + ",)\n",
                    "per_token")
