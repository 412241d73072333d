"""The meter's energy split among steps (`vllm_piep.meters.split`): exact conservation over any
steps and readings, the split by predicted energy, the fallback by the fit."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_piep.meters.split import IntervalSplitter, PendingStep

MS = 1_000_000


def steps_strategy():
    gap = st.integers(0, 30)
    length = st.integers(0, 40)
    joules = st.floats(0.0, 50.0)
    return st.lists(st.tuples(gap, length, joules, joules), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(steps=steps_strategy(), period=st.integers(1, 60), watts=st.floats(0.0, 300.0),
       idle=st.floats(0.0, 100.0))
def test_steps_plus_idle_equal_the_meter_delta(steps, period, watts, idle) -> None:
    splitter = IntervalSplitter(idle_watts=idle)
    t = 5 * MS
    splitter.add_reading(0, 0.0)
    made = []
    for gap, length, static, dynamic in steps:
        t0 = t + gap * MS
        t = t0 + length * MS
        made.append(PendingStep(t0, t, static, dynamic))
        splitter.add_step(made[-1])
    end = t + period * MS
    # A counter updated every `period` ms at a constant power.
    for k in range(1, end // (period * MS) + 2):
        at = k * period * MS
        splitter.add_reading(at, watts * at / 1e9)
    last = (end // (period * MS) + 1) * period * MS
    done = splitter.settle(known_until_ns=last)
    assert [s for s in done.steps] == made  # all settled, in order
    measured = math.fsum(s.measured_j for s in done.steps)
    assert measured + done.idle_j == pytest.approx(watts * last / 1e9, rel=1e-9, abs=1e-9)
    assert done.measured_j == pytest.approx(watts * last / 1e9, rel=1e-12, abs=1e-12)
    for step in done.steps:
        assert step.covered == pytest.approx(1.0) and not step.fallback


def test_an_interval_splits_by_predicted_energy_and_idle_time() -> None:
    splitter = IntervalSplitter(idle_watts=10.0)
    a, b = PendingStep(0, 40 * MS, 1.0, 1.0), PendingStep(40 * MS, 60 * MS, 0.5, 1.5)
    splitter.add_step(a)
    splitter.add_step(b)
    splitter.add_reading(0, 0.0)
    splitter.add_reading(100 * MS, 6.0)  # 40 ms idle at 10 W: weight 0.4 J
    done = splitter.settle(100 * MS)
    assert a.measured_j == pytest.approx(6.0 * 2.0 / 4.4)
    assert b.measured_j == pytest.approx(6.0 * 2.0 / 4.4)
    assert done.idle_j == pytest.approx(6.0 * 0.4 / 4.4)


def test_a_reading_waits_for_the_steps_it_covers() -> None:
    splitter = IntervalSplitter(idle_watts=0.0)
    splitter.add_reading(0, 0.0)
    splitter.add_reading(50 * MS, 5.0)
    assert splitter.settle(known_until_ns=40 * MS).steps == []  # a step may still run at 40
    step = PendingStep(10 * MS, 50 * MS, 0.0, 1.0)
    splitter.add_step(step)
    done = splitter.settle(known_until_ns=60 * MS)
    assert done.steps == [step] and step.measured_j == pytest.approx(5.0)


def test_a_step_across_two_readings_is_settled_by_the_second() -> None:
    splitter = IntervalSplitter(idle_watts=0.0)
    step = PendingStep(0, 100 * MS, 0.0, 1.0)
    splitter.add_step(step)
    splitter.add_reading(0, 0.0)
    splitter.add_reading(60 * MS, 3.0)
    assert splitter.settle(60 * MS).steps == []
    splitter.add_reading(100 * MS, 5.0)
    assert splitter.settle(100 * MS).steps == [step]
    assert step.measured_j == pytest.approx(5.0)


def test_a_counter_that_goes_back_leaves_its_steps_to_the_fit() -> None:
    splitter = IntervalSplitter(idle_watts=0.0)
    splitter.add_reading(0, 0.0)
    for k in range(10):  # a history: measured = 2 x predicted
        splitter.add_step(PendingStep(k * 10 * MS, (k + 1) * 10 * MS, 0.5, 0.5))
        splitter.add_reading((k + 1) * 10 * MS, 2.0 * (k + 1))
    splitter.settle(100 * MS)
    assert splitter.ratios() == pytest.approx((2.0, 2.0), rel=1e-3)
    lost = PendingStep(100 * MS, 110 * MS, 0.5, 0.5)
    splitter.add_step(lost)
    splitter.add_reading(110 * MS, 1.0)  # a driver reset
    done = splitter.settle(110 * MS)
    assert done.steps == [lost] and lost.fallback
    assert lost.measured_j == pytest.approx(2.0, rel=1e-3) == lost.fitted_j
    after = PendingStep(110 * MS, 120 * MS, 0.5, 0.5)
    splitter.add_step(after)
    splitter.add_reading(120 * MS, 3.0)  # measured again from the new base
    assert splitter.settle(120 * MS).steps == [after]
    assert after.measured_j == pytest.approx(2.0) and not after.fallback


def test_fallback_settles_by_the_fit_and_rebases() -> None:
    splitter = IntervalSplitter(idle_watts=1.0)
    splitter.add_reading(0, 0.0)
    step = PendingStep(0, 10 * MS, 1.0, 3.0)
    splitter.add_step(step)
    done = splitter.fallback(until_ns=10 * MS)  # no data yet: ratios (1, 1)
    assert done.steps == [step] and step.fallback and step.measured_j == pytest.approx(4.0)
    assert not splitter.based


@pytest.mark.parametrize("a,b", [(1.3, 0.7), (0.5, 2.0)])
def test_the_fit_finds_static_and_dynamic_ratios(a: float, b: float) -> None:
    splitter = IntervalSplitter(idle_watts=0.0)
    splitter.add_reading(0, 0.0)
    total = 0.0
    for k in range(50):
        static, dynamic = 1.0 + (k % 3), 0.5 + (k % 7)
        splitter.add_step(PendingStep(k * MS, (k + 1) * MS, static, dynamic))
        total += a * static + b * dynamic
        splitter.add_reading((k + 1) * MS, total)
    splitter.settle(50 * MS)
    assert splitter.ratios() == pytest.approx((a, b), rel=1e-3)


def test_the_estimated_part_of_an_interval_is_that_part_of_each_steps_share() -> None:
    splitter = IntervalSplitter(idle_watts=10.0)
    a, b = PendingStep(0, 40 * MS, 1.0, 1.0), PendingStep(60 * MS, 100 * MS, 1.0, 1.0)
    splitter.add_step(a)
    splitter.add_step(b)
    splitter.add_reading(0, 0.0, 0.0)
    splitter.add_reading(50 * MS, 4.0, 0.0)  # measured
    splitter.add_reading(100 * MS, 8.0, 1.2)  # 30 % of its 4 J estimated
    done = splitter.settle(100 * MS)
    assert done.steps == [a, b] and not a.fallback and not b.fallback
    assert a.estimated_j == 0.0 and a.unmeasured == 0.0
    assert b.estimated_j == pytest.approx(0.3 * b.measured_j, rel=1e-12)
    assert b.unmeasured == pytest.approx(0.3, rel=1e-12) and b.fitted_j == 0.0
    assert a.measured_j + b.measured_j + done.idle_j == pytest.approx(8.0, rel=1e-12)
    assert done.estimated_j == pytest.approx(1.2, rel=1e-12)  # the steps' and idle's
