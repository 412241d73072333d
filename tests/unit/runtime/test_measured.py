"""Measured mode in the engine core (`runtime/engine_core/measured.py`): the meter decides each
step's energy, the model its split; finished requests wait for the meter; a meter that fails,
stalls or goes back falls back to the fit, labelled and counted. The meter is a stand-in at the
`Meter` seam with a known power trace and a counter that updates every `period` ms."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from vllm_piep.meters.common import Device, Meter, MeterError, MeterReading
from vllm_piep.meters.split import IntervalSplitter
from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape, StepBatch
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.engine_core.measured import EngineMeter

MS = 1_000_000
SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)


class Clock:
    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t


class CounterMeter(Meter):
    """A counter at `watts`, updated every `period_ms`, on the test's clock; `fail`, `stall`
    and `reset` make it raise, stop moving or fall back to 0."""

    name, source, resolution_s = "nvml", "measured", 0.01

    def __init__(self, clock: Clock, watts: float = 120.0, period_ms: int = 10) -> None:
        self.clock, self.watts, self.period = clock, watts, period_ms * MS
        self.fail = self.stall = False
        self.offset = 0.0
        self._frozen: float | None = None
        # From `estimated_from` (the counter's value then) on, `estimated` of each rise is an
        # estimate (a meter of several whose one part cannot be read; `WorkerMeter`).
        self.estimated, self.estimated_from = 0.0, 0.0

    @classmethod
    def available(cls) -> bool:
        return True

    def devices(self):
        return [Device("gpu0", "gpu")]

    def start(self) -> None:
        return None

    def value(self) -> float:
        updated = (self.clock.t // self.period) * self.period
        return self.watts * updated / 1e9 - self.offset

    def read(self) -> MeterReading:
        if self.fail:
            raise MeterError("nvml: gpu0: nvmlDeviceGetTotalEnergyConsumption failed: GPU lost")
        if self.stall:
            self._frozen = self.value() if self._frozen is None else self._frozen
            return MeterReading(self.clock.t, {"gpu0": self._frozen})
        self._frozen = None
        value = self.value()
        return MeterReading(self.clock.t, {"gpu0": value},
                            self.estimated * max(0.0, value - self.estimated_from))


def make(watts: float = 120.0, sparse: bool = False
         ) -> tuple[EngineAccountant, EngineMeter, CounterMeter, Clock, list]:
    """An engine in measured mode: dense (in-process: each step evaluated when done) or sparse
    (served: steps wait in the log for a pass)."""
    clock = Clock()
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior, clock_ns=clock)
    acc.sparse = sparse
    meter = CounterMeter(clock, watts)
    sent: list = []
    engine_meter = EngineMeter(acc, lambda: meter, "nvml", lambda: 10.0,
                               put_outputs=lambda client, outs: sent.append((client, outs)),
                               clock=clock)
    assert engine_meter.open()
    return acc, engine_meter, meter, clock, sent


def step(acc: EngineAccountant, clock: Clock, key: int, ids: list[str], ms: int) -> None:
    n = len(ids)
    acc.on_schedule(key, ids, StepBatch.from_lists([0] * n, [1] * n, [16] * n, [1] * n))
    clock.t += ms * MS
    acc.on_step_done(key, ms * MS, "perf_counter")


def tick(engine_meter: EngineMeter, clock: Clock, ms: int) -> None:
    clock.t += ms * MS
    engine_meter.tick()


def finished(engine_meter: EngineMeter, rid: str) -> None:
    engine_meter.hold(0, SimpleNamespace(request_id=rid))


@pytest.mark.parametrize("sparse", [False, True])
def test_requests_get_the_meters_energy_split_by_the_model(sparse: bool) -> None:
    acc, em, meter, clock, sent = make(sparse=sparse)
    for k in range(21):  # ends at 147 ms, between two counter updates
        step(acc, clock, k, ["a", "b"] if k < 10 else ["b"], 7)
        if k == 9:
            finished(em, "a")
        em.tick()  # the engine is idle between these steps: the thread settles
    finished(em, "b")
    assert acc.unsettled("b")
    tick(em, clock, 15)  # the next counter update covers the last step
    assert sorted(h.request_id for _, outs in sent for h in outs) == ["a", "b"]
    # The records went out with the outputs (put_outputs) in the server; here read them.
    assert acc.total_joules + acc.counts().idle_joules == pytest.approx(meter.value(), rel=1e-9)
    assert acc.counts().fitted_joules == 0 and acc.counts().fallback_steps == 0
    ratio = acc.total_joules / acc.counts().predicted_joules
    assert ratio != pytest.approx(1.0, abs=0.05)  # 120 W is not what the CPU prior says
    assert acc.splitter.ratios()[0] > 0


@pytest.mark.parametrize("sparse", [False, True])
def test_an_aborted_request_s_unsettled_steps_are_unsent_measured_energy(sparse: bool) -> None:
    acc, em, meter, clock, sent = make(sparse=sparse)
    step(acc, clock, 1, ["a", "b"], 8)
    acc.release("b")  # aborted while its step waits for the meter
    step(acc, clock, 2, ["a"], 8)
    finished(em, "a")
    tick(em, clock, 20)
    assert sent and acc.unsent_joules > 0
    a = sent[0][1][0]
    assert a.request_id == "a"
    joules = acc.record("a").joules  # not yet released: the record is its measured total
    assert joules + acc.unsent_joules == pytest.approx(acc.total_joules, rel=1e-9)
    assert acc.record("a").predicted_joules > 0 and acc.record("a").source == "measured"


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("trouble", ["fail", "stall", "reset"])
def test_a_meter_in_trouble_falls_back_to_the_fit_labelled_and_counted(trouble: str,
                                                                      sparse: bool) -> None:
    acc, em, meter, clock, sent = make(sparse=sparse)
    for k in range(20):  # history for the fit
        step(acc, clock, k, ["a"], 7)
        em.tick()
    tick(em, clock, 20)
    measured_before = acc.total_joules
    if trouble == "fail":
        meter.fail = True
    elif trouble == "stall":
        meter.stall = True
        em.stall_s = 0.05
    else:
        meter.offset = 1e6  # the counter falls back
    em.tick()  # the trouble starts before the step
    step(acc, clock, 100, ["z"], 7)
    finished(em, "z")
    for _ in range(10):
        tick(em, clock, 10)
    assert [o.request_id for _, outs in sent for o in outs][-1] == "z"
    assert acc.counts().fallback_steps >= 1 and acc.counts().fitted_joules > 0
    record = acc.record("z")
    assert record.source == "fitted" and record.unmeasured_joules > 0
    ratio = acc.splitter.ratios()
    assert math.isfinite(ratio[0]) and acc.total_joules > measured_before


@pytest.mark.parametrize("sparse", [False, True])
def test_an_estimated_part_of_the_readings_is_that_part_of_each_step_unmeasured(
        sparse: bool) -> None:
    """A quarter of every rise estimated from some point on: the requests whose steps ran
    after it say `fitted`, with a quarter of their predicted joules unmeasured; their energy
    is still the meter's (no step falls back to the fit); those wholly before stay measured."""
    acc, em, meter, clock, sent = make(sparse=sparse)
    for k in range(10):
        step(acc, clock, k, ["a", "b"], 7)
        em.tick()
    finished(em, "a")
    tick(em, clock, 20)
    before = acc.total_joules  # every step so far settled, by readings wholly measured
    meter.estimated, meter.estimated_from = 0.25, meter.value()
    for k in range(10, 20):
        step(acc, clock, k, ["b", "c"], 7)
        em.tick()
    finished(em, "b")
    finished(em, "c")
    tick(em, clock, 20)
    assert sorted(o.request_id for _, outs in sent for o in outs) == ["a", "b", "c"]
    a, b, c = (acc.record(r) for r in "abc")
    assert a.source == "measured" and a.unmeasured_joules == 0.0
    assert b.source == c.source == "fitted"
    assert c.unmeasured_joules == pytest.approx(0.25 * c.predicted_joules, rel=1e-9)
    assert 0.0 < b.unmeasured_joules < 0.25 * b.predicted_joules  # its first steps measured
    counts = acc.counts()
    assert counts.fallback_steps == 0 and counts.fitted_joules == 0.0
    assert acc.total_joules + counts.idle_joules == pytest.approx(meter.value(), rel=1e-9)
    # A quarter of the meter's energy since the switch, steps and idle alike.
    assert counts.estimated_joules == pytest.approx(
        0.25 * (meter.value() - meter.estimated_from), rel=1e-9)
    assert acc.total_joules > before


@pytest.mark.parametrize("sparse", [False, True])
def test_a_hold_past_its_bound_settles_by_the_fit(sparse: bool) -> None:
    acc, em, meter, clock, sent = make(sparse=sparse)
    meter.period = 10_000 * MS  # a meter far slower than it said
    step(acc, clock, 1, ["a"], 5)
    finished(em, "a")
    clock.t += int((em.hold_s + 0.01) * 1e9)
    with acc.lock:
        ready = em.settle_in_loop()
    assert [h.output.request_id for h in ready] == ["a"] and acc.counts().fallback_steps == 1


def test_a_long_step_after_a_finished_request_is_not_the_meter_s_delay() -> None:
    """The reading after a finished request's last step is taken while the next step runs,
    and can be split only when that step ends: a step longer than the hold limit delays the
    release without settling anything by the fit."""
    acc, em, meter, clock, sent = make()
    for k in range(5):
        step(acc, clock, k, ["a", "b"], 5)
        em.tick()
    finished(em, "a")
    long_ms = int(3 * em.hold_s * 1e3) // 10 * 10 + 5  # ends between two counter updates
    acc.on_schedule(99, ["b"], StepBatch.from_lists([0], [1], [16], [1]))
    for _ in range(long_ms // 10):  # the meter thread reads while the step runs
        tick(em, clock, 10)
    assert not sent  # nothing settles while the step that holds the reading runs
    clock.t += 5 * MS
    acc.on_step_done(99, long_ms * MS, "perf_counter")
    with acc.lock:
        ready = em.settle_in_loop()
    assert [h.output.request_id for h in ready] == ["a"]
    assert acc.record("a").source == "measured"
    # The long step itself waits for the next reading, not for the fit.
    counts = acc.counts()
    assert counts.fallback_steps == 0 and counts.fitted_joules == 0 and acc.unsettled("b")
    tick(em, clock, 10)
    assert not acc.unsettled("b") and acc.counts().fallback_steps == 0


def test_prediction_mode_without_a_meter() -> None:
    clock = Clock()
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior, clock_ns=clock)

    def no_meter() -> Meter:
        raise MeterError("no meter measures this machine's energy")

    em = EngineMeter(acc, no_meter, "auto", lambda: None, clock=clock)
    assert not em.open() and acc.splitter is None
    step(acc, clock, 1, ["a"], 5)
    assert acc.record("a").source == "prior" and acc.record("a").joules > 0


def test_the_splitter_is_the_accountants() -> None:
    acc, em, *_ = make()
    assert isinstance(acc.splitter, IntervalSplitter) and acc.settler.meter_name == "nvml"


def test_a_mig_instance_stays_in_prediction_mode_with_one_line(caplog) -> None:
    """NVML reads the whole GPU behind a MIG instance: other tenants' energy is not ours."""
    clock = Clock()
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior, clock_ns=clock)

    class MigMeter(CounterMeter):
        def devices(self):
            return [Device("gpu0", "gpu", "cuda:0 = GPU-1: whole GPU (MIG instance MIG-a "
                           "share it; NVML reads no per-instance energy)")]

    em = EngineMeter(acc, lambda: MigMeter(clock), "nvml", lambda: 10.0, clock=clock)
    with caplog.at_level("WARNING", logger="vllm.plugins.piep"):
        assert not em.open()
    assert acc.splitter is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "MIG" in line and "prediction" in line


def test_auto_on_a_gpu_instance_meters_its_gpus_only(monkeypatch) -> None:
    from vllm_piep.meters import auto, factory

    monkeypatch.setattr(auto, "_nvml_available", lambda: False)
    make, label = factory.meter_factory("auto", cuda_devices=2, measuring_only=True)
    with pytest.raises(MeterError, match="instance's GPUs"):
        make()


def _nvml_engine(monkeypatch, gpus, setting: str = "auto", ordinals=(0,), environ=None):
    """An engine meter built as the engine core builds it: `meters.factory` over a stand-in
    NVML of these GPUs at the `pynvml` seam."""
    import sys
    import types

    from support.fake_pynvml import FakeNvml

    from vllm_piep.meters.factory import meter_factory

    nvml = FakeNvml(gpus)
    module = types.ModuleType("pynvml")
    module.__getattr__ = lambda name: getattr(nvml, name)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    for key, value in (environ or {"CUDA_VISIBLE_DEVICES": None}).items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    acc = EngineAccountant(lambda: prior)
    factory, label = meter_factory(setting, list(ordinals), measuring_only=True)
    return acc, EngineMeter(acc, factory, label, lambda: 10.0)


def test_other_processes_on_the_metered_gpus_are_said(monkeypatch, caplog) -> None:
    """NVML reads whole boards: another instance's process on a metered GPU puts its energy in
    the meter's. The engine says so once, and every header (so /metrics and responses) carries
    how many; its own process and children are not others."""
    import os

    from support.fake_pynvml import FakeGpu

    from vllm_piep.runtime.record import WireRecord

    gpu = FakeGpu(update_period_s=0.005, processes=[os.getpid(), 999_999])
    acc, em = _nvml_engine(monkeypatch, [gpu])
    with caplog.at_level("WARNING", logger="vllm.plugins.piep"):
        assert em.open()
    assert acc.meter_shared == 1
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "999999" in line and "meter_shared" in line
    step(acc, Clock(), 1, ["a"], 5)
    header = acc.header(counts=False)
    assert header.meter_shared == 1
    assert WireRecord.from_wire(header, acc.encode(["a"])).meter_shared == 1
    gpu.processes = [os.getpid()]  # the other instance stopped: the next look says so
    em._look_for_others(0)
    assert acc.meter_shared == 0
    gpu.processes = [4242]  # none of ours listed, another's is: another PID namespace
    em._look_for_others(0)
    assert acc.meter_shared == -1
    em.meter.stop()


@pytest.mark.parametrize(("gpus", "environ", "ordinals", "cause"), [
    (1, {"CUDA_VISIBLE_DEVICES": "0,1"}, (2, 3), "CUDA device 2 is not visible"),
    (2, {"CUDA_VISIBLE_DEVICES": "GPU-deadbeef"}, (0,), "UUID starting with 'GPU-deadbeef'"),
    ("mig", {"CUDA_VISIBLE_DEVICES": None}, (0, 1), "MIG"),
])
def test_gpus_the_meter_cannot_find_leave_prediction_mode_in_one_line(
        monkeypatch, caplog, gpus, environ, ordinals, cause) -> None:
    from support.fake_pynvml import FakeGpu

    if gpus == "mig":  # one GPU in MIG mode beside one that is not
        fleet = [FakeGpu(mig_uuids=["MIG-aaaa"]), FakeGpu()]
    else:
        fleet = [FakeGpu() for _ in range(gpus)]
    acc, em = _nvml_engine(monkeypatch, fleet, ordinals=ordinals, environ=environ)
    with caplog.at_level("WARNING", logger="vllm.plugins.piep"):
        assert not em.open()
    assert acc.splitter is None and cause in (acc.meter_note or "") + " ".join(
        r.getMessage() for r in caplog.records)
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "\n" not in line and "prediction" in line
    assert acc.header(counts=False).meter is None
    assert acc.header(counts=False).meter_note == acc.meter_note
