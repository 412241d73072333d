"""Prometheus counters the API server exports on /metrics.

Names do not start with `vllm:` (vLLM unregisters those). Counters are created on first use,
after vLLM has chosen between the default and the multiprocess registry (PROMETHEUS_MULTIPROC_DIR
must be set before a metric is created for the multiprocess mode to see it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from vllm_piep.components import COMPONENTS

if TYPE_CHECKING:
    from vllm_piep.wire import WireRecord


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
        self.engine_joules = Counter(
            "piep_engine_step_joules", "Sum of predicted engine-step energies (J); equals the "
            "sum over requests once they have all finished", registry=registry)

    def count_request(self, record: WireRecord) -> None:
        if not record.complete:
            self.unattributed.inc()
            return
        src = record.source
        self.requests.labels(src).inc()
        self.joules.labels(src).inc(record.joules)
        for name, value in zip(COMPONENTS, record.components, strict=True):
            self.component_joules.labels(name, src).inc(value)
        self.phase_joules.labels("prefill", src).inc(record.prefill_joules)
        self.phase_joules.labels("decode", src).inc(record.decode_joules)

    def count_engine(self, joules: float, errors: int) -> None:
        if joules > 0:
            self.engine_joules.inc(joules)
        if errors > 0:
            self.predictor_errors.inc(errors)
