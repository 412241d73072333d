"""The engine's row arithmetic written out per layout (`row_code.py`) does what its docstrings
say, against the same arithmetic as plain loops, on random values."""

from __future__ import annotations

import random

import pytest

from vllm_piep.runtime.engine_core.row_code import (
    decode_adder,
    run_joules,
    run_row,
    scaled_adder,
    shares_adder,
)
from vllm_piep.runtime.record import COLUMN

LAYOUTS = [(0, 1, 2, 3, 12), (0, 1, *range(2, 13)), (0, 1, 12)]


def _rows(rng: random.Random, n: int) -> list[list[float]]:
    return [[rng.random() for _ in range(17)] for _ in range(n)]


@pytest.mark.parametrize("columns", LAYOUTS)
def test_adders_add_each_value_to_its_column(columns: tuple[int, ...]) -> None:
    rng = random.Random(len(columns))
    rows = _rows(rng, 5)
    want = [list(row) for row in rows]
    slots = [3, 0, 4]
    shares = [tuple(rng.random() for _ in columns) for _ in slots]
    shares_adder(columns)(rows, slots, shares)
    for slot, share in zip(slots, shares, strict=True):
        for column, value in zip(columns, share, strict=True):
            want[slot][column] += value
    assert rows == want
    scaled_adder(columns)(rows[1], shares[0], 0.25)
    for column, value in zip(columns, shares[0], strict=True):
        want[1][column] += 0.25 * value
    assert rows == want
    parts = [rng.random() for _ in columns]
    decode_adder(columns)(rows[2], parts)
    for column, value in zip(columns, parts, strict=True):
        want[2][column] += value
    want[2][COLUMN["decode"]] += sum(parts)
    assert rows[2] == pytest.approx(want[2], rel=1e-15)


@pytest.mark.parametrize("width", [1, 3, 6, 11])
def test_a_run_row_and_its_joules_are_the_closed_form(width: int) -> None:
    rng = random.Random(width)
    prev = tuple(rng.random() for _ in range(3 * width))
    terms = tuple(rng.random() for _ in range(2 * width))
    row = run_row(width)(prev, terms, 7)
    assert row == pytest.approx([*(p + t for p, t in zip(prev[:2 * width], terms, strict=True)),
                                 *(p + 7 * v for p, v in zip(prev[2 * width:],
                                                             terms[width:], strict=True))])
    got = run_joules(width)(row, prev, 100.0)
    # One step at local index 7 from context 107 (100 at the segment's step 0).
    want = [terms[c] + 107.0 * terms[width + c] for c in range(width)]
    assert got == pytest.approx(want, rel=1e-12)
    assert "for " not in run_row(width).source and "for " not in run_joules(width).source
