"""Meters read in vLLM's workers, read by the engine core as one (`meters/worker_readings.py`):
every rank's counter at one instant that no rank extrapolates, interpolated between its
readings, so that the readings' differences add up to the ranks' own rises; a rank that fails,
goes quiet or goes back has its energy estimated from the others' at the share it drew, counted
as fitted, until it reads again; no rank to read is a MeterError (the engine's fallback); and
the readings cross a real ZeroMQ socket from sender threads to the sink."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from vllm_piep.meters.common import MeterError
from vllm_piep.meters.simulated import SimTrace, SimulatedMeter
from vllm_piep.meters.worker_readings import (
    RankReadings,
    ReadingSender,
    ReadingSink,
    WorkerMeter,
    WorkerReading,
)

S = 1_000_000_000


class FakeClock:
    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t


def reading(rank: int, t_ns: int, watts: float, error: str | None = None) -> WorkerReading:
    """A counter drawing `watts` since 0 (rank r's device `gpu`)."""
    return WorkerReading("", rank, t_ns, {} if error else {"gpu": watts * t_ns / S}, "nvml",
                         "measured", 0.02, error)


def readings_of(clock: FakeClock) -> RankReadings:
    return RankReadings("", to_local=lambda t: t, clock=clock)


def test_the_ranks_are_read_at_the_latest_instant_all_have_reached() -> None:
    clock = FakeClock()
    store = readings_of(clock)
    meter = WorkerMeter(store, [0, 1], start_s=0)
    store.add(reading(0, 0, 100.0))
    store.add(reading(1, 0, 200.0))
    meter.start()
    store.add(reading(0, 30 * S // 1000, 100.0))  # rank 0 at 30 ms
    store.add(reading(1, 20 * S // 1000, 200.0))  # rank 1 at 20 ms: the instant is 20 ms
    first = meter.read()
    assert first.t_ns == 20 * S // 1000
    # rank 0 between its readings at 0 and 30 ms: interpolated, 100 W x 20 ms
    assert first.joules == {"rank0:gpu": pytest.approx(2.0), "rank1:gpu": pytest.approx(4.0)}
    store.add(reading(1, 50 * S // 1000, 200.0))
    store.add(reading(0, 45 * S // 1000, 100.0))
    second = meter.read()
    assert second.t_ns == 45 * S // 1000
    # Over [20, 45] ms: each rank's own rise, whatever their readings' times.
    assert second.total - first.total == pytest.approx(300.0 * 0.025, rel=1e-12)
    assert [(d.name, d.kind) for d in meter.devices()] == [("rank0:gpu", "gpu"),
                                                            ("rank1:gpu", "gpu")]
    assert meter.name == "workers (nvml)" and meter.source == "measured"


def test_every_read_is_each_ranks_true_counter_at_one_instant() -> None:
    """Each rank's power is constant between its readings and changes at each (so its counter
    is the straight line through them); the ranks report at different rates. Every read is
    each rank's true counter at the read's instant, an instant no rank has to extrapolate to,
    and the instants never go back: the reads' differences are the ranks' own energy."""
    clock = FakeClock()
    store = readings_of(clock)
    ranks = (0, 1, 2)
    meter = WorkerMeter(store, ranks, start_s=0)
    history = {r: ([0], [0.0]) for r in ranks}  # each rank's (times, counters) as sent
    for r in ranks:
        store.add(WorkerReading("", r, 0, {"gpu": 0.0}, "nvml", "measured", 0.02))
    meter.start()
    reads = [meter.read()]
    for k in range(1, 90):
        r = ranks[k % 3]
        times, counters = history[r]
        step = (7 + 3 * r + k % 5) * S // 1000
        times.append(times[-1] + step)
        counters.append(counters[-1] + (50 + 40 * r + 13 * (k % 4)) * step / S)
        store.add(WorkerReading("", r, times[-1], {"gpu": counters[-1]}, "nvml", "measured",
                                0.02))
        reads.append(meter.read())
    assert all(b.t_ns >= a.t_ns for a, b in zip(reads, reads[1:]))
    for read in reads:
        for r in ranks:
            true = float(np.interp(read.t_ns, *history[r]))
            assert read.joules[f"rank{r}:gpu"] == pytest.approx(true, rel=1e-12, abs=1e-12)


def two_ranks_started(clock: FakeClock, watts: tuple[float, float] = (100.0, 100.0),
                      **kwargs: float) -> tuple[RankReadings, WorkerMeter]:
    """Ranks 0 and 1 drawing `watts`, read once at 0 s; the meter started over them and its
    base read (as the engine's meter thread does)."""
    store = readings_of(clock)
    meter = WorkerMeter(store, [0, 1], start_s=0, **kwargs)
    store.add(reading(0, 0, watts[0]))
    store.add(reading(1, 0, watts[1]))
    meter.start()
    assert meter.read().total == 0.0
    return store, meter


def measured_for(store: RankReadings, meter: WorkerMeter, seconds: range,
                 watts: tuple[float, float]) -> None:
    """Both ranks read at each of these seconds."""
    for t in seconds:
        store.add(reading(0, t * S, watts[0]))
        store.add(reading(1, t * S, watts[1]))
        got = meter.read()
        assert got.t_ns == t * S and got.fitted == 0.0


def test_a_failing_rank_is_estimated_from_the_others_at_the_share_it_drew(
        caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 draws 50 W beside rank 0's 100 W for 3 s, then its meter fails: its energy goes
    on at a third of the engine's, counted as fitted, and the counter keeps rising by the
    measured rank's energy and the estimate; once its meter reads again (its counter from 0),
    it is measured again after one estimated interval, and the log says both."""
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    store, meter = two_ranks_started(clock, (100.0, 50.0))
    measured_for(store, meter, range(1, 4), (100.0, 50.0))
    store.add(reading(1, 4 * S, 0.0, error="NVMLError_GpuIsLost: GPU is lost"))
    for t in (4, 5, 6):
        clock.t = t * S
        store.add(reading(0, t * S, 100.0))
        got = meter.read()
        assert got.t_ns == t * S
        assert got.joules["rank0:gpu"] == pytest.approx(100.0 * t, rel=1e-12)
        assert got.joules["rank1:gpu"] == pytest.approx(150.0 + 50.0 * (t - 3), rel=1e-12)
        assert got.fitted == pytest.approx(50.0 * (t - 3), rel=1e-12)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "worker rank 1's meter cannot be read (its meter failed: " \
        "NVMLError_GpuIsLost" in warned[0] and "`fitted`" in warned[0]
    # Back, its counter from 0 at 6.5 s (a new series: its rise to 7 s is not its first
    # reading, which the interval from 6 s cannot know): that interval is estimated, the
    # next measured.
    for t in (7, 8):  # rank 1 now at 60 W
        clock.t = t * S
        store.add(reading(0, t * S, 100.0))
        store.add(WorkerReading("", 1, t * S, {"gpu": 30.0 + 60.0 * (t - 7)}, "nvml",
                                "measured", 0.02))
        got = meter.read()
    assert got.fitted == pytest.approx(50.0 * 4, rel=1e-12)  # 3 to 7 s estimated
    assert got.joules["rank1:gpu"] == pytest.approx(150.0 + 50.0 * 4 + 60.0, rel=1e-12)
    assert "worker rank 1's meter reads again" in caplog.text
    assert sum(r.levelname == "WARNING" for r in caplog.records) == 1


def test_a_quiet_rank_is_estimated_after_stall_s_and_no_rank_at_all_is_an_error() -> None:
    clock = FakeClock()
    store, meter = two_ranks_started(clock, stall_s=2.0)
    measured_for(store, meter, range(1, 2), (100.0, 100.0))
    clock.t = 4 * S
    store.add(reading(0, 4 * S, 100.0))  # rank 1 said nothing for 3 s
    got = meter.read()
    assert got.fitted == pytest.approx(300.0, rel=1e-12)  # at rank 0's 100 W, as before
    clock.t = 7 * S  # and now neither has
    with pytest.raises(MeterError, match=r"no worker's meter can be read \(rank 0: it sent "
                                         r"no reading for 2 s\)"):
        meter.read()


def test_a_rank_that_fails_before_its_share_was_measured_is_a_meter_error() -> None:
    store, meter = two_ranks_started(FakeClock())
    store.add(reading(1, S, 100.0, error="NVMLError_GpuIsLost: GPU is lost"))
    store.add(reading(0, S, 100.0))
    with pytest.raises(MeterError, match="worker rank 1 cannot be read \\(its meter failed: "
                                         "NVMLError_GpuIsLost: GPU is lost\\) and no share"):
        meter.read()


def test_a_rank_whose_counter_goes_back_is_estimated_for_that_interval_only() -> None:
    store, meter = two_ranks_started(FakeClock())
    measured_for(store, meter, range(1, 3), (100.0, 100.0))
    store.add(reading(0, 3 * S, 100.0))
    store.add(WorkerReading("", 1, 3 * S, {"gpu": 5.0}, "nvml", "measured", 0.02))  # reset
    assert meter.read().fitted == pytest.approx(100.0, rel=1e-12)
    store.add(reading(0, 4 * S, 100.0))
    store.add(WorkerReading("", 1, 4 * S, {"gpu": 105.0}, "nvml", "measured", 0.02))
    got = meter.read()
    assert got.fitted == pytest.approx(100.0, rel=1e-12)
    assert got.joules == {"rank0:gpu": pytest.approx(400.0), "rank1:gpu": pytest.approx(400.0)}


def test_a_rank_that_never_reports_stops_the_start() -> None:
    store = readings_of(FakeClock())
    store.add(reading(0, 0, 100.0))
    with pytest.raises(MeterError, match=r"worker rank\(s\) 1 within 0 s"):
        WorkerMeter(store, [0, 1], start_s=0).start()


def test_readings_cross_a_real_socket_from_each_workers_thread() -> None:
    sink = ReadingSink()
    watts = {0: 150.0, 1: 90.0}
    senders = [ReadingSender(sink.address, r, lambda w=w: SimulatedMeter(
        {"gpu": SimTrace(w, 0.0, 1.0)}), period_s=0.005).start() for r, w in watts.items()]
    meter = WorkerMeter(sink.readings, [0, 1], start_s=60, on_stop=sink.close)
    try:
        meter.start()
        store = sink.readings
        with store.lock:  # driven by arrivals, not by sleeping
            assert store.arrived.wait_for(
                lambda: all(len(store.ranks[r].t) >= 5 for r in watts), 60)
        first = meter.read()
        with store.lock:
            n = {r: len(store.ranks[r].t) for r in watts}
            assert store.arrived.wait_for(
                lambda: all(len(store.ranks[r].t) >= n[r] + 5 for r in watts), 60)
        second = meter.read()
    finally:
        for s in senders:
            s.stop()
        meter.stop()
    assert meter.source == "simulated" and meter.name == "workers (simulated)"
    assert set(second.joules) == {"rank0:gpu", "rank1:gpu"}
    # 240 W over the instant's move (the clocks' round trip through Unix time: a few us)
    seconds = (second.t_ns - first.t_ns) / 1e9
    assert seconds > 0
    assert (second.total - first.total) / seconds == pytest.approx(240.0, rel=0.02)


def test_a_meter_that_cannot_start_in_a_worker_sends_why() -> None:
    sink = ReadingSink()

    def broken() -> SimulatedMeter:
        raise MeterError("no NVML in this container")

    sender = ReadingSender(sink.address, 3, broken).start()
    meter = WorkerMeter(sink.readings, [3], start_s=60, on_stop=sink.close)
    try:
        with pytest.raises(MeterError, match="worker rank 3 failed: MeterError: no NVML"):
            meter.start()
    finally:
        sender.stop()
        meter.stop()
    assert not any(t.name == "piep-worker-meter" and t.is_alive()
                   for t in threading.enumerate())


def test_a_message_without_the_sinks_token_is_dropped() -> None:
    store = RankReadings("secret", to_local=lambda t: t, clock=FakeClock())
    store.add(WorkerReading("guess", 0, 0, {"gpu": 1e9}, "nvml", "measured", 0.02))
    assert store.ranks == {}
    store.add(WorkerReading("secret", 0, 0, {"gpu": 1.0}, "nvml", "measured", 0.02))
    assert list(store.ranks) == [0]


def test_a_sender_that_a_stranger_imitates_adds_nothing() -> None:
    """The sink's address carries its token; a sender given the address without it is one
    whose readings the engine must not take."""
    sink = ReadingSink()
    assert "#" in sink.address
    stranger = ReadingSender(sink.address.partition("#")[0], 0,
                             lambda: SimulatedMeter({"gpu": SimTrace(1e6)}), 0.005).start()
    honest = ReadingSender(sink.address, 1, lambda: SimulatedMeter({"gpu": SimTrace(50.0)}),
                           0.005).start()
    store = sink.readings
    try:
        with store.lock:
            assert store.arrived.wait_for(lambda: 1 in store.ranks
                                          and len(store.ranks[1].t) >= 3, 60)
            assert 0 not in store.ranks
    finally:
        stranger.stop()
        honest.stop()
        sink.close()


def test_a_worker_meter_behind_mig_instances_is_refused_as_the_engines_is() -> None:
    """NVML reads the whole board behind MIG instances: a worker says so, as the engine core
    does for its own meter, and the engine does not measure with it."""
    from vllm_piep.meters.common import Device

    class WholeBoard(SimulatedMeter):
        def devices(self) -> list[Device]:
            return [Device("gpu0", "gpu", "whole GPU (MIG instance MIG-a)")]

    sink = ReadingSink()
    sender = ReadingSender(sink.address, 0, lambda: WholeBoard({"gpu0": SimTrace(100.0)}),
                           0.005).start()
    meter = WorkerMeter(sink.readings, [0], start_s=60, on_stop=sink.close)
    try:
        with pytest.raises(MeterError, match="worker rank 0 failed: MeterError: .*whole GPU "
                                             "behind MIG instances"):
            meter.start()
    finally:
        sender.stop()
        meter.stop()
