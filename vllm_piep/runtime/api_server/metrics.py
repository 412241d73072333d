"""Prometheus counters the API server exports on /metrics.

Names do not start with `vllm:` (vLLM unregisters those). Counters are created on first use,
after vLLM has chosen between the default and the multiprocess registry (PROMETHEUS_MULTIPROC_DIR
must be set before a metric is created for the multiprocess mode to see it). With several API
server processes their counters are summed: each engine sends each increment to one of them
(`runtime/record.py`). Gauges are set explicitly (multiprocess mode has no callbacks): the API
servers' own state summed over the live processes, an engine's as its most recent report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from vllm_piep.model.components import COMPONENTS
from vllm_piep.peer_energy import REJECTED_REASONS
from vllm_piep.runtime.worker.steptime import STEP_TIMERS

# Where a request's energy ended up: its response (finished; handed_off where it was a
# disaggregated prefill's, whose request goes on on a decode instance), a response that did not
# show it
# (not_returned: an endpoint that carries no energy, a stream without a usage chunk), an abort,
# energy after its response was complete (outputs that arrived after the API server had
# finished or aborted it; with async scheduling, the step a request that stopped was already
# scheduled into), steps the engine ran for it that no output carried (aborted between two
# outputs), a request some step of which failed to predict (its other steps), and one-off work
# inside a step billed to no request (warmup). Their sum is the engine's predicted total.
OUTCOMES = ("finished", "handed_off", "not_returned", "aborted", "after_finish", "unsent",
            "incomplete", "warmup")
STATE_PLACES = ("api_open", "api_closed", "api_recent")

# `piep_engine_measured`'s reason where the engine names none and has no meter: what the options
# say about it (`unmeasured_reason`).
NO_MEASURING_METER = "no measuring meter"  # as the engine says it (`measured.py`)
MEASURED_OFF = "measured: false"

if TYPE_CHECKING:
    from vllm_piep.config import PiepConfig
    from vllm_piep.runtime.record import StepHeader, WireRecord


def unmeasured_reason(config: PiepConfig) -> str:
    """Why an engine that reports no meter and no reason of its own is in prediction mode, as
    far as the options tell: measured mode switched off, or `meter` unset (the engine then
    takes only a meter that measures, and found none, or has not opened it yet); "" for a named
    meter, whose failure the engine reports itself."""
    if not config.measured:
        return MEASURED_OFF
    return NO_MEASURING_METER if config.meter is None else ""


class EnergyMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY,
                 unmeasured_reason: str = "") -> None:
        # piep_engine_measured's reason when an engine in prediction mode gives none
        self.unmeasured_reason = unmeasured_reason
        self.joules = Counter(
            "piep_energy_joules", "Energy the engines predicted (J), each joule once under "
            "some outcome, by source (usage.energy.source)", ["source"], registry=registry)
        self.component_joules = Counter(
            "piep_energy_component_joules", "Energy of requests (J) by module or "
            "communication type (warmup: one-off work)", ["component", "source"],
            registry=registry)
        self.phase_joules = Counter(
            "piep_energy_phase_joules", "Energy of requests (J) by phase",
            ["phase", "source"], registry=registry)
        self.requests = Counter(
            "piep_requests_attributed", "Requests whose response carried usage.energy "
            "(outcome finished); energy a response did not show is under not_returned",
            ["source"], registry=registry)
        self.unattributed = Counter(
            "piep_requests_unattributed", "Requests left without energy because a step of "
            "theirs could not be predicted", registry=registry)
        self.predictor_errors = Counter(
            "piep_predictor_errors", "Engine steps whose energy prediction failed",
            registry=registry)
        self.outcome_joules = Counter(
            "piep_request_outcome_joules", "Energy of requests (J) by where it was accounted: "
            "finished (in a response), handed_off (in a disaggregated prefill's response), "
            "not_returned (served without showing it), aborted, "
            "after_finish (after the request's response was complete: later outputs, or the "
            "step async scheduling had already scheduled it into), unsent (engine steps no "
            "output carried), incomplete (requests a step of which could not be predicted), "
            "warmup (one-off work inside a step)",
            ["outcome"], registry=registry)
        self.model_joules = Counter(
            "piep_model_energy_joules", "Energy of requests (J) by the served model or LoRA "
            "adapter they ran (names the engine loaded, never a client's string) and by "
            "outcome as piep_request_outcome_joules; only requests' own energy (the engine's "
            "unsent, aborted-without-output and warmup totals belong to no request)",
            ["model", "outcome"], registry=registry)
        self.gco2e = Counter(
            "piep_energy_gco2e", "Emissions of finished or aborted requests (gCO2e) at the "
            "configured grid intensity", registry=registry)
        self.tracked = Gauge(
            "piep_tracked_requests", "Requests the API servers hold state for, by place "
            "(api_open: in flight; api_closed: finished, awaiting their response; api_recent: "
            "finished, kept a few seconds for late outputs)", ["where"], registry=registry,
            multiprocess_mode="livesum")
        for where in STATE_PLACES:
            self.tracked.labels(where)
        self.engine_tracked = Gauge(
            "piep_engine_tracked_requests", "Requests an engine holds state for, as of its "
            "last report (it reports when idle too)", ["engine"], registry=registry,
            multiprocess_mode="mostrecent")
        for outcome in OUTCOMES:  # exported from the start, so sums over labels are complete
            self.outcome_joules.labels(outcome)
        self.engine_joules = Counter(
            "piep_engine_step_joules", "Sum of engine-step energies (J): predicted, or in "
            "measured mode the meter's energy split to the steps; equals the sum over outcomes "
            "once the engines are idle", registry=registry)
        self.engine_predicted = Counter(
            "piep_engine_predicted_joules", "Measured mode: the model's own figure for the "
            "steps the meter settled (J); the ratio of piep_engine_step_joules to it is how far "
            "the model is", registry=registry)
        self.idle_joules = Counter(
            "piep_idle_joules", "Measured mode: the meter's energy while no step ran (J), "
            "billed to no request", registry=registry)
        self.fitted_joules = Counter(
            "piep_meter_fitted_joules", "Measured mode: energy of steps the meter could not "
            "speak for (it failed, stalled or went back), settled by the fit to its earlier "
            "readings (J); those responses say source `fitted`", registry=registry)
        self.estimated_joules = Counter(
            "piep_meter_estimated_joules", "Measured mode: energy the meter's readings "
            "estimated rather than read (J): a worker whose meter cannot be read, estimated "
            "from the other workers' at the share it drew; those responses say source "
            "`fitted`", registry=registry)
        self.audit_failures = Counter(
            "piep_engine_audit_failures", "Steps whose closed-form split an explicit check "
            "disagreed with (the engine then splits every step explicitly; never a wrong "
            "total after it)", registry=registry)
        self.zero_time_steps = Counter(
            "piep_engine_zero_time_steps", "Steps whose measured time was zero, priced as "
            "their work alone (no idle or busy power)", registry=registry)
        self.fallback_steps = Counter(
            "piep_meter_fallback_steps", "Measured mode: steps settled by the fit instead of "
            "the meter", registry=registry)
        self.measured_ratio = Gauge(
            "piep_measured_ratio", "Measured mode: the meter's energy over the model's, by "
            "component group (static: idle power x time; dynamic: the work), fitted online; "
            "bundle: the model (`calibrate from-metrics` turns a prior's into a correction)",
            ["engine", "group", "bundle"], registry=registry, multiprocess_mode="mostrecent")
        self.engine_measured = Gauge(
            "piep_engine_measured", "1 while an engine is in measured mode (its meter decides "
            "each step's energy), 0 when it is not; reason: why not (its workers span nodes, "
            f"the meter failed to open, a MIG instance...; {NO_MEASURING_METER!r}, "
            f"{MEASURED_OFF!r})",
            ["engine", "meter", "reason"], registry=registry, multiprocess_mode="mostrecent")
        self.engine_meter_shared = Gauge(
            "piep_engine_meter_shared", "Measured mode: processes of others NVML lists on an "
            "engine's metered GPUs at its last look (their energy is in the meter's); -1: NVML "
            "cannot tell", ["engine"], registry=registry, multiprocess_mode="mostrecent")
        self._engine_meter_labels: dict[str, tuple[str, str]] = {}
        self.steps = Counter(
            "piep_engine_steps", "Engine steps accounted, by where their time came from: "
            "cuda_event (CUDA events in the worker), perf_counter (the worker's host clock, "
            "CPU), engine_clock (no worker time arrived: the engine's wall clock, a fallback)",
            ["step_time"], registry=registry)
        for timer in STEP_TIMERS:
            self.steps.labels(timer)
        self.ledger_records = Counter(
            "piep_ledger_records", "Billing ledger rows (`ledger` option) by result: written "
            "(committed to the file), dropped (its queue was full, or the file failed to take "
            "them for longer than the queue holds)", ["result"], registry=registry)
        for result in ("written", "dropped"):
            self.ledger_records.labels(result)
        self.ledger_tenants_rejected = Counter(
            "piep_ledger_tenants_rejected", "HTTP requests whose tenant (header or `user`) "
            "had control characters, a lone surrogate or over 256 bytes: their ledger rows "
            "carry no tenant",
            registry=registry)
        self.peer_joules = Counter(
            "piep_peer_joules", "Energy (J) of requests' parts served on another instance "
            "(disaggregated prefill) that this instance's responses showed, by that "
            "instance's role and whether its signature was verified (verified parts are added "
            "to usage.energy.joules); never counted as this instance's own energy",
            ["role", "verified"], registry=registry)
        self.peer_rejected = Counter(
            "piep_peer_rejected", "Parts from another instance dropped from requests, by "
            "reason: malformed, bad_signature (not signed with this instance's peer_key), "
            "other_request, expired, replayed", ["reason"], registry=registry)
        for verified in ("true", "false"):  # exported from the start, as the outcomes are
            self.peer_joules.labels("prefill", verified)
        for reason in REJECTED_REASONS:
            self.peer_rejected.labels(reason)

    def count_request(self, record: WireRecord, outcome: str = "finished",
                      gco2e: float | None = None, model: str | None = None) -> None:
        """A request's record, counted under its outcome (and its model, where known)."""
        if not record.complete:  # no figure for it, but its predicted steps still count
            self.unattributed.inc()
            self.count_energy(record.source, "incomplete", record.components,
                              record.prefill_joules, record.decode_joules, model)
            return
        if outcome == "finished":  # the figure reached the client
            self.requests.labels(record.source).inc()
        self.count_energy(record.source, outcome, record.components, record.prefill_joules,
                          record.decode_joules, model)
        if gco2e:
            self.gco2e.inc(gco2e)

    def count_energy(self, source: str, outcome: str, components: tuple[float, ...] | None,
                     prefill: float, decode: float, model: str | None = None) -> None:
        """Energy of a request or a part of it (components None: only the total is known)."""
        total = prefill + decode
        if total <= 0:
            return
        self.joules.labels(source).inc(total)
        self.outcome_joules.labels(outcome).inc(total)
        if model is not None:
            self.model_joules.labels(model, outcome).inc(total)
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
        aborted requests; `aborted`: requests aborted from outside in sparse mode, where no
        output carried their rows; `after_finish`: steps that ran after a request's final output;
        `warmup`: one-off work inside steps): only the total is known (not in the phase
        counters; warm-up is a component of its own)."""
        if joules > 0:
            self.joules.labels(source).inc(joules)
            self.outcome_joules.labels(outcome).inc(joules)
            if outcome == "warmup":  # static energy of one-off work: a component of its own
                self.component_joules.labels("warmup", source).inc(joules)

    def count_steps(self, timer: str, steps: int) -> None:
        self.steps.labels(timer).inc(steps)

    def count_measured(self, header: StepHeader) -> None:
        """A measured-mode header's increments (`vllm_piep.runtime.record.StepHeader`)."""
        for counter, value in ((self.engine_predicted, header.predicted_joules),
                               (self.idle_joules, header.idle_joules),
                               (self.fitted_joules, header.fitted_joules),
                               (self.fallback_steps, header.fallback_steps),
                               (self.estimated_joules, header.estimated_joules)):
            if value > 0:
                counter.inc(value)
        if header.ratios is not None:
            for group, ratio in zip(("static", "dynamic"), header.ratios, strict=True):
                self.measured_ratio.labels(header.engine_id, group, header.bundle_id).set(ratio)

    def engine_meter(self, header: StepHeader) -> None:
        """The engine's mode (a state every header carries): one series per engine, the one of
        its current meter and reason."""
        engine = header.engine_id
        reason = "" if header.meter else (header.meter_note or self.unmeasured_reason)
        labels = (header.meter or "", reason)
        if self._engine_meter_labels.get(engine) != labels:
            old = self._engine_meter_labels.get(engine)
            if old is not None:  # 0 first: with several API processes the series persists
                self.engine_measured.labels(engine, *old).set(0.0)
                self.engine_measured.remove(engine, *old)
            self._engine_meter_labels[engine] = labels
        self.engine_measured.labels(engine, *labels).set(1.0 if header.meter else 0.0)
        if header.meter:
            self.engine_meter_shared.labels(engine).set(header.meter_shared)

    def count_engine(self, joules: float, errors: int, audit_failures: int = 0,
                     zero_time_steps: int = 0) -> None:
        if joules > 0:
            self.engine_joules.inc(joules)
        if errors > 0:
            self.predictor_errors.inc(errors)
        if audit_failures > 0:
            self.audit_failures.inc(audit_failures)
        if zero_time_steps > 0:
            self.zero_time_steps.inc(zero_time_steps)
