"""The closed form of decode runs (`decode_runs.py`) alone: a run's joules are the sums of its
steps' decode terms at its contexts; members leave and join at any step; the prefix sums are
rebased every epoch, so that over 10^7 steps memory stays fixed and the error stays at a
rounding's scale."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_piep.predict.split_rule import DECODE_U, DECODE_V, decode_terms
from vllm_piep.runtime.engine_core.decode_runs import DecodeRuns
from vllm_piep.runtime.engine_core.request_table import RequestTable
from vllm_piep.runtime.record import COLUMN

C = 3
FIRST = COLUMN["decode"] + 1


def _runs(epoch: int) -> tuple[RequestTable, DecodeRuns]:
    table = RequestTable()
    return table, DecodeRuns(table, C, epoch=epoch)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 120), epoch=st.integers(2, 40))
def test_a_run_gets_each_of_its_steps_share_at_its_context(seed: int, steps: int,
                                                            epoch: int) -> None:
    """Random per-step coefficients, requests joining, leaving and being read at random steps,
    across rebases: every row is the sum over its request's steps of A . base at its context."""
    rng = np.random.default_rng(seed)
    table, runs = _runs(epoch)
    want: dict[str, np.ndarray] = {}
    context: dict[str, float] = {}
    slots = {r: table.slot(r) for r in "abcde"}
    for _ in range(steps):
        for r in "abcde":
            draw = rng.random()
            if r not in runs.members and draw < 0.3:
                context[r] = float(rng.integers(0, 5000))
                runs.join(r, slots[r], context[r])
            elif r in runs.members and draw < 0.1:
                runs.leave(r)
            elif r in runs.members and draw < 0.2:
                runs.fold(np.array([slots[r]]))
        assert runs.expected_context() == pytest.approx(
            sum(context[r] for r in runs.members), rel=1e-12)
        per_feature = rng.random((C, len(DECODE_U)))
        explicit = rng.random() < 0.1  # split explicitly: the members' shares are not the runs'
        for r in runs.members:
            if not explicit:
                share = per_feature @ (DECODE_U + context[r] * DECODE_V)
                want[r] = want.get(r, np.zeros(C)) + share
            context[r] += 1.0  # one token on either way
        runs.push(None if explicit else decode_terms(per_feature))
    runs.leave_all()
    for r, slot in slots.items():
        got = table.rows[slot, FIRST:FIRST + C]
        np.testing.assert_allclose(got, want.get(r, np.zeros(C)), rtol=1e-10, atol=1e-9)
        assert table.rows[slot, COLUMN["decode"]] == pytest.approx(got.sum(), rel=1e-12)


def test_ten_million_steps_keep_memory_fixed_and_the_error_at_rounding() -> None:
    """10^7 steps (the prefix sums written an epoch at a time, as `push` writes them step by
    step) with one request in its run throughout from context 100, another from the middle:
    their rows match the exact sums to 1e-12, and the prefix sums never grow."""
    epoch = 4096
    table, runs = _runs(epoch)
    size = runs.prefix.nbytes
    rng = np.random.default_rng(7)
    a, b = table.slot("a"), table.slot("b")
    runs.join("a", a, 100.0)
    total_steps = 10_000_000
    half = (total_steps // 2 // epoch) * epoch
    want = {"a": [], "b": []}
    context = {"a": 100.0, "b": 7.0}
    done = 0
    uv = np.column_stack([DECODE_U, DECODE_V])
    while done < total_steps:
        if done == half:
            runs.join("b", b, context["b"])
        k = min(epoch - runs.j, total_steps - done)
        per_feature = rng.random((k, C, len(DECODE_U))) * 1e-3
        terms = per_feature @ uv  # [k, C, 2]
        j = runs.j + np.arange(k)
        block = np.stack([terms[:, :, 0], terms[:, :, 1], j[:, None] * terms[:, :, 1]], axis=1)
        runs.prefix[runs.j + 1:runs.j + k + 1] = runs.prefix[runs.j] + np.cumsum(block, axis=0)
        for r in runs.members:
            ctx = context[r] + np.arange(k)
            want[r].append(float(np.sum(terms[:, :, 0] + ctx[:, None] * terms[:, :, 1])))
            context[r] += k
        runs.j += k
        done += k
        if runs.j == epoch:
            runs.rebase()
        assert runs.prefix.nbytes == size
    runs.leave_all()
    for r, slot in (("a", a), ("b", b)):
        exact = math.fsum(want[r])
        assert table.rows[slot, FIRST:FIRST + C].sum() == pytest.approx(exact, rel=1e-12)
    assert runs.j == total_steps % epoch or runs.j == 0
