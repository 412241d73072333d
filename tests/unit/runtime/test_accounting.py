"""Engine-side accounting without vLLM: running totals, conservation, failures, bounded state."""

from __future__ import annotations

import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_piep.model.components import N_COMPONENTS
from vllm_piep.model.devices import DeviceProfile, cpu_spec
from vllm_piep.model.flops import ModelShape, StepBatch
from vllm_piep.predict.base import StepEnergy, StepInput
from vllm_piep.predict.prior import PriorPredictor
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.record import ROW_BYTES, StepHeader, WireRecord

SHAPE = ModelShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                   vocab=2048, dtype_bytes=4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def make(clock: FakeClock, predictor=None) -> EngineAccountant:
    prior = PriorPredictor(SHAPE, DeviceProfile.from_spec(cpu_spec(cores=2), 4))
    return EngineAccountant(lambda: predictor or prior, clock_ns=clock)


def run_step(acc: EngineAccountant, clock: FakeClock, key: int, ids: list[str],
             batch: StepBatch, ns: int) -> None:
    acc.on_schedule(key, ids, batch)
    clock.now += ns
    acc.on_step_done(key)


def test_running_totals_conserve_engine_energy() -> None:
    clock = FakeClock()
    acc = make(clock)
    run_step(acc, clock, 1, ["a", "b"], StepBatch.from_lists([30, 5], [0, 0], [0, 0], [1, 1]),
             5_000_000)
    run_step(acc, clock, 2, ["a", "b", "c"],
             StepBatch.from_lists([0, 0, 64], [1, 1, 0], [30, 5, 0], [1, 1, 0]), 3_000_000)
    records = {r: acc.record(r) for r in "abc"}
    assert math.fsum(rec.joules for rec in records.values()) == pytest.approx(
        acc.total_joules, rel=1e-12)
    for rec in records.values():
        assert rec.complete and rec.prefill_joules + rec.decode_joules == pytest.approx(rec.joules)
    assert records["a"].decode_joules > 0 and records["c"].decode_joules == 0
    # Static power of the CPU profile over the 8 ms of the two steps.
    static = sum(r.components[-1] for r in records.values())
    assert static == pytest.approx(acc.predictor.profile.static_watts * 0.008)


def test_overlapping_steps_do_not_double_count_time() -> None:
    clock = FakeClock()
    acc = make(clock)
    batch = StepBatch.from_lists([0], [1], [10], [1])
    acc.on_schedule(1, ["a"], batch)
    clock.now += 1_000_000
    acc.on_schedule(2, ["a"], batch)  # async scheduling: step 2 scheduled before 1 finishes
    clock.now += 1_000_000
    acc.on_step_done(1)
    clock.now += 1_000_000
    acc.on_step_done(2)
    static = acc.record("a").components[-1]
    assert static == pytest.approx(acc.predictor.profile.static_watts * 0.003)


def test_wire_format_roundtrip_and_rejects_garbage() -> None:
    header = StepHeader("prior", "prior/x", "0", 1.5, 2, True)
    assert StepHeader.decode(header.encode()) == header
    rec = WireRecord("prior", "prior/x", True, 0.1, 0.2, tuple(map(float, range(N_COMPONENTS))))
    assert WireRecord.from_wire(header, rec.to_wire()) == rec
    with pytest.raises(ValueError):
        StepHeader.decode([99, "x"])


def test_encoded_rows_follow_the_requests() -> None:
    clock = FakeClock()
    acc = make(clock)
    run_step(acc, clock, 1, ["a", "b"], StepBatch.from_lists([10, 90], [0, 0], [0, 0], [1, 1]),
             1_000_000)
    block = acc.encode(["b", "unknown", "a"])
    rows = [block[i:i + ROW_BYTES] for i in range(0, len(block), ROW_BYTES)]
    decoded = [WireRecord.from_wire(acc.header(), r) for r in rows]
    assert decoded[0].joules > decoded[2].joules > 0  # b did more work than a
    assert decoded[1].joules == 0 and decoded[1].complete  # nothing scheduled yet


def test_energy_no_output_carried_is_counted_as_unsent() -> None:
    clock = FakeClock()
    acc = make(clock)
    batch = StepBatch.from_lists([10, 20], [0, 0], [0, 0], [1, 1])
    run_step(acc, clock, 1, ["a", "b"], batch, 1_000_000)
    acc.encode(["a", "b"])  # an output carried both totals
    sent_a = acc.record("a").joules
    run_step(acc, clock, 2, ["a", "b"], StepBatch.from_lists([0, 0], [1, 1], [10, 20], [1, 1]),
             1_000_000)
    late_a, total_b = acc.record("a").joules - sent_a, acc.record("b").joules
    acc.encode(["b"])  # b's final output; a is aborted before its next one
    acc.release("b")
    acc.release("a")
    assert acc.unsent_joules == pytest.approx(late_a, rel=1e-12) and late_a > 0
    assert acc.tracked_requests == 0
    assert sent_a + late_a + total_b == pytest.approx(acc.total_joules, rel=1e-12)


class Raising:
    source = "prior"
    bundle_id = "test/raising"

    def predict_step(self, step: StepInput) -> StepEnergy:
        raise RuntimeError("boom")


def test_failing_predictor_marks_requests_incomplete_and_logs_once(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    acc = make(clock, Raising())
    batch = StepBatch.from_lists([3], [0], [0], [1])
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        for key in range(5):
            run_step(acc, clock, key, ["a"], batch, 1000)
    assert acc.errors == 5
    assert not acc.record("a").complete
    assert len([r for r in caplog.records if "predicting a step" in r.getMessage()]) == 1


def test_predictor_that_cannot_load_is_reported() -> None:
    def broken():
        raise ImportError("no such bundle")

    acc = EngineAccountant(broken, clock_ns=FakeClock())
    for key in (1, 2):  # piep_predictor_errors_total counts steps: each one fails
        acc.on_schedule(key, ["a"], StepBatch.from_lists([3], [0], [0], [1]))
        acc.on_step_done(key)
    assert acc.errors == 2 and not acc.record("a").complete


def test_state_is_released_and_bounded() -> None:
    clock = FakeClock()
    acc = make(clock)
    batch = StepBatch.from_lists([1], [0], [0], [1])
    for i in range(200):
        run_step(acc, clock, i, [f"r{i}"], batch, 100)
        if i % 2 == 0:
            acc.release(f"r{i}")
    assert acc.tracked_requests == 100
    acc.sweep(live=[f"r{i}" for i in range(190, 200)])
    assert acc.tracked_requests == 5
    for i in range(100):  # scheduled steps that never complete do not accumulate
        acc.on_schedule(10_000 + i, ["x"], batch)
    assert acc.steps_in_flight() <= 64
    assert all(min(acc.table.rows[slot]) >= 0 for slot in acc.table.slots.values())


def test_worker_step_time_is_preferred_over_the_engine_clock() -> None:
    clock = FakeClock()
    acc = make(clock)
    acc.on_schedule(1, ["a"], StepBatch.from_lists([0], [1], [10], [1]))
    clock.now += 9_000_000  # the engine saw 9 ms (API server busy, say)...
    acc.on_step_done(1, worker_step_ns=2_000_000)  # ...the model ran for 2 ms
    static = acc.record("a").components[-1]
    assert static == pytest.approx(acc.predictor.profile.static_watts * 0.002)


def test_a_step_of_no_measured_time_is_priced_as_its_work_and_counted_on_metrics() -> None:
    from prometheus_client import CollectorRegistry

    from vllm_piep.model.devices import GPU_SPECS
    from vllm_piep.runtime.api_server.ledger import EnergyLedger
    from vllm_piep.runtime.api_server.metrics import EnergyMetrics

    clock = FakeClock()
    gpu = PriorPredictor(SHAPE, DeviceProfile.from_spec(GPU_SPECS["h100-sxm5-80gb"], 4))
    acc = make(clock, gpu)
    batch = StepBatch.from_lists([0, 0], [1, 1], [10, 30], [1, 1])
    acc.on_schedule(1, ["a", "b"], batch)
    acc.on_step_done(1, worker_step_ns=0)
    acc.on_schedule(2, ["a", "b"], batch)
    acc.on_step_done(2, worker_step_ns=3_000_000)
    work_alone = gpu.predict_step(StepInput(batch, 0.0)).joules
    with_time = gpu.predict_step(StepInput(batch, 0.003)).joules
    assert work_alone.sum() < with_time.sum()
    assert acc.total_joules == pytest.approx(work_alone.sum() + with_time.sum(), rel=1e-9)
    assert acc.counts().zero_time_steps == 1
    header = acc.header()
    assert header.zero_time_steps == 1 and acc.header().zero_time_steps == 0  # once
    registry = CollectorRegistry()
    EnergyLedger(EnergyMetrics(registry)).observe_header(header.encode())
    assert registry.get_sample_value("piep_engine_zero_time_steps_total") == 1


def test_a_request_aborted_while_its_step_runs_is_not_tracked_again() -> None:
    """vLLM processes aborts between a step's execution and its update: the step still names
    the request; its share is unsent energy and its state is freed."""
    clock = FakeClock()
    acc = make(clock)
    run_step(acc, clock, 1, ["a", "b"], StepBatch.from_lists([10, 20], [0, 0], [0, 0], [1, 1]),
             1_000_000)
    acc.encode(["a", "b"])
    acc.on_schedule(2, ["a", "b"], StepBatch.from_lists([0, 0], [1, 1], [10, 20], [1, 1]))
    acc.release("a")  # the abort
    acc.on_step_done(2, 1_000_000)
    assert acc.tracked_requests == 1 and acc.unsent_joules > 0
    acc.encode(["b"])
    acc.release("b")
    carried = acc.total_joules - acc.unsent_joules
    assert acc.tracked_requests == 0 and carried > 0


def test_a_finished_request_a_scheduled_step_still_names_is_freed() -> None:
    """Async scheduling: step N+1 is scheduled before step N's update finishes a request."""
    clock = FakeClock()
    acc = make(clock)
    batch = StepBatch.from_lists([0], [1], [10], [1])
    run_step(acc, clock, 1, ["a"], batch, 1_000_000)
    acc.on_schedule(2, ["a"], batch)  # scheduled ahead
    acc.encode(["a"])
    acc.release("a", aborted=False)  # its final output went with step 1
    acc.on_step_done(2, 1_000_000)  # the step async scheduling had already scheduled
    assert acc.tracked_requests == 0
    # That step's share belongs to the finished request, after its response: not unsent.
    assert acc.after_finish_joules > 0 and acc.unsent_joules == 0
    assert acc.total_joules == pytest.approx(2 * acc.after_finish_joules, rel=1e-12)


def test_vllms_finished_ids_release_only_the_requests_aborted_from_outside() -> None:
    """A scheduler output names every request finished since the step before
    (`finished_req_ids`): those released with their final output, those whose output waits for
    the meter (measured mode) and those aborted from outside. Only the last are released here,
    as aborted; the others keep what their release said."""
    clock = FakeClock()
    acc = make(clock)
    run_step(acc, clock, 1, ["a", "b", "c", "d"],
             StepBatch.from_lists([10, 10, 10, 10], [0] * 4, [0] * 4, [1] * 4), 1_000_000)
    batch = StepBatch.from_lists([0] * 4, [1] * 4, [10] * 4, [1] * 4)
    acc.on_schedule(2, ["a", "b", "c", "d"], batch)  # async: the next step already scheduled
    carried = acc.record("a").joules
    acc.encode(["a"])
    acc.release("a", aborted=False)  # its final output went out with step 1
    acc.waiting.add("c")  # its final output waits for the meter
    acc.release_finished({"a", "b", "c"})  # b: aborted while step 1 ran
    assert set(acc.table.slots) == {"c", "d"}
    assert not acc.book.gone["a"].aborted and acc.book.gone["b"].aborted
    assert acc.unsent_joules > 0 and acc.after_finish_joules == 0
    clock.now += 1_000_000
    acc.on_step_done(2)  # a's share is after-finish, b's unsent: neither tracked again
    assert set(acc.table.slots) == {"c", "d"} and acc.after_finish_joules > 0
    rows = math.fsum(acc.record(r).joules for r in "cd")
    assert carried + rows + acc.unsent_joules + acc.after_finish_joules == pytest.approx(
        acc.total_joules, rel=1e-12)
    acc.release_finished(set())  # what `finished` held is forgotten at each step
    assert acc.finished == set()


def test_each_count_goes_out_once_to_one_client() -> None:
    """Several API servers sum their /metrics: an increment sent twice would count twice."""
    clock = FakeClock()
    acc = make(clock)
    run_step(acc, clock, 1, ["a"], StepBatch.from_lists([10], [0], [0], [1]), 1_000_000)
    other = acc.header(counts=False)  # another client's header in the same batch
    assert (other.step_joules, other.unsent_joules, other.tracked) == (0.0, 0.0, 0)
    assert not other.carries_counts and acc.unreported()
    first = acc.header()
    assert first.carries_counts and first.step_joules == pytest.approx(acc.total_joules)
    assert first.steps_by_timer == (0, 0, 1) and first.tracked == 1
    assert not acc.unreported()
    again = acc.header()  # nothing new: zeros, but the state (tracked) is current
    assert (again.step_joules, again.steps_by_timer, again.tracked) == (0.0, (0, 0, 0), 1)
    run_step(acc, clock, 2, ["a"], StepBatch.from_lists([0], [1], [10], [1]), 1_000_000)
    acc.encode(["a"])
    acc.release("a")
    later = acc.header()
    assert later.step_joules == pytest.approx(acc.total_joules - first.step_joules, rel=1e-12)
    assert later.tracked == 0 and other.source == later.source


def test_requests_aborted_with_energy_no_output_carried_go_out_with_the_counts() -> None:
    """`RequestTable.close` keeps the rows of requests aborted from outside whose energy no
    output carried, for the billing ledger; the next header with counts takes them, once."""
    from vllm_piep.runtime.engine_core.request_table import MAX_ABORTED_ROWS, RequestTable
    from vllm_piep.runtime.record import COLUMN, ROW_BYTES, decode_row

    table = RequestTable()
    for name, joules in (("a", 2.0), ("b", 3.0), ("done", 4.0), ("empty", 0.0)):
        slot = table.slot(name)
        table.rows[slot][COLUMN["decode"]] = joules
    table.close("a", aborted=True, no_output=True)
    table.close("done", aborted=False, no_output=False)  # finished: after-finish, not listed
    table.close("empty", aborted=True, no_output=True)  # no energy: nothing to book
    table.close("b", aborted=True, no_output=False)  # unsent
    ids, blob = table.take_aborted()
    assert ids == ("a", "b") and len(blob) == 2 * ROW_BYTES
    assert [float(decode_row(blob[i * ROW_BYTES:(i + 1) * ROW_BYTES])["decode"])
            for i in range(2)] == [2.0, 3.0]
    assert table.outcomes.aborted == 2.0 and table.outcomes.unsent == 3.0
    assert table.take_aborted() == ((), b"")
    for i in range(MAX_ABORTED_ROWS + 5):  # bounded: the rest stay in the totals only
        slot = table.slot(f"r{i}")
        table.rows[slot][COLUMN["decode"]] = 1.0
        table.close(f"r{i}", aborted=True, no_output=True)
    assert len(table.take_aborted()[0]) == MAX_ABORTED_ROWS


@given(st.lists(st.floats(0.0, 1e6), min_size=9, max_size=9),
       st.lists(st.integers(0, 10**9), min_size=4, max_size=4),
       st.integers(0, 10**6), st.booleans())
@settings(max_examples=50, deadline=None)
def test_a_header_with_counts_is_the_plain_header_with_the_counts_put_in(
        joules: list[float], ints: list[int], tracked: int, measured: bool) -> None:
    """`with_counts` changes only the counting fields of the cached header without counts:
    what it makes equals `step_header`'s whole build, field for field, in either mode."""
    from types import SimpleNamespace

    from vllm_piep.runtime.engine_core.engine_counts import Counts, step_header, with_counts

    predictor = SimpleNamespace(source="prior", bundle_id="prior/x", interval=None)
    settler = SimpleNamespace(measured=False)
    if measured:
        settler = SimpleNamespace(measured=True, meter_name="nvml", source="measured",
                                  splitter=SimpleNamespace(ratios=lambda: (1.1, 0.9)))
    delta = Counts(joules[0], ints[0], joules[1], joules[2], joules[3], joules[4], joules[5],
                   joules[6], joules[7], ints[1], ints[2], ints[3], (ints[0], ints[1], 0))
    args = ("0", predictor, settler, "a note", 2)
    plain = step_header(Counts(), False, 0, *args)
    assert with_counts(plain, delta, tracked) == step_header(delta, True, tracked, *args)
