"""A clock that moves only when a test moves it, for meters and stand-in devices: a test
installs it where a module reads the time (its `now_ns`, its `time`, polling's `sleep`) and
every reading then follows from what the test did, however fast this machine runs."""

from __future__ import annotations

from types import ModuleType

import pytest

EPOCH_S = 1_763_791_200.0  # what `time()` reads when `ns` is 0: a Unix epoch instant


class FakeClock:
    """CLOCK_MONOTONIC in integer nanoseconds when called (as `vllm_piep.clock.now_ns`), and as
    much of the `time` module as the meters and their CLI read (`monotonic`, `perf_counter`,
    `time`, `sleep`). Only `advance` and `sleep` move it; a sleep returns at once."""

    def __init__(self, t_ns: int = 1_000_000_000) -> None:
        self.ns = t_ns

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def monotonic(self) -> float:
        return self.ns / 1e9

    perf_counter = monotonic

    def time(self) -> float:
        return EPOCH_S + self.ns / 1e9


def install(monkeypatch: pytest.MonkeyPatch, clock: FakeClock, *modules: ModuleType) -> None:
    """Makes `clock` the time of each module: its `now_ns`, its `sleep` and its `time` module,
    whichever it has."""
    for module in modules:
        for name, fake in (("now_ns", clock), ("sleep", clock.sleep), ("time", clock)):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fake)
