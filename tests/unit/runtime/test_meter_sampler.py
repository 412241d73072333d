"""The serve-time meter sampler: joules counted exactly from the simulated meter, the source
label (an estimate is never "measured"), and failing meters (stand-ins in
tests/support/raising_meter.py) that raise nothing, set piep_meter_up to 0, warn once and are
retried with a back-off."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from support.paths import SUPPORT

from tests.support.raising_meter import ReadRaisingMeter, raising_read
from vllm_piep.config import ConfigError, PiepConfig
from vllm_piep.meters.common import Meter, MeterError, MeterReading
from vllm_piep.meters.cpu_estimate import CpuEstimateMeter
from vllm_piep.meters.simulated import SimTrace, SimulatedMeter
from vllm_piep.runtime.api_server import meter_sampler
from vllm_piep.runtime.api_server.meter_sampler import (
    MeterSampler,
    meter_factory,
    start_serve_meter,
)


class StepClock:
    """A CLOCK_MONOTONIC stand-in that moves 0.1 s each time it is read."""

    def __init__(self) -> None:
        self.t_ns = 10**9
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        self.t_ns += 10**8
        return self.t_ns


class ManualClock:
    def __init__(self) -> None:
        self.t_ns = 10**9

    def __call__(self) -> int:
        return self.t_ns

    def advance(self, seconds: float) -> None:
        self.t_ns += round(seconds * 1e9)


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def _wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def warnings(piep_logs):
    return lambda: [r.getMessage() for r in piep_logs.records if r.levelno == logging.WARNING]


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException | None]:
    """Exceptions that escaped any thread (there must be none)."""
    seen: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def test_simulated_meter_joules_counted_exactly() -> None:
    clock = ManualClock()
    registry = CollectorRegistry()
    sampler = MeterSampler(lambda: SimulatedMeter({"g": SimTrace(100.0)}, clock=clock),
                           "simulated", registry=registry)
    labels = {"meter": "simulated", "source": "simulated"}
    assert _value(registry, "piep_meter_up") == 0.0  # nothing read yet
    assert sampler.sample()  # opens and takes the baseline
    assert _value(registry, "piep_meter_joules_total", **labels) == 0.0
    assert _value(registry, "piep_meter_up") == 1.0
    clock.advance(2.5)
    assert sampler.sample()
    clock.advance(1.0)
    assert sampler.sample()
    assert _value(registry, "piep_meter_joules_total", **labels) == pytest.approx(350.0)
    assert sampler.joules == pytest.approx(350.0)


def test_thread_counts_every_increment(thread_errors: list) -> None:
    """Each meter read moves the clock 0.1 s at 100 W: after n reads the counter holds
    exactly 10 J * (n - 1) (the first read is the baseline)."""
    clock = StepClock()
    registry = CollectorRegistry()
    sampler = MeterSampler(lambda: SimulatedMeter({"g": SimTrace(100.0)}, clock=clock),
                           "simulated", interval_s=0.005, registry=registry).start()
    _wait_for(lambda: sampler.joules >= 50.0)
    sampler.stop()
    reads = clock.calls - 1  # start() read the clock once
    assert reads >= 6
    assert _value(registry, "piep_meter_joules_total", meter="simulated",
                  source="simulated") == pytest.approx(10.0 * (reads - 1))
    assert _value(registry, "piep_meter_up") == 0.0  # stopped: no longer reading
    assert thread_errors == []


def test_cpu_estimate_is_labelled_estimated(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 100 0 100 800 0 0 0 0 0 0\n")
    clock = ManualClock()
    registry = CollectorRegistry()
    sampler = MeterSampler(
        lambda: CpuEstimateMeter(tdp_watts=100.0, proc_stat=stat, cpuinfo=tmp_path / "none",
                                 sampler=False, clock=clock),
        "cpu-estimate", registry=registry)
    assert sampler.sample()
    clock.advance(1.0)
    assert sampler.sample()
    # idle until a sample says otherwise: the static 30 % of TDP for one second
    assert _value(registry, "piep_meter_joules_total", meter="cpu-estimate",
                  source="estimated") == pytest.approx(30.0)
    assert _value(registry, "piep_meter_joules_total", meter="cpu-estimate",
                  source="measured") is None


def test_failing_reads_raise_nothing_and_warn_once(warnings, thread_errors: list) -> None:
    registry = CollectorRegistry()
    sampler = MeterSampler(raising_read, "raising_meter:raising_read", interval_s=0.005,
                           max_backoff_s=0.01, registry=registry).start()
    sampler.start()  # idempotent: still one thread
    _wait_for(lambda: isinstance(sampler.meter, ReadRaisingMeter) and sampler.meter.reads >= 20)
    meter = sampler.meter
    assert isinstance(meter, ReadRaisingMeter)
    assert _value(registry, "piep_meter_up") == 0.0
    sampler.stop()
    sampler.stop()  # idempotent
    assert meter.stopped  # the thread has ended and closed the meter
    assert not any(t.name == "piep-meter-sampler" for t in threading.enumerate())
    msgs = warnings()
    assert len(msgs) == 1
    assert "reading the serve-time meter raising-read failed" in msgs[0]
    assert "injected meter read failure" in msgs[0]
    assert _value(registry, "piep_meter_joules_total", meter="raising-read",
                  source="measured") == 0.0
    assert thread_errors == []


def test_meter_failing_at_open_through_module_callable(
        warnings, thread_errors: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SUPPORT))  # as a server gets it through PYTHONPATH
    factory, label = meter_factory("raising_meter:raising_open")
    built: list[Meter] = []
    registry = CollectorRegistry()
    sampler = MeterSampler(lambda: built.append(factory()) or built[-1], label,
                           interval_s=0.005, max_backoff_s=0.01, registry=registry).start()
    _wait_for(lambda: len(built) >= 20)
    sampler.stop()
    # imported as `raising_meter`, the way a server with tests/support on its path does
    assert [type(m).__name__ for m in built] == ["OpenRaisingMeter"] * len(built)
    assert sampler.meter is None and not sampler.up
    assert _value(registry, "piep_meter_up") == 0.0
    assert len(warnings()) == 1
    assert "opening the serve-time meter raising_meter:raising_open failed" in warnings()[0]
    assert "injected meter open failure" in warnings()[0]
    assert thread_errors == []


class FlakyMeter(SimulatedMeter):
    """Reads fail `failures` times after the first, then succeed."""

    def __init__(self, failures: int, clock: ManualClock) -> None:
        super().__init__({"g": SimTrace(10.0)}, clock=clock)
        self.failures = failures
        self.reads = 0

    def read(self) -> MeterReading:
        self.reads += 1
        if 1 < self.reads <= 1 + self.failures:
            raise MeterError("flaky")
        return super().read()


class ScriptedStop:
    """Stands in for the sampler's stop event: records each wait and stops after `waits`."""

    def __init__(self, waits: int) -> None:
        self.delays: list[float] = []
        self.waits = waits

    def is_set(self) -> bool:
        return len(self.delays) >= self.waits

    def wait(self, delay: float) -> bool:
        self.delays.append(delay)
        return self.is_set()

    def set(self) -> None:
        self.waits = 0


def test_backoff_doubles_to_the_cap_and_resets_on_recovery(warnings) -> None:
    clock = ManualClock()
    meter = FlakyMeter(failures=7, clock=clock)
    registry = CollectorRegistry()
    sampler = MeterSampler(lambda: meter, "flaky", interval_s=1.0, max_backoff_s=30.0,
                           registry=registry)
    script = ScriptedStop(waits=10)
    sampler._stop_evt = script  # type: ignore[assignment]
    sampler._run()  # in this thread: one baseline read, 7 failures, 2 good reads
    assert script.delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 1.0, 1.0]
    assert _value(registry, "piep_meter_up") == 0.0  # _run's end closes the meter
    assert len(warnings()) == 1


def test_up_returns_after_recovery() -> None:
    clock = ManualClock()
    registry = CollectorRegistry()
    sampler = MeterSampler(lambda: FlakyMeter(failures=2, clock=clock), "flaky",
                           registry=registry)
    assert sampler.sample()
    clock.advance(1.0)
    assert not sampler.sample() and _value(registry, "piep_meter_up") == 0.0
    assert not sampler.sample()
    assert sampler.sample() and _value(registry, "piep_meter_up") == 1.0
    # the meter's counter kept running through the failures: nothing is lost
    assert sampler.joules == pytest.approx(10.0)


def test_meter_settings() -> None:
    assert meter_factory("auto")[1] == "auto"
    assert meter_factory(" CPU-Estimate ")[1] == "cpu-estimate"
    assert meter_factory("external:/var/log/wall.csv")[1] == "external:/var/log/wall.csv"
    assert meter_factory("raising_meter:raising_read")[1] == "raising_meter:raising_read"
    assert isinstance(meter_factory("simulated")[0](), SimulatedMeter)
    for bad, why in [("external", "external:PATH"), ("external:", "path"),
                     ("nvm", "unknown meter"), ("mod:", "module:callable"),
                     (":f", "module:callable")]:
        with pytest.raises(ValueError, match=why):
            meter_factory(bad)
    with pytest.raises(ConfigError, match="unknown meter 'gpu'"):
        PiepConfig.from_sources(None, {"PIEP_METER": "gpu"})


def test_start_serve_meter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meter_sampler, "_serving", None)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert start_serve_meter(PiepConfig()) is None  # off by default
    registry = CollectorRegistry()
    config = PiepConfig.from_sources(None, {"PIEP_METER": "simulated"})
    sampler = start_serve_meter(config, registry=registry, interval_s=0.01)
    try:
        assert sampler is not None
        assert start_serve_meter(config, registry=registry) is sampler  # once per process
        _wait_for(lambda: (_value(registry, "piep_meter_joules_total", meter="simulated",
                                  source="simulated") or 0.0) > 0.0)
        assert _value(registry, "piep_meter_up") == 1.0
    finally:
        if sampler is not None:
            sampler.stop()


def test_only_one_api_server_process_samples(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(meter_sampler, "_sole_lock", None)
    assert meter_sampler._sole_sampler()
    held = meter_sampler._sole_lock
    assert held is not None
    try:
        # another process (here: another open file on the same lock) is refused
        monkeypatch.setattr(meter_sampler, "_sole_lock", None)
        assert not meter_sampler._sole_sampler()
    finally:
        held.close()
