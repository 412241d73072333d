"""The closed form of decode runs (`decode_runs.py`) alone: a run's joules are the sums of its
steps' decode terms at its contexts; members leave, join and are read at any step, across the
segments of the prefix sums; over many segments memory stays fixed (old segments dropped once
their runs moved on, a few per step) and the error stays at a rounding's scale."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_piep.runtime.engine_core.decode_runs import FREE_ROWS, MOVES_PER_STEP, DecodeRuns
from vllm_piep.runtime.engine_core.request_table import FIRST, RequestTable
from vllm_piep.runtime.record import COLUMN

C = 3
COLUMNS = tuple(range(FIRST, FIRST + C))
U = (1.0, 1.0, 0.0, 1.0, 1.0, 0.0)  # a one-token decode's base features at context 0
V = (0.0, 1.0, 1.0, 0.0, 0.0, 0.0)  # and per token of context


def _runs(segment: int) -> tuple[RequestTable, DecodeRuns]:
    table = RequestTable()
    return table, DecodeRuns(table, COLUMNS, segment=segment)


def _terms(per_feature: list[list[float]]) -> tuple[float, ...]:
    """(A.U per component, A.V per component), as the split gives them."""
    return (*[sum(a * u for a, u in zip(row, U, strict=True)) for row in per_feature],
            *[sum(a * v for a, v in zip(row, V, strict=True)) for row in per_feature])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 160), segment=st.integers(2, 40))
def test_a_run_gets_each_of_its_steps_share_at_its_context(seed: int, steps: int,
                                                            segment: int) -> None:
    """Random per-step coefficients, requests joining, leaving and being read at random steps,
    across segments: every row is the sum over its request's steps of A . base at its
    context."""
    rng = random.Random(seed)
    table, runs = _runs(segment)
    want: dict[str, list[float]] = {}
    context: dict[str, int] = {}
    slots = {r: table.slot(r) for r in "abcde"}
    for _ in range(steps):
        for r in "abcde":
            draw = rng.random()
            if r not in runs.members and draw < 0.3:
                context[r] = rng.randint(0, 5000)
                runs.join(r, slots[r], context[r])
            elif r in runs.members and draw < 0.1:
                runs.leave(r)
            elif r in runs.members and draw < 0.2:
                runs.fold(slots[r])
        assert runs.expected_context() == sum(context[r] for r in runs.members)
        per_feature = [[rng.random() for _ in U] for _ in range(C)]
        explicit = rng.random() < 0.1  # split explicitly: the members' shares are not the runs'
        for r in runs.members:
            if not explicit:
                share = [sum(a * (u + context[r] * v) for a, u, v in zip(row, U, V, strict=True))
                         for row in per_feature]
                want[r] = [x + y for x, y in zip(want.get(r, [0.0] * C), share, strict=True)]
            context[r] += 1  # one token on either way
        runs.push(None if explicit else _terms(per_feature))
        assert len(runs.prefix.segments) <= 3
    runs.leave_all()
    for r, slot in slots.items():
        got = table.rows[slot][FIRST:FIRST + C]
        assert got == pytest.approx(want.get(r, [0.0] * C), rel=1e-10, abs=1e-9)
        assert table.rows[slot][COLUMN["decode"]] == pytest.approx(sum(got), rel=1e-12)


def test_many_segments_keep_memory_fixed_and_the_error_at_rounding() -> None:
    """200 000 steps over segments of 64 with one request in its run throughout from context
    100, and 40 more that join in the middle: their rows match the exact sums to 1e-12, never
    more than two segments are kept, and each step folds at most a few runs out of an older
    segment; a dropped segment's rows are freed a few per step, never all in one step, and
    are all freed before the next segment is dropped."""
    segment = 64
    table, runs = _runs(segment)
    rng = random.Random(7)
    total_steps = 200_000
    late = [f"r{i}" for i in range(40)]
    slots = {r: table.slot(r) for r in ["a", *late]}
    context = {"a": 100, **{r: 7 + i for i, r in enumerate(late)}}
    want: dict[str, list[float]] = {r: [] for r in slots}
    runs.join("a", slots["a"], context["a"])
    most = 0
    for k in range(total_steps):
        if k == total_steps // 2 + 5:
            for r in late:
                runs.join(r, slots[r], context[r])
        per_feature = [[rng.random() * 1e-3 for _ in U] for _ in range(C)]
        terms = _terms(per_feature)
        for r in runs.members:
            want[r].append(math.fsum(terms[c] + context[r] * terms[C + c] for c in range(C)))
            context[r] += 1
        moving = len(runs.moving)
        held = sum(map(len, runs.prefix.dropped))
        runs.push(terms)
        assert moving - len(runs.moving) <= max(MOVES_PER_STEP, -(-41 * 4 // segment))
        most = max(most, len(runs.prefix.segments))
        freed = held - sum(map(len, runs.prefix.dropped))
        assert freed <= FREE_ROWS and len(runs.prefix.dropped) <= 1
    assert most == 2
    assert len(runs.prefix.dropped) <= 1 and sum(map(len, runs.prefix.dropped)) <= segment + 1
    runs.leave_all()
    for r, slot in slots.items():
        assert sum(table.rows[slot][FIRST:FIRST + C]) == pytest.approx(math.fsum(want[r]),
                                                                      rel=1e-12)
