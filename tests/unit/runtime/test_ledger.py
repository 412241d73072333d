"""The API-side ledger: latest record wins, close counts once, take aggregates, state bounded."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from vllm_piep.model.components import COMPONENTS, N_COMPONENTS
from vllm_piep.runtime.api_server.ledger import EnergyLedger, usage_energy
from vllm_piep.runtime.api_server.metrics import EnergyMetrics
from vllm_piep.runtime.record import ROW_BYTES, StepHeader, WireRecord, is_rows


def header(engine_total: float = 0.0, errors: int = 0, ok: bool = True) -> StepHeader:
    return StepHeader.decode(StepHeader("prior", "prior/x", "0", engine_total, errors,
                                        ok).encode())


def row(joules: float, complete: bool = True) -> bytes:
    comps = tuple(joules / N_COMPONENTS for _ in range(N_COMPONENTS))
    return WireRecord("prior", "prior/x", complete, joules * 0.25, joules * 0.75,
                      comps).to_wire()


def update(ledger: EnergyLedger, internal: str, external: str, joules: float,
           engine_total: float = 0.0, errors: int = 0, complete: bool = True) -> None:
    h = ledger.observe_header(StepHeader("prior", "prior/x", "0", engine_total, errors,
                                         True).encode())
    assert h is not None
    ledger.update(internal, external, h, row(joules, complete))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_latest_record_is_counted_once_on_close(registry: CollectorRegistry) -> None:
    ledger = EnergyLedger(EnergyMetrics(registry))
    update(ledger, "int-1", "ext-1", 1.0, engine_total=1.0)
    update(ledger, "int-1", "ext-1", 3.0, engine_total=3.0)
    assert sample(registry, "piep_energy_joules_total", source="prior") == 0
    ledger.close("int-1")
    ledger.close("int-1")  # a second close (abort after finish) changes nothing
    assert sample(registry, "piep_energy_joules_total", source="prior") == pytest.approx(3.0)
    assert sample(registry, "piep_requests_attributed_total", source="prior") == 1
    assert sample(registry, "piep_engine_step_joules_total") == pytest.approx(3.0)
    for name in COMPONENTS:
        assert sample(registry, "piep_energy_component_joules_total", component=name,
                      source="prior") == pytest.approx(3.0 / N_COMPONENTS)
    [record] = ledger.take(["ext-1"])
    assert record.joules == pytest.approx(3.0)
    assert ledger.take(["ext-1"]) == []
    assert ledger.size == (0, 0)


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
    update(ledger, "a", "ext", 1.0, engine_total=1.0, errors=2, complete=False)
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


def test_engine_totals_are_exported_as_deltas(registry: CollectorRegistry) -> None:
    ledger = EnergyLedger(EnergyMetrics(registry))
    update(ledger, "a", "x", 1.0, engine_total=5.0, errors=1)
    update(ledger, "b", "y", 1.0, engine_total=4.0, errors=1)  # an older header, arriving late
    update(ledger, "a", "x", 2.0, engine_total=9.0, errors=3)
    assert sample(registry, "piep_engine_step_joules_total") == pytest.approx(9.0)
    assert sample(registry, "piep_predictor_errors_total") == 3


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
    update(ledger, "a", "ext", 2.0, engine_total=2.0, errors=1, complete=False)
    ledger.close("a")
    assert sample(registry, "piep_requests_unattributed_total") == 1
    assert sample(registry, "piep_request_outcome_joules_total",
                  outcome="incomplete") == pytest.approx(2.0)
    assert sample(registry, "piep_energy_joules_total", source="prior") == pytest.approx(
        sample(registry, "piep_engine_step_joules_total"))


def test_unclaimed_closed_records_expire() -> None:
    clock = [0.0]
    registry = CollectorRegistry()
    ledger = EnergyLedger(EnergyMetrics(registry), clock=lambda: clock[0])
    update(ledger, "a", "ext", 1.0)
    ledger.close("a")
    assert sample(registry, "piep_tracked_requests", where="api_closed") == 1
    clock[0] = 121.0
    assert sample(registry, "piep_tracked_requests", where="api_closed") == 0
