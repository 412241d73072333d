"""The API-side ledger: latest record wins, a record is counted once under its outcome (when its
response takes it, or when nobody does), take aggregates a response's requests, the engine's
increments add up, state stays bounded."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from vllm_piep.ledger.schema import LedgerRow
from vllm_piep.model.components import COMPONENTS, N_COMPONENTS
from vllm_piep.runtime.api_server.ledger import EnergyLedger, usage_energy
from vllm_piep.runtime.api_server.metrics import EnergyMetrics
from vllm_piep.runtime.record import ROW_BYTES, StepHeader, WireRecord, is_rows


def header(step_joules: float = 0.0, errors: int = 0, ok: bool = True) -> StepHeader:
    return StepHeader.decode(StepHeader("prior", "prior/x", "0", step_joules, errors,
                                        ok).encode())


def row(joules: float, complete: bool = True) -> bytes:
    comps = tuple(joules / N_COMPONENTS for _ in range(N_COMPONENTS))
    return WireRecord("prior", "prior/x", complete, joules * 0.25, joules * 0.75,
                      comps).to_wire()


def update(ledger: EnergyLedger, internal: str, owner: str, joules: float,
           step_joules: float = 0.0, errors: int = 0, complete: bool = True) -> None:
    """An output of `internal` (a response known as `owner`), whose batch's header carried
    the engine's increments `step_joules`, `errors`."""
    h = ledger.observe_header(StepHeader("prior", "prior/x", "0", step_joules, errors,
                                         True, carries_counts=True).encode())
    assert h is not None
    ledger.update(internal, owner, h, row(joules, complete))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_latest_record_is_counted_once_when_its_response_takes_it(
        registry: CollectorRegistry) -> None:
    ledger = EnergyLedger(EnergyMetrics(registry))
    update(ledger, "int-1", "ext-1", 1.0, step_joules=1.0)
    update(ledger, "int-1", "ext-1", 3.0, step_joules=2.0)
    assert sample(registry, "piep_energy_joules_total", source="prior") == 0
    ledger.close("int-1")
    ledger.close("int-1")  # a second close (abort after finish) changes nothing
    assert sample(registry, "piep_energy_joules_total", source="prior") == 0  # not yet taken
    [record] = ledger.take(["ext-1"])
    assert record.joules == pytest.approx(3.0)
    assert sample(registry, "piep_energy_joules_total", source="prior") == pytest.approx(3.0)
    assert sample(registry, "piep_requests_attributed_total", source="prior") == 1
    assert sample(registry, "piep_engine_step_joules_total") == pytest.approx(3.0)
    for name in COMPONENTS:
        assert sample(registry, "piep_energy_component_joules_total", component=name,
                      source="prior") == pytest.approx(3.0 / N_COMPONENTS)
    assert ledger.take(["ext-1"]) == []
    assert ledger.size == (0, 0)
    assert sample(registry, "piep_request_outcome_joules_total",
                  outcome="finished") == pytest.approx(3.0)


def test_a_reused_client_id_does_not_mix_responses() -> None:
    """Two requests with the same X-Request-Id are two owners (vLLM's internal ids)."""
    ledger = EnergyLedger()
    update(ledger, "cmpl-same-0-aaaa", "cmpl-same-0-aaaa", 128.0)
    update(ledger, "cmpl-same-0-bbbb", "cmpl-same-0-bbbb", 1.0)
    ledger.close("cmpl-same-0-bbbb")
    [short] = ledger.take(["cmpl-same-0-bbbb"])
    ledger.close("cmpl-same-0-aaaa")
    [long] = ledger.take(["cmpl-same-0-aaaa"])
    assert (short.joules, long.joules) == pytest.approx((1.0, 128.0))


def test_a_response_that_does_not_show_its_energy_counts_it_as_not_returned(
        registry: CollectorRegistry) -> None:
    clock = [0.0]
    ledger = EnergyLedger(EnergyMetrics(registry), claim_s=5.0, clock=lambda: clock[0])
    update(ledger, "s", "s", 2.0)  # a stream without a usage chunk
    ledger.close("s")
    ledger.take(["s"], returned=False)
    update(ledger, "n", "n", 3.0)  # an endpoint that carries no energy: nobody takes it
    ledger.close("n")
    ledger.housekeep()
    assert sample(registry, "piep_tracked_requests", where="api_closed") == 1
    clock[0] = 5.5
    ledger.housekeep()
    assert sample(registry, "piep_request_outcome_joules_total",
                  outcome="not_returned") == pytest.approx(5.0)
    assert sample(registry, "piep_request_outcome_joules_total", outcome="finished") == 0
    assert sample(registry, "piep_tracked_requests", where="api_closed") == 0
    # Attributed: requests whose response carried the figure, neither of these.
    assert sample(registry, "piep_requests_attributed_total", source="prior") == 0


def test_children_of_one_external_request_are_summed() -> None:
    ledger = EnergyLedger()
    for child, joules in (("0_int", 1.0), ("1_int", 2.0), ("2_int", 4.0)):
        update(ledger, child, "ext", joules)
        ledger.close(child)
    energy = usage_energy(ledger.take(["ext"]), completion_tokens=7)
    assert energy is not None
    assert energy.joules == pytest.approx(7.0)
    assert energy.joules_per_output_token == pytest.approx(1.0)
    assert energy.prefill_joules + energy.decode_joules == pytest.approx(7.0)
    assert math.fsum(energy.breakdown.values()) == pytest.approx(energy.joules)


def test_incomplete_or_missing_records_give_no_energy(registry: CollectorRegistry) -> None:
    ledger = EnergyLedger(EnergyMetrics(registry))
    update(ledger, "a", "ext", 1.0, step_joules=1.0, errors=2, complete=False)
    ledger.close("a")
    assert usage_energy(ledger.take(["ext"]), 3) is None
    assert usage_energy([], 3) is None
    assert sample(registry, "piep_requests_unattributed_total") == 1
    assert sample(registry, "piep_predictor_errors_total") == 2
    # malformed input is ignored, never raises
    assert not is_rows(b"garbage") and not is_rows("x" * ROW_BYTES)  # blocks are checked
    assert ledger.observe_header([0, "garbage"]) is None
    assert ledger.size == (0, 0)
    # a header saying the predictor never loaded makes every record incomplete
    ledger.update("c", "ext3", header(ok=False), row(1.0))
    ledger.close("c")
    assert usage_energy(ledger.take(["ext3"]), 1) is None


def test_engine_increments_add_up_and_headers_without_counts_add_nothing(
        registry: CollectorRegistry) -> None:
    ledger = EnergyLedger(EnergyMetrics(registry))
    update(ledger, "a", "x", 1.0, step_joules=5.0, errors=1)
    update(ledger, "b", "y", 1.0, step_joules=4.0, errors=1)
    update(ledger, "a", "x", 2.0, step_joules=0.5, errors=1)
    ledger.observe_header(header().encode())  # another client's header: zeros, no counts
    assert sample(registry, "piep_engine_step_joules_total") == pytest.approx(9.5)
    assert sample(registry, "piep_predictor_errors_total") == 3
    # An engine's tracked requests: its latest report, also when it drops to zero.
    ledger.observe_header(StepHeader("prior", "prior/x", "3", 0.0, 0, True, tracked=4,
                                     carries_counts=True).encode())
    assert sample(registry, "piep_engine_tracked_requests", engine="3") == 4
    ledger.observe_header(StepHeader("prior", "prior/x", "3", 0.0, 0, True, tracked=0,
                                     carries_counts=True).encode())
    assert sample(registry, "piep_engine_tracked_requests", engine="3") == 0


def test_a_sparse_engine_s_aborted_energy_is_counted_as_aborted_with_its_emissions(
        registry: CollectorRegistry) -> None:
    ledger = EnergyLedger(EnergyMetrics(registry))
    ledger.intensity = lambda: 360.0  # gCO2e/kWh: 0.1 mg per J
    ledger.observe_header(StepHeader("prior", "prior/x", "0", 9.0, 0, True, aborted_joules=2.5,
                                     unsent_joules=0.5, carries_counts=True).encode())
    assert sample(registry, "piep_request_outcome_joules_total", outcome="aborted") == 2.5
    assert sample(registry, "piep_request_outcome_joules_total", outcome="unsent") == 0.5
    assert sample(registry, "piep_energy_gco2e_total") == pytest.approx(2.5 * 1e-4)
    assert sample(registry, "piep_energy_joules_total", source="prior") == pytest.approx(3.0)


@pytest.mark.parametrize("carried", [0.0, 1.5], ids=["no-row-before", "row-before"])
def test_a_final_output_after_the_client_left_is_the_aborted_request_s_energy(
        registry: CollectorRegistry, carried: float) -> None:
    """The engine finished the request (every token), but its final output reached the API
    server after vLLM had aborted it for a client gone (measured mode holds that output for
    the meter): the energy it carries is the aborted request's, `aborted` where nothing of it
    was counted at the abort (a sparse engine's rows ride only on final outputs), else
    `unsent`, never `after_finish` (no response was complete); a stop string's late output,
    after a finish, stays `after_finish`."""
    ledger = EnergyLedger(EnergyMetrics(registry))
    rows: list[LedgerRow] = []
    ledger.sink = rows.append
    ledger.note_model("gone", "base")
    if carried:
        update(ledger, "gone", "gone", carried)
    ledger.close("gone", "aborted", output_tokens=1499)
    ledger.late("gone", header(), row(4.0))  # the held final output, with every step
    update(ledger, "stop", "stop", 1.0)
    ledger.close("stop")
    ledger.take(["stop"])
    ledger.late("stop", header(), row(1.25))

    def outcome(name: str) -> float:
        return sample(registry, "piep_request_outcome_joules_total", outcome=name)

    late = "unsent" if carried else "aborted"
    assert outcome("aborted") == pytest.approx(carried or 4.0)
    assert outcome("unsent") == pytest.approx(4.0 - carried if carried else 0.0)
    assert outcome("after_finish") == pytest.approx(0.25)
    assert sample(registry, "piep_model_energy_joules_total", model="base",
                  outcome=late) == pytest.approx(4.0 - carried)
    gone = [(r.outcome, r.joules, r.later) for r in rows if r.internal_id == "gone"]
    assert gone == [("aborted", pytest.approx(carried), False),
                    (late, pytest.approx(4.0 - carried), True)]
    by_outcome: dict[str, float] = {}
    for r in rows:
        by_outcome[r.outcome] = by_outcome.get(r.outcome, 0.0) + r.joules
    assert by_outcome == pytest.approx({o: outcome(o) for o in by_outcome})


def test_unclaimed_records_are_evicted() -> None:
    ledger = EnergyLedger(max_closed=10)
    for i in range(100):
        update(ledger, f"i{i}", f"e{i}", 1.0)
        ledger.close(f"i{i}")
    assert ledger.size == (0, 10)
    assert ledger.take(["e0"]) == [] and len(ledger.take(["e99"])) == 1


def test_zero_completion_tokens_has_no_per_token_figure() -> None:
    energy = usage_energy([WireRecord.from_wire(header(), row(1.0))], completion_tokens=0)
    assert energy is not None and energy.joules_per_output_token is None


def test_interval_and_carbon_follow_the_joules() -> None:
    h = StepHeader("calibrated", "b1", "0", 0.0, 0, True, interval=(0.8, 1.3),
                   interval_level=0.9, interval_coverage=0.91)
    records = [WireRecord.from_wire(StepHeader.decode(h.encode()), row(j)) for j in (1.0, 3.0)]
    energy = usage_energy(records, completion_tokens=4, intensity=360.0)
    assert energy is not None
    assert energy.interval == pytest.approx((0.8 * 4.0, 1.3 * 4.0))
    assert energy.interval_level == 0.9
    assert energy.gco2e == pytest.approx(4.0 / 3.6e6 * 360.0)
    assert "gco2e" not in usage_energy(records, 4).to_usage()  # not configured: not there
    prior = WireRecord.from_wire(header(), row(1.0))
    assert usage_energy([prior], 1).interval is None  # the prior has none


def test_steps_of_an_incomplete_request_are_still_counted(registry: CollectorRegistry) -> None:
    ledger = EnergyLedger(EnergyMetrics(registry))
    update(ledger, "a", "ext", 2.0, step_joules=2.0, errors=1, complete=False)
    ledger.close("a")
    ledger.take(["ext"])
    assert sample(registry, "piep_requests_unattributed_total") == 1
    assert sample(registry, "piep_request_outcome_joules_total",
                  outcome="incomplete") == pytest.approx(2.0)
    assert sample(registry, "piep_energy_joules_total", source="prior") == pytest.approx(
        sample(registry, "piep_engine_step_joules_total"))


def test_tombstones_for_late_outputs_expire() -> None:
    clock = [0.0]
    registry = CollectorRegistry()
    ledger = EnergyLedger(EnergyMetrics(registry), recent_s=10.0, clock=lambda: clock[0])
    update(ledger, "a", "ext", 1.0)
    ledger.close("a")
    ledger.take(["ext"])
    ledger.housekeep()
    assert sample(registry, "piep_tracked_requests", where="api_recent") == 1
    clock[0] = 11.0
    ledger.housekeep()
    assert sample(registry, "piep_tracked_requests", where="api_recent") == 0


@pytest.mark.parametrize("options, reason", [
    ({}, "no measuring meter"), ({"measured": False}, "measured: false"),
    ({"meter": "nvml"}, "")])
def test_an_engine_that_gives_no_reason_gets_the_options_reason(
        registry: CollectorRegistry, options: dict, reason: str) -> None:
    """Prediction mode by default (`meter` unset, no meter that measures here): the engine
    sends no note; the label says why from the options, never an empty reason. A named meter
    that fails sends its own note, which wins."""
    from vllm_piep.config import PiepConfig
    from vllm_piep.runtime.api_server.metrics import unmeasured_reason

    config = PiepConfig.from_sources({"piep": options}, environ={})
    ledger = EnergyLedger(EnergyMetrics(registry, unmeasured_reason=unmeasured_reason(config)))
    ledger.observe_header(StepHeader("prior", "prior/x", "0", 0.0, 0, True).encode())
    assert registry.get_sample_value("piep_engine_measured",
                                     {"engine": "0", "meter": "", "reason": reason}) == 0.0
    ledger.observe_header(StepHeader("prior", "prior/x", "0", 0.0, 0, True,
                                     meter_note="MeterError: no NVML").encode())
    assert registry.get_sample_value(
        "piep_engine_measured", {"engine": "0", "meter": "", "reason": "MeterError: no NVML"}
    ) == 0.0
    ledger.observe_header(StepHeader("measured", "prior/x", "0", 0.0, 0, True,
                                     meter="rapl").encode())
    assert registry.get_sample_value("piep_engine_measured",
                                     {"engine": "0", "meter": "rapl", "reason": ""}) == 1.0


def test_each_engine_says_its_mode_and_why_on_metrics(registry: CollectorRegistry) -> None:
    """piep_engine_measured: one series per engine, the current meter and reason; a shared
    meter's count of others' processes; responses say meter_shared in measured mode."""
    ledger = EnergyLedger(EnergyMetrics(registry))
    note = "8 of the engine's 16 workers run on other nodes"
    ledger.observe_header(StepHeader("prior", "prior/x", "0", 0.0, 0, True,
                                     meter_note=note).encode())
    assert registry.get_sample_value("piep_engine_measured",
                                     {"engine": "0", "meter": "", "reason": note}) == 0.0
    measured = StepHeader("measured", "prior/x", "1", 0.0, 0, True, meter="nvml",
                          meter_shared=2)
    h = ledger.observe_header(measured.encode())
    assert registry.get_sample_value("piep_engine_measured",
                                     {"engine": "1", "meter": "nvml", "reason": ""}) == 1.0
    assert sample(registry, "piep_engine_meter_shared", engine="1") == 2
    # The engine's mode changes: its old series goes, one series per engine stays.
    ledger.observe_header(StepHeader("prior", "prior/x", "1", 0.0, 0, True,
                                     meter_note="RuntimeError: GPU lost").encode())
    series = [s for m in registry.collect() if m.name == "piep_engine_measured"
              for s in m.samples if s.labels["engine"] == "1"]
    assert [(s.labels["reason"], s.value) for s in series] == [("RuntimeError: GPU lost", 0.0)]
    record = WireRecord.from_wire(h, row(2.0))
    usage = usage_energy([record], 4).to_usage()
    assert usage["meter_shared"] is True and usage["meter"] == "nvml"
    unknown = WireRecord.from_wire(measured.replace(meter_shared=-1), row(2.0))
    assert "meter_shared" not in usage_energy([unknown], 4).to_usage()
    assert "meter_shared" not in usage_energy([WireRecord.from_wire(header(), row(1.0))],
                                              4).to_usage()


def test_each_model_s_requests_land_in_their_own_series_summing_to_the_outcome(
        registry: CollectorRegistry) -> None:
    """The base model and a LoRA adapter (`note_model`): finished, not returned, aborted and
    after-finish energy under each, their sum the outcome's; a request with no model noted
    counts only in the outcome."""
    ledger = EnergyLedger(EnergyMetrics(registry))
    for internal, model, joules in (("a", "base", 1.0), ("b", "adapter", 2.0),
                                    ("c", "adapter", 4.0), ("d", "base", 8.0)):
        ledger.note_model(internal, model)
        update(ledger, internal, internal, joules)
    update(ledger, "e", "e", 16.0)  # no model noted
    for internal in ("a", "b", "c", "e"):
        ledger.close(internal)
    ledger.close("d", "aborted")
    ledger.take(["a", "b", "e"])
    ledger.take(["c"], returned=False)
    ledger.late("b", header(), row(2.5))  # 0.5 J after its response
    model = {(m, o): sample(registry, "piep_model_energy_joules_total", model=m, outcome=o)
             for m in ("base", "adapter") for o in ("finished", "not_returned", "aborted",
                                                    "after_finish")}
    assert model[("base", "finished")] == pytest.approx(1.0)
    assert model[("adapter", "finished")] == pytest.approx(2.0)
    assert model[("adapter", "not_returned")] == pytest.approx(4.0)
    assert model[("base", "aborted")] == pytest.approx(8.0)
    assert model[("adapter", "after_finish")] == pytest.approx(0.5)
    for outcome in ("not_returned", "aborted", "after_finish"):
        assert sum(v for (_, o), v in model.items() if o == outcome) == pytest.approx(
            sample(registry, "piep_request_outcome_joules_total", outcome=outcome))
    assert sample(registry, "piep_request_outcome_joules_total", outcome="finished") == \
        pytest.approx(1.0 + 2.0 + 16.0)  # the request without a model: only here
    assert ledger._info == {}  # nothing kept once closed
