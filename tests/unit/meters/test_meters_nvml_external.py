"""NvmlMeter against a stand-in pynvml (tests/support/fake_pynvml.py) and, on a GPU machine, the
real one; ExternalLogMeter against CSV power logs with hand-computed energies. The stand-in's
counters, the meters' timestamps and NVML's resolution detection run on a fake clock that only
the tests move; the sampler thread polls at its own pace, and the tests wait for its polls
(counted by the stand-in), never for a time."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest

from tests.support.fake_clock import FakeClock, install
from tests.support.fake_pynvml import FakeGpu, FakeNvml, NVMLError, NVMLError_GpuIsLost
from vllm_piep.meters import external, nvml, polling
from vllm_piep.meters.common import MeterError, MeterReading, WindowTooShort
from vllm_piep.meters.external import ExternalLogMeter, align_offset
from vllm_piep.meters.nvml import NvmlMeter

HANG_S = 60.0  # how long a wait for the sampler thread may take before the test fails


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    install(monkeypatch, fake, nvml, polling, external)
    return fake


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "piep-nvml-sampler"]


def _wait_for(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_S
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _polls(fake: FakeNvml) -> int:
    return fake.calls.get("nvmlDeviceGetPowerUsage", 0)


# ---------------------------------------------------------------------------------------------
# NVML: energy counter path
# ---------------------------------------------------------------------------------------------
def test_counter_path_exact_joules(clock):
    fake = FakeNvml([FakeGpu(manual_mj=1_000_000), FakeGpu(manual_mj=7_000)])
    m = NvmlMeter(nvml=fake, detect_s=0.03)
    assert (m.name, m.source) == ("nvml", "measured")
    assert [(d.name, d.kind) for d in m.devices()] == [("gpu0", "gpu"), ("gpu1", "gpu")]
    m.start()
    try:
        assert m.sampled_gpus == [] and _sampler_threads() == []
        r0 = m.read()
        assert r0.joules == {"gpu0": 0.0, "gpu1": 0.0}
        fake.gpus[0].manual_mj += 12_345
        fake.gpus[1].manual_mj += 500
        clock.advance(0.001)
        r1 = m.read()
        assert r1.joules == {"gpu0": 12.345, "gpu1": 0.5}
        assert r1.t_ns - r0.t_ns == 1_000_000
        # the counter never changed during detection: resolution is the (conservative) detect time
        assert m.resolution_s == pytest.approx(0.03)
        w = m.window(r0, r1, allow_short=True)
        assert w.joules == {"gpu0": 12.345, "gpu1": 0.5} and w.source == "measured"
    finally:
        m.stop()
    assert fake.init_count == 0


def test_indices_select_gpus_and_are_checked(clock):
    fake = FakeNvml([FakeGpu(manual_mj=0), FakeGpu(manual_mj=0), FakeGpu(manual_mj=0)])
    m = NvmlMeter(indices=[2], nvml=fake, detect_s=0.01)
    assert [d.name for d in m.devices()] == ["gpu2"]
    m.stop()
    with pytest.raises(MeterError, match=r"indices \[5\] out of range; NVML sees 3"):
        NvmlMeter(indices=[0, 5], nvml=fake)
    assert fake.init_count == 0  # the failed constructor shut NVML down again


def test_update_period_detection_and_short_windows(clock):
    fake = FakeNvml([FakeGpu(power_w=200.0, update_period_s=0.05, clock=clock)])
    m = NvmlMeter(nvml=fake, detect_s=0.5)
    m.start()
    try:
        # the counter moves every 50 ms; polled every 1 ms, its changes are 50 ms apart; the
        # detection stops at its fourth change, an update (200 ms after the GPU's first reading)
        assert m.resolution_s == pytest.approx(0.05)
        r0 = m.read()
        clock.advance(0.01)
        r1 = m.read()
        with pytest.raises(WindowTooShort, match=r"shorter than the meter's \d+\.\d ms resolution"):
            m.window(r0, r1)
        # an approximation: the counter's updates within it, none in these 10 ms...
        assert m.window(r0, r1, allow_short=True).joules["gpu0"] == 0.0
        clock.advance(0.04)
        r2 = m.read()
        # ...and one 10 J step (50 ms x 200 W) in the next 40 ms
        assert m.window(r1, r2, allow_short=True).joules["gpu0"] == 10.0
        clock.advance(0.3)
        r3 = m.read()
        w = m.window(r0, r3)
        # read at updates: exact
        assert w.seconds == pytest.approx(0.35) and w.joules["gpu0"] == 70.0
        clock.advance(0.03)
        w = m.window(r0, m.read())
        # read between updates: the counter as it was at the last one, 30 ms x 200 W behind
        assert w.seconds == pytest.approx(0.38) and w.joules["gpu0"] == 70.0
    finally:
        m.stop()
    lenient = NvmlMeter(nvml=FakeNvml([FakeGpu(update_period_s=0.05, clock=clock)]),
                        detect_s=0.3, allow_short_windows=True)
    lenient.start()
    try:
        a = lenient.read()
        b = MeterReading(a.t_ns + 10_000_000, a.joules)  # a 10 ms window
        assert lenient.window(a, b).seconds == pytest.approx(0.01)
    finally:
        lenient.stop()


# ---------------------------------------------------------------------------------------------
# NVML: power polling path (no energy counter), mixed machine
# ---------------------------------------------------------------------------------------------
def test_power_polling_path_mixed_machine(clock):
    poll = 0.01
    fake = FakeNvml([FakeGpu(manual_mj=0), FakeGpu(has_counter=False, power_w=100.0)])
    m = NvmlMeter(nvml=fake, poll_interval_s=poll, detect_s=0.02)
    m.start()
    try:
        assert m.sampled_gpus == [1] and len(_sampler_threads()) == 1
        assert m.resolution_s == pytest.approx(0.02)  # max(detect fallback, poll interval)
        r0 = m.read()
        clock.advance(0.2)
        polls = _polls(fake)
        _wait_for(lambda: _polls(fake) >= polls + 2)  # a poll began and ended 0.2 s in
        step = clock()
        fake.gpus[1].power_w = 300.0
        polls = _polls(fake)
        # A poll begun after the step read 300 W and has ended, still at the step's time: the
        # step falls on a poll, and the power between polls is constant.
        _wait_for(lambda: _polls(fake) >= polls + 2)
        clock.advance(0.2)
        fake.gpus[0].manual_mj = 4_000
        r1 = m.read()
        assert (step - r0.t_ns, r1.t_ns - step) == (200_000_000, 200_000_000)
        # constant power between polls: the trapezoid integrates it exactly
        w = m.window(r0, r1)
        assert w.joules["gpu1"] == pytest.approx(100.0 * 0.2 + 300.0 * 0.2, rel=1e-12)
        assert w.joules["gpu0"] == 4.0
        # the polls between readings moved the integral: a thread that stopped polling would
        # have held the first 100 W to the end
        assert w.joules["gpu1"] != pytest.approx(100.0 * 0.4)
    finally:
        m.stop()
    assert _sampler_threads() == []
    assert fake.init_count == 0


def test_stop_leaves_no_threads_and_is_idempotent(clock):
    before = set(threading.enumerate())
    fake = FakeNvml([FakeGpu(has_counter=False), FakeGpu(has_counter=False)])
    m = NvmlMeter(nvml=fake, poll_interval_s=0.005)
    with m:
        clock.advance(0.03)
        assert m.read().total == pytest.approx(2 * 100.0 * 0.03, rel=1e-12)
    m.stop()
    assert set(threading.enumerate()) <= before
    assert fake.init_count == 0
    with pytest.raises(MeterError, match="stopped"):
        m.start()


# ---------------------------------------------------------------------------------------------
# NVML: failures
# ---------------------------------------------------------------------------------------------
def test_library_missing(monkeypatch):
    if not NvmlMeter.available():  # the real library on a machine without a GPU/driver
        with pytest.raises(MeterError, match=r"NVML is not usable on this machine.*nvmlInit"):
            NvmlMeter()
    with pytest.raises(MeterError, match=r"nvmlInit failed: .*Library Not Found"):
        NvmlMeter(nvml=FakeNvml(missing=True))
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(missing=True))
    assert NvmlMeter.available() is False
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([]))  # driver fine, no GPU
    assert NvmlMeter.available() is False
    monkeypatch.setitem(sys.modules, "pynvml", None)  # package not installed
    assert NvmlMeter.available() is False
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeGpu()]))
    assert NvmlMeter.available() is True


def test_raising_call_during_read_counter_path(clock):
    fake = FakeNvml([FakeGpu(manual_mj=0), FakeGpu(manual_mj=0)])
    m = NvmlMeter(nvml=fake, detect_s=0.01)
    m.start()
    try:
        fake.gpus[1].fail["nvmlDeviceGetTotalEnergyConsumption"] = NVMLError_GpuIsLost()
        with pytest.raises(MeterError,
                           match=r"gpu1: nvmlDeviceGetTotalEnergyConsumption failed.*GPU is lost"):
            m.read()
    finally:
        m.stop()


def test_raising_call_in_sampler_thread_surfaces_in_read(clock):
    fake = FakeNvml([FakeGpu(has_counter=False)])
    m = NvmlMeter(nvml=fake, poll_interval_s=0.005)
    m.start()
    try:
        m.read()
        [thread] = _sampler_threads()
        fake.gpus[0].fail["nvmlDeviceGetPowerUsage"] = NVMLError(999, "Unknown Error")
        thread.join(HANG_S)
        assert not thread.is_alive()  # the thread recorded the error and ended
        with pytest.raises(MeterError, match=r"gpu0: nvmlDeviceGetPowerUsage failed.*Unknown"):
            m.read()
    finally:
        m.stop()


def test_other_counter_error_at_start_is_not_treated_as_unsupported(clock):
    fake = FakeNvml([FakeGpu(fail={"nvmlDeviceGetTotalEnergyConsumption": NVMLError(999, "boom")})])
    m = NvmlMeter(nvml=fake)
    with pytest.raises(MeterError, match=r"gpu0: nvmlDeviceGetTotalEnergyConsumption failed"):
        m.start()
    m.stop()


def test_real_nvml():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - whatever NVML says is the reason
        pytest.skip(f"no NVIDIA GPU/driver here: NVML reports {type(e).__name__}: {e}")
    if n == 0:
        pytest.skip("no NVIDIA GPU/driver here: NVML reports 0 devices")
    assert NvmlMeter.available()
    m = NvmlMeter(indices=[0])
    m.start()
    try:
        assert 0.0 < m.resolution_s <= 0.5
        r0 = m.read()
        time.sleep(max(0.5, 3 * m.resolution_s))
        w = m.window(r0, m.read())
        # any GPU draws between a few W (idle) and ~1.5 kW
        assert 1.0 < w.watts["gpu0"] < 1500.0
    finally:
        m.stop()
    assert _sampler_threads() == []


# ---------------------------------------------------------------------------------------------
# External power log
# ---------------------------------------------------------------------------------------------
EPOCH = 1_763_791_200.0  # log timestamps are epoch seconds
# piecewise-linear trace: (seconds after EPOCH, watts)
TRACE = [(0, 100), (1, 200), (2, 200), (4, 50), (5, 50), (7.5, 300), (10, 0)]
MONO_AT_EPOCH_NS = 5_000_000_000  # the log's first sample happened at monotonic 5 s here

# Expected energies, worked by hand (trapezoids; w(x) interpolated where a window cuts):
#   [0,10]  : 150 + 200 + (200+50)/2*2 + 50 + (50+300)/2*2.5 + (300+0)/2*2.5 = 1462.5
#   [0.5,1.5]: w(0.5)=150, w(1.5)=200 -> (150+200)/2*0.5 + 200*0.5          = 187.5
#   [3,6]   : w(3)=125, w(6)=50+250*(1/2.5)=150 -> (125+50)/2 + 50 + (50+150)/2 = 237.5
#   [8,9]   : inside one segment, w(x)=300*(10-x)/2.5: w(8)=240, w(9)=120 -> 180
#   [4.5,4.5]: 0
WINDOWS = [((0, 10), 1462.5), ((0.5, 1.5), 187.5), ((3, 6), 237.5), ((8, 9), 180.0),
           ((4.5, 4.5), 0.0)]


def _write(path, rows, header="timestamp,watts"):
    path.write_text(header + "\n" + "".join(f"{t},{w}\n" for t, w in rows))


def _ns(rel_s: float) -> int:
    return MONO_AT_EPOCH_NS + round(rel_s * 1e9)


def test_external_energy_windows_with_clock_offset(tmp_path):
    log = tmp_path / "wall.csv"
    _write(log, [(f"{EPOCH + t:.3f}", w) for t, w in TRACE])
    offset = align_offset(EPOCH, MONO_AT_EPOCH_NS)
    assert offset == pytest.approx(5.0 - EPOCH)
    assert ExternalLogMeter.align_offset(EPOCH, MONO_AT_EPOCH_NS) == offset
    m = ExternalLogMeter(log, clock_offset_s=offset)
    assert (m.name, m.source) == ("external", "measured")
    assert [(d.name, d.kind) for d in m.devices()] == [("wall", "system")]
    assert m.span_ns == (pytest.approx(_ns(0), abs=1000), pytest.approx(_ns(10), abs=1000))
    for (a, b), joules in WINDOWS:
        assert m.energy_between(_ns(a), _ns(b)) == pytest.approx(joules, rel=1e-3, abs=1e-6)
    # the median sample interval: gaps 1,1,2,1,2.5,2.5 -> 1.5 s
    assert m.resolution_s == pytest.approx(1.5)
    w = m.window(m.reading_at(_ns(3)), m.reading_at(_ns(6)))
    assert w.joules["wall"] == pytest.approx(237.5, rel=1e-3)
    assert w.watts["wall"] == pytest.approx(237.5 / 3, rel=1e-3)
    with pytest.raises(WindowTooShort):
        m.window(m.reading_at(_ns(8)), m.reading_at(_ns(9)))
    # without the offset the monotonic window lies nowhere near the log
    with pytest.raises(MeterError, match="outside the log"):
        ExternalLogMeter(log).energy_between(_ns(0), _ns(1))
    with pytest.raises(MeterError, match="outside the log"):
        m.energy_between(_ns(9), _ns(11))


def test_external_custom_columns(tmp_path):
    log = tmp_path / "emonpi.csv"
    log.write_text("power_w,node,time\n100,5,10.0\n300,5,12.0\n")
    m = ExternalLogMeter(log, clock_offset_s=-10.0, time_column="time", watts_column="power_w",
                         device="rack")
    assert m.energy_between(0, 2_000_000_000) == pytest.approx(400.0)  # (100+300)/2*2
    assert m.energy_between(1_000_000_000, 2_000_000_000) == pytest.approx(250.0)  # (200+300)/2


@pytest.mark.parametrize("body, line, what", [
    ("1.0,100\n2.0,abc\n", 3, "non-numeric"),
    ("1.0,100\n2.0\n", 3, "missing"),
    ("1.0,100\n2.0,\n", 3, "missing"),
    ("1.0,100\n2.0,100\n2.0,100\n", 4, "not after"),
    ("1.0,100\n\n0.5,100\n", 4, "not after"),
    ("1.0,nan\n", 2, "non-finite"),
])
def test_external_bad_rows_name_file_and_line(tmp_path, body, line, what):
    log = tmp_path / "bad.csv"
    log.write_text("timestamp,watts\n" + body)
    with pytest.raises(MeterError, match=rf"bad\.csv, line {line}: .*{what}"):
        ExternalLogMeter(log)


def test_external_bad_header_and_missing_file(tmp_path):
    log = tmp_path / "hdr.csv"
    log.write_text("time,power\n1,2\n")
    with pytest.raises(MeterError, match=r"hdr\.csv, line 1: header .* lacks column"):
        ExternalLogMeter(log)
    with pytest.raises(MeterError, match="cannot read power log"):
        ExternalLogMeter(tmp_path / "nope.csv")


def test_external_live_growing_log(tmp_path, clock):
    log = tmp_path / "live.csv"
    s = clock() / 1e9  # the logger uses this host's monotonic clock: offset 0
    _write(log, [(s - 1.0, 100.0), (s + 0.1, 100.0)])
    m = ExternalLogMeter(log)
    m.start()
    clock.advance(0.15)
    r1 = m.read()  # now is past the last sample: energy up to it, 100 W from start
    assert r1.joules["wall"] == pytest.approx(100.0 * 0.1, rel=1e-9)
    with log.open("a") as f:
        f.write(f"{s + 0.2},100.0\n{s + 0.3},")  # the last line is still being written
    clock.advance(0.1)
    r2 = m.read()
    assert r2.joules["wall"] - r1.joules["wall"] == pytest.approx(10.0, rel=1e-9)
    with log.open("a") as f:
        f.write("300.0\n")  # the line completes: (100+300)/2 W over 0.1 s = 20 J
    clock.advance(0.1)
    r3 = m.read()
    assert r3.joules["wall"] - r2.joules["wall"] == pytest.approx(20.0, rel=1e-9)
    assert (r2.t_ns - r1.t_ns, r3.t_ns - r2.t_ns) == (100_000_000, 100_000_000)
    with pytest.raises(MeterError, match="before start"):
        ExternalLogMeter(log).read()


def test_external_log_whose_clock_runs_ahead_is_refused(tmp_path, clock):
    """A live log stamped a minute ahead of this host: its clock disagrees, said in one line
    (measured mode then settles by the fit instead of splitting a minute-shifted power)."""
    log = tmp_path / "ahead.csv"
    s = clock() / 1e9
    _write(log, [(s + 60.0, 100.0), (s + 61.0, 100.0)])
    m = ExternalLogMeter(log)
    m.start()
    with pytest.raises(MeterError, match=r"ahead.* s ahead|s ahead of this host's clock"):
        m.read()
