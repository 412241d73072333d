"""The campaign's repeated sampling inside the workers (`runtime/worker/replay.py`): which steps
are sampled, and windows that every rank of a group runs alike and that last long enough for
the meter even when the call timed to size them was slow."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from vllm_piep.meters import common
from vllm_piep.meters.common import SHORT_WINDOW_RETRIES
from vllm_piep.runtime.worker import replay
from vllm_piep.runtime.worker.replay import ReplaySampler


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _group(wants: Iterator[int], asked: list[int]) -> Callable[[int], int]:
    """`agree` as a tensor-parallel group gives it: the most any rank asks; the other rank asks
    `wants`, one value per agreement."""
    def agree(n: int) -> int:
        asked.append(n)
        return max(n, next(wants))

    return agree


def test_replay_sampler_decides_by_shape_and_agrees_on_calls() -> None:
    asked: list[int] = []
    # The other rank sizes with a burst of 1 call, asks for 4 calls a window, then finds each
    # window long enough.
    sampler = ReplaySampler(windows=3, min_window_s=0.002, every=3,
                            agree=_group(iter([1, 4, 0, 4, 4, 4]), asked))
    keys = [(4, False)] * 7 + [(4, True), None, (2, False)]
    decisions = [sampler.begin_step(k) for k in keys]
    assert decisions == [True, False, False, True, False, False, True, True, False, True]
    calls = []

    def call() -> None:
        calls.append(1)
        _busy(0.001)

    result = sampler.replay(call)
    # The group agrees on the burst and the count (the most any rank asks), starts the first
    # window together, and after each window agrees again: no window was short, so nothing
    # changes.
    assert asked[0] == 1 and asked[1] <= 3 and asked[2:] == [0, 4, 4, 4] and result.calls == 4
    assert len(calls) == 2 + 1 + 3 * 4  # warm-up, timing, the burst, then the windows
    assert len(result.windows) == 3 and all(b - a >= 0.002e9 for a, b in result.windows)
    assert not sampler.replaying


def test_a_slow_timed_call_does_not_leave_the_windows_short() -> None:
    # The call timed to size the burst is preempted (20 ms instead of 0.2 ms): one call a
    # window would last 0.2 ms against a 10 ms minimum.
    made = 0

    def call() -> None:
        nonlocal made
        made += 1
        _busy(0.02 if made == 2 else 0.0002)  # the second call is the timed one

    asked: list[int] = []
    sampler = ReplaySampler(windows=3, min_window_s=0.01, every=1,
                            agree=lambda n: asked.append(n) or n)
    result = sampler.replay(call)
    assert asked[0] == 1  # the burst the timed call sized
    assert result.calls > 1 and len(result.windows) == 3
    assert all(b - a >= 0.01e9 for a, b in result.windows)


def test_a_rank_starts_the_windows_again_when_another_ranks_window_was_short() -> None:
    # This rank's windows are long enough; the other rank's first one is short and it asks
    # for 6 calls: both start the windows again with 6, so their windows stay paired.
    asked: list[int] = []
    calls = []

    def call() -> None:
        calls.append(1)
        _busy(0.001)

    sampler = ReplaySampler(windows=3, min_window_s=0.0015, every=1,
                            agree=_group(iter([1, 2, 0, 6, 6, 6, 6]), asked))
    result = sampler.replay(call)
    assert result.calls == 6 and len(result.windows) == 3
    assert asked[2:] == [0, 2, 6, 6, 6]
    assert len(calls) == 2 + 1 + 2 + 3 * 6  # the first window of 2 calls is dropped


def test_windows_start_again_at_most_a_few_times() -> None:
    # Another rank's windows are always short: it asks for one call more every time.
    asked: list[int] = []
    sampler = ReplaySampler(windows=2, min_window_s=0.0, every=1,
                            agree=lambda n: asked.append(n) or n + 1)
    result = sampler.replay(lambda: None)
    restarts = SHORT_WINDOW_RETRIES
    # the burst, the count, the first start, then one agreement per window run (each restart
    # drops one)
    assert len(asked) == 3 + restarts + 2 and len(result.windows) == 2
    assert result.calls == asked[1] + 1 + restarts


def test_windows_are_sized_on_calls_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # A call takes 1 ms alone (the warm-up, the timed call) and 0.25 ms back to back, on a
    # clock the calls advance: sized from the timed call, a window would last a quarter of its
    # target and start again; sized from the burst, it is long enough at once.
    clock_ns = [0]
    monkeypatch.setattr(common, "now_ns", lambda: clock_ns[0])
    monkeypatch.setattr(replay, "now_ns", lambda: clock_ns[0])
    made = 0

    def call() -> None:
        nonlocal made
        made += 1
        clock_ns[0] += 1_000_000 if made <= 2 else 250_000

    asked: list[int] = []
    sampler = ReplaySampler(windows=2, min_window_s=0.08, every=1,
                            agree=lambda n: asked.append(n) or n)
    result = sampler.replay(call)
    burst = asked[0]
    assert burst * 1e-3 == pytest.approx(common.SIZING_BURST * 0.08, rel=0.2)
    assert len(asked) == 3 + 2  # the burst, the count, the start, one per window: no restart
    assert all(0.08e9 <= b - a <= 1.1 * 0.08e9 + 250_000 for a, b in result.windows)
    assert made == 2 + burst + 2 * result.calls


def test_replay_rotates_over_the_layers() -> None:
    sampler = ReplaySampler(windows=2, min_window_s=0.001, every=1, layers=2, n_layers=5)
    covered = []
    for _ in range(5):
        assert sampler.begin_step((1, False))
        covered.append([layer for layer in range(5) if sampler.covers(layer)])
        assert sampler.covers(None)  # embedding, final norm, logits: every sampled step
    assert covered == [[0, 1], [2, 3], [0, 4], [1, 2], [3, 4]]
    every = ReplaySampler(windows=2, min_window_s=0.001, every=1, layers=0, n_layers=5)
    every.begin_step((1, False))
    assert all(every.covers(layer) for layer in range(5))
