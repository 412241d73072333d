"""Prometheus counters the API server exports on /metrics.

Names do not start with `vllm:` (vLLM unregisters those). Counters are created on first use,
after vLLM has chosen between the default and the multiprocess registry (PROMETHEUS_MULTIPROC_DIR
must be set before a metric is created for the multiprocess mode to see it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from vllm_piep.model.components import COMPONENTS
from vllm_piep.runtime.worker.steptime import STEP_TIMERS

# Where a request's energy ended up: its response (finished), an abort, energy after its
# response was complete (outputs that arrived after the API server had finished or aborted it;
# with async scheduling, the step a request that stopped was already scheduled into), steps the
# engine ran for it that no output carried (aborted between two outputs), or a request some
# step of which failed to predict (its other steps). Their sum is the engine's predicted total.
OUTCOMES = ("finished", "aborted", "after_finish", "unsent", "incomplete")
STATE_PLACES = ("engine", "api_open", "api_closed", "api_recent")

if TYPE_CHECKING:
    from vllm_piep.runtime.record import WireRecord


class EnergyMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.joules = Counter(
            "piep_energy_joules", "Energy of finished or aborted requests (J), by source "
            "(prior or calibrated)", ["source"], registry=registry)
        self.component_joules = Counter(
            "piep_energy_component_joules", "Energy of finished or aborted requests (J) by "
            "module or communication type", ["component", "source"], registry=registry)
        self.phase_joules = Counter(
            "piep_energy_phase_joules", "Energy of finished or aborted requests (J) by phase",
            ["phase", "source"], registry=registry)
        self.requests = Counter(
            "piep_requests_attributed", "Requests that received an energy attribution",
            ["source"], registry=registry)
        self.unattributed = Counter(
            "piep_requests_unattributed", "Requests left without energy because a step of "
            "theirs could not be predicted", registry=registry)
        self.predictor_errors = Counter(
            "piep_predictor_errors", "Engine steps whose energy prediction failed",
            registry=registry)
        self.outcome_joules = Counter(
            "piep_request_outcome_joules", "Energy of requests (J) by where it was accounted: "
            "finished (in a response), aborted, after_finish (after the request's response "
            "was complete: later outputs, or the step async scheduling had already scheduled "
            "it into), unsent (engine steps no output carried), incomplete (requests a step of "
            "which could not be predicted)",
            ["outcome"], registry=registry)
        self.gco2e = Counter(
            "piep_energy_gco2e", "Emissions of finished or aborted requests (gCO2e) at the "
            "configured grid intensity", registry=registry)
        self.tracked = Gauge(
            "piep_tracked_requests", "Requests the plugin holds state for, by place (engine: "
            "as of its last step; api_recent: finished requests kept a few seconds for late "
            "outputs)", ["where"], registry=registry)
        for outcome in OUTCOMES:  # exported from the start, so sums over labels are complete
            self.outcome_joules.labels(outcome)
        self.engine_joules = Counter(
            "piep_engine_step_joules", "Sum of predicted engine-step energies (J); equals the "
            "sum over requests once they have all finished", registry=registry)
        self.steps = Counter(
            "piep_engine_steps", "Engine steps accounted, by where their time came from: "
            "cuda_event (CUDA events in the worker), perf_counter (the worker's host clock, "
            "CPU), engine_clock (no worker time arrived: the engine's wall clock, a fallback)",
            ["step_time"], registry=registry)
        for timer in STEP_TIMERS:
            self.steps.labels(timer)

    def count_request(self, record: WireRecord, outcome: str = "finished",
                      gco2e: float | None = None) -> None:
        if not record.complete:  # no figure for it, but its predicted steps still count
            self.unattributed.inc()
            self.count_energy(record.source, "incomplete", record.components,
                              record.prefill_joules, record.decode_joules)
            return
        self.requests.labels(record.source).inc()
        self.count_energy(record.source, outcome, record.components, record.prefill_joules,
                          record.decode_joules)
        if gco2e:
            self.gco2e.inc(gco2e)

    def count_energy(self, source: str, outcome: str, components: tuple[float, ...] | None,
                     prefill: float, decode: float) -> None:
        """Energy of a request or a part of it (components None: only the total is known)."""
        total = prefill + decode
        if total <= 0:
            return
        self.joules.labels(source).inc(total)
        self.outcome_joules.labels(outcome).inc(total)
        if components is not None:
            for name, value in zip(COMPONENTS, components, strict=True):
                if value > 0:
                    self.component_joules.labels(name, source).inc(value)
        if prefill > 0:
            self.phase_joules.labels("prefill", source).inc(prefill)
        if decode > 0:
            self.phase_joules.labels("decode", source).inc(decode)

    def count_total(self, source: str, outcome: str, joules: float) -> None:
        """Energy the engine counted without an output to carry it (`unsent`: steps of
        aborted requests; `after_finish`: steps that ran after a request's final output): only
        the total is known (not in the component and phase counters)."""
        if joules > 0:
            self.joules.labels(source).inc(joules)
            self.outcome_joules.labels(outcome).inc(joules)

    def count_steps(self, timer: str, steps: int) -> None:
        self.steps.labels(timer).inc(steps)

    def count_engine(self, joules: float, errors: int) -> None:
        if joules > 0:
            self.engine_joules.inc(joules)
        if errors > 0:
            self.predictor_errors.inc(errors)
