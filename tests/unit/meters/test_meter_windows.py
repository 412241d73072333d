"""Energy of span windows, repeated sampling, and the resource sampler, against stand-in meters
whose power is known in closed form."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pandas as pd
import pytest
from support.fake_clock import FakeClock

from vllm_piep.clock import now_ns
from vllm_piep.meters import common
from vllm_piep.meters.common import CompositeMeter, Device, Meter, MeterReading, WindowTooShort
from vllm_piep.meters.resources import ResourceSampler, across_ranks, window_features
from vllm_piep.meters.windows import repeated_sampling, span_energy


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The clock repeated sampling times its calls on (`meters.common.now_ns`), moved only by
    the calls it times: no test below depends on how fast this machine runs."""
    fake = FakeClock()
    monkeypatch.setattr(common, "now_ns", fake)
    return fake


class ConstantPower(Meter):
    """Stand-in hardware: each device draws a constant power; joules = watts x elapsed."""

    name = "constant"
    resolution_s = 0.02

    def __init__(self, watts: dict[str, float], clock: Callable[[], int] = now_ns):
        self.watts = watts
        self.clock = clock
        self.t0 = 0

    @classmethod
    def available(cls) -> bool:
        return True

    def devices(self) -> Sequence[Device]:
        return [Device(d, "gpu") for d in self.watts]

    def start(self) -> None:
        self.t0 = self.clock()

    def read(self) -> MeterReading:
        t = self.clock()
        return MeterReading(t, {d: w * (t - self.t0) / 1e9 for d, w in self.watts.items()})


def test_span_energy_interpolates_cumulative_readings() -> None:
    # Readings every 100 ms of a 50 W + 10 W load; spans that cut between readings.
    readings = [MeterReading(k * 100_000_000, {"gpu0": 5.0 * k, "dram": 1.0 * k})
                for k in range(11)]
    spans = pd.DataFrame({"start_ns": [50_000_000, 120_000_000, 900_000_000],
                          "end_ns": [250_000_000, 130_000_000, 1_100_000_000]})
    meter = ConstantPower({"gpu0": 50.0, "dram": 10.0})
    meter.resolution_s, meter.source = 0.1, "estimated"
    energy = span_energy(spans, readings, meter)
    assert set(energy["source"]) == {"estimated"} and set(energy["meter"]) == {"constant"}
    assert energy.loc[0, "gpu0"] == pytest.approx(50 * 0.2)
    assert energy.loc[0, "total"] == pytest.approx(60 * 0.2)
    assert energy.loc[1, "total"] == pytest.approx(60 * 0.01)
    assert list(energy["resolved"]) == [True, False, True]
    assert list(energy["covered"]) == [True, True, False]  # past the last reading
    assert energy["total"].isna().tolist() == [False, False, True]


def test_window_refuses_below_resolution_unless_asked() -> None:
    meter = ConstantPower({"gpu0": 100.0})
    meter.start()
    a = meter.read()
    b = MeterReading(a.t_ns + 5_000_000, {"gpu0": a.joules["gpu0"] + 0.5})
    with pytest.raises(WindowTooShort, match="resolution"):
        meter.window(a, b)
    assert meter.window(a, b, allow_short=True).total == pytest.approx(0.5)


def test_repeated_sampling_gives_energy_per_call_and_subtracts_a_baseline(
        clock: FakeClock) -> None:
    meter = ConstantPower({"gpu0": 40.0, "dram": 10.0}, clock)
    meter.start()

    def call() -> None:  # 0.2 ms of work: far below the meter's 20 ms resolution
        clock.advance(2e-4)

    result = repeated_sampling(call, meter, windows=4)
    assert result.window_s >= 10 * meter.resolution_s
    # One call sizes a burst, whose mean sizes the windows: 1.1 x 200 ms / 0.2 ms.
    assert result.calls == 1100
    # Constant power: energy per call is power x the measured time per call.
    assert result.joules_per_call == pytest.approx(50.0 * 2e-4, rel=1e-9)
    assert result.seconds_per_call == pytest.approx(2e-4, rel=1e-9)
    assert result.std_joules == pytest.approx(0.0, abs=1e-12)
    assert len(result.per_window_joules) == 4
    net = repeated_sampling(call, meter, windows=3, baseline_watts=10.0)
    assert net.joules_per_call == pytest.approx(40.0 * 2e-4, rel=1e-9)


def test_repeated_sampling_grows_windows_that_a_slow_sizing_burst_made_short(
        clock: FakeClock) -> None:
    # The burst of calls timed to size the windows is preempted (each of its calls seems to
    # take 2 ms instead of 0.2 ms): windows of the count it gives (110 calls, 22 ms) would be
    # short of ten times the meter's 20 ms resolution, so the windows start again with more.
    meter = ConstantPower({"gpu0": 40.0}, clock)
    meter.start()
    made = 0

    def call() -> None:
        nonlocal made
        made += 1
        # 3 warm-up calls, the call that sizes the burst, then the burst (6 calls)
        clock.advance(2e-3 if 5 <= made <= 10 else 2e-4)

    result = repeated_sampling(call, meter, windows=3)
    assert made > 10  # the burst was the one slowed down
    assert result.window_s >= 10 * meter.resolution_s
    # Grown from one short window of 110 calls: 110 x 1.2 x 200 ms / 22 ms (its ceiling in
    # floating point may be one more).
    assert result.calls == pytest.approx(1200, abs=1)
    assert len(result.per_window_joules) == 3
    assert result.joules_per_call == pytest.approx(40.0 * 2e-4, rel=1e-9)


def test_composite_meter_sums_devices_and_keeps_names_unique(clock: FakeClock) -> None:
    gpu, cpu = ConstantPower({"dev": 30.0}, clock), ConstantPower({"dev": 5.0}, clock)
    cpu.name = "cpu"
    system = CompositeMeter([gpu, cpu])
    system.start()
    clock.advance(0.05)
    reading = system.read()
    assert set(reading.joules) == {"constant:dev", "cpu:dev"}
    assert reading.joules["constant:dev"] == pytest.approx(30 * 0.05, rel=1e-9)
    assert reading.total == pytest.approx(35 * 0.05, rel=1e-9)


def test_sampler_is_bounded_stops_cleanly_and_aggregates_windows() -> None:
    before = set(threading.enumerate())
    ticks = iter(range(10**6))
    sampled_80 = threading.Event()

    def cpu_reader() -> dict[str, float]:
        tick = next(ticks)
        if tick == 80:
            sampled_80.set()
        return {"cpu_util": float(tick)}

    sampler = ResourceSampler(interval_s=0.001, max_samples=50, cpu_reader=cpu_reader)
    assert sampler.interval_s == 0.01  # the rate is bounded
    with sampler:  # until 80 samples were taken, however slowly
        assert sampled_80.wait(timeout=60)
    assert set(threading.enumerate()) == before
    frame = sampler.frame()
    assert len(frame) == 50 and sampler.dropped > 0  # bounded memory, drops counted
    t = frame["t_ns"]
    mid = window_features(frame, int(t.iloc[10]), int(t.iloc[19]))
    assert mid["cpu_util"] == pytest.approx(frame["cpu_util"].iloc[10:20].mean())
    tiny = window_features(frame, int(t.iloc[30]) + 1, int(t.iloc[30]) + 2)
    assert tiny["cpu_util"] == frame["cpu_util"].iloc[30]  # last sample before the end


def test_real_cpu_features_are_sampled() -> None:
    sampled = threading.Event()
    with ResourceSampler(interval_s=0.02, on_sample=lambda *_: sampled.set()) as sampler:
        assert sampled.wait(timeout=60)
    frame = sampler.frame()
    assert len(frame) >= 1
    assert {"cpu_util", "cpu_mem_util", "process_rss_bytes"} <= set(frame.columns)
    assert (frame["process_rss_bytes"] > 0).all()
    assert frame["cpu_mem_util"].between(0, 100).all()


class FakeNvml:
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    def __init__(self, fail_after: int | None = None):
        self.calls = 0
        self.fail_after = fail_after

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802 (NVML's names)
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int):  # noqa: N802
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("GPU is lost")
        return type("U", (), {"gpu": 50 + 10 * h, "memory": 20})()

    def nvmlDeviceGetMemoryInfo(self, h: int):  # noqa: N802
        return type("M", (), {"used": 1_000 * (h + 1)})()

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:  # noqa: N802
        return 1400 if kind == self.NVML_CLOCK_SM else 1200


def test_gpu_features_through_an_nvml_stand_in_and_a_failing_gpu() -> None:
    sampled = threading.Event()
    with ResourceSampler(interval_s=0.01, nvml=FakeNvml(), gpu_indices=[0, 1],
                         on_sample=lambda *_: sampled.set()) as sampler:
        assert sampled.wait(timeout=60)
    row = sampler.frame().iloc[-1]
    assert row["gpu_util"] == 55 and row["gpu_mem_bytes"] == 1500 and row["gpu_clock_mhz"] == 1400
    # The GPU stops answering at its 4th read: samples after it go on with the CPU's features.
    samples: list[dict[str, float]] = []
    two_after = threading.Event()

    def sample(_: int, values: dict[str, float]) -> None:
        samples.append(values)
        if len(samples) >= 6:
            two_after.set()

    with ResourceSampler(interval_s=0.01, nvml=FakeNvml(fail_after=3), gpu_indices=[0],
                         on_sample=sample) as s:
        assert two_after.wait(timeout=60)
    assert s.gpu_error is not None and "GPU is lost" in s.gpu_error
    assert all("gpu_util" in v for v in samples[:3]) and "gpu_util" not in samples[-1]
    assert s.frame()["cpu_util"].notna().all()  # CPU features go on


def test_features_across_ranks_are_mean_std_min_max() -> None:
    agg = across_ranks([{"gpu_util": 50.0, "cpu_util": 10.0}, {"gpu_util": 70.0}])
    assert agg["gpu_util_mean"] == 60.0 and agg["gpu_util_std"] == 10.0
    assert (agg["gpu_util_min"], agg["gpu_util_max"]) == (50.0, 70.0)
    assert agg["cpu_util_mean"] == 10.0 and agg["cpu_util_std"] == 0.0
