"""API-server side: the latest energy record of every request in flight, the energy object that
goes into `usage.energy`, and the Prometheus counters. No vLLM imports.

Requests are known by vLLM's internal request ids, unique even when clients reuse an
`X-Request-Id`; a response is known by its *owner*: the internal id of its request, or of the
parent request of `n > 1` samples (`outputs.py` tags each RequestOutput with it).

A record arrives with every engine output of a request (cumulative, so the latest one is all
that is kept). When vLLM aborts a request the ledger counts it at once (`aborted`); when vLLM
finishes one, its record waits for its response: counted `finished` when the serving code takes
it into `usage.energy`, `not_returned` when a response takes it without showing it (a stream
without a usage chunk, one cut short) or when nobody takes it within `claim_s` (an endpoint that
carries no energy).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from vllm_piep.ledger.schema import LedgerRow
from vllm_piep.model.components import COMPONENTS
from vllm_piep.once import OnceLogger
from vllm_piep.runtime.api_server.carbon import gco2e
from vllm_piep.runtime.api_server.metrics import EnergyMetrics
from vllm_piep.runtime.record import (
    ROW_BYTES,
    ROW_FIELDS,
    RowCursor,
    StepHeader,
    WireRecord,
    decode_row,
    is_rows,
)
from vllm_piep.runtime.worker.steptime import STEP_TIMERS

_MAX_CLOSED = 4096
_RECENT_S = 10.0  # late outputs arrive within a step or two of the finish
# A response takes its requests' records right after they finish (the serving code runs as soon
# as the final output is processed); one nobody took within this long is not returned.
_CLAIM_S = 5.0
_ZERO_ROW = bytes(ROW_BYTES)


class UsageEnergy(BaseModel):
    """`usage.energy` of a response (docs/architecture.md, "The response contract")."""

    model_config = ConfigDict(frozen=True)

    joules: float
    joules_per_output_token: float | None
    prefill_joules: float
    decode_joules: float
    breakdown: dict[str, float]
    # Multipliers of the bundle's split-conformal interval times `joules`; the prior has no
    # held-out residuals to give one.
    interval: tuple[float, float] | None
    interval_level: float | None
    bundle: str
    source: str
    gco2e: float | None = None  # only with a configured grid intensity
    # Measured mode: the meter, and the model's own figure for the same steps.
    meter: str | None = None
    predicted_joules: float | None = None
    # Measured mode: whether other processes ran on the metered GPUs (their energy is in the
    # meter's); None where NVML could not tell.
    meter_shared: bool | None = None
    # Disaggregated prefill/decode: each instance's part (`vllm_piep.peer_energy`): `role`,
    # `joules`, `source`, `bundle`, `verified`; only verified parts are in `joules`.
    instances: list[dict[str, Any]] | None = None

    def to_usage(self) -> dict:
        return self.model_dump(exclude={name for name in ("gco2e", "meter", "predicted_joules",
                                                          "meter_shared", "instances")
                                        if getattr(self, name) is None})


def usage_energy(records: list[WireRecord], completion_tokens: int,
                 intensity: float | None = None) -> UsageEnergy | None:
    """The energy of a response made of these requests; None if any step went unaccounted.
    `intensity`: grid gCO2e/kWh, if configured."""
    if not records or not all(r.complete for r in records):
        return None
    breakdown = {name: math.fsum(r.components[i] for r in records)
                 for i, name in enumerate(COMPONENTS)}
    joules = math.fsum(breakdown.values())
    sources = {r.source for r in records}
    bundles = {r.bundle_id for r in records}
    meters = {r.meter for r in records}
    meter = meters.pop() if len(meters) == 1 else None
    predicted = (math.fsum(r.predicted_joules or 0.0 for r in records) if meter is not None
                 else None)
    shared = None
    if meter is not None and all(r.meter_shared >= 0 for r in records):
        shared = any(r.meter_shared > 0 for r in records)
    intervals = {(r.interval, r.interval_level) for r in records}
    interval, level = intervals.pop() if len(intervals) == 1 else (None, None)
    return UsageEnergy(
        joules=joules,
        joules_per_output_token=joules / completion_tokens if completion_tokens > 0 else None,
        prefill_joules=math.fsum(r.prefill_joules for r in records),
        decode_joules=math.fsum(r.decode_joules for r in records),
        breakdown=breakdown,
        interval=None if interval is None else (joules * interval[0], joules * interval[1]),
        interval_level=level if interval is not None else None,
        bundle=bundles.pop() if len(bundles) == 1 else ",".join(sorted(bundles)),
        source=sources.pop() if len(sources) == 1 else "mixed",
        gco2e=None if intensity is None else gco2e(joules, intensity),
        meter=meter,
        predicted_joules=predicted,
        meter_shared=shared,
    )


@dataclass(slots=True)
class RequestInfo:
    """What the billing ledger's row says of a request besides its energy
    (`vllm_piep.ledger`), noted once when the request is added and once when it closes."""

    internal_id: str
    request_id: str | None = None
    model: str | None = None
    tenant: str | None = None
    arrival_at: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None


LedgerSink = Callable[[LedgerRow], None]


def _since(before: bytes, after: bytes) -> dict[str, float]:
    """What a request's cumulative row gained from `before` to `after`, field by field."""
    old, new = decode_row(before), decode_row(after)
    return {name: float(new[name] - old[name]) for name in ROW_FIELDS}


class _Recent(NamedTuple):
    """A request the API server closed lately: its last counted row, for outputs after it."""

    closed_at: float
    header: StepHeader | None  # None: no output had carried a row of it
    row: bytes  # the row counted so far (`_ZERO_ROW`: none)
    info: RequestInfo | None
    aborted: bool  # closed by an abort (a client gone), not by its finish

    def abort_outcome(self) -> str:
        """The outcome of this request's abort energy not counted yet: `aborted` where nothing
        of it was counted before, else `unsent` (as the engine books aborts)."""
        return "aborted" if self.row == _ZERO_ROW else "unsent"

    def late_outcome(self) -> str:
        """Where energy arriving after the close goes: after a finish it came after the
        response (`after_finish`); after an abort it is the aborted request's
        (`abort_outcome`)."""
        return self.abort_outcome() if self.aborted else "after_finish"


class EnergyLedger:
    """Latest record per engine request (module docstring). Thread-safe: the API server's event
    loop feeds it, its housekeeping thread (`housekeep`) expires what nobody claimed.

    State per request: `_open` until vLLM finishes or aborts it; a finished request's record
    then waits in `_closed` under its owner until its response takes it; `_recent` keeps each
    closed request's last counted row for `recent_s` seconds, so that outputs arriving after
    the API server finished it (a stop string) are still counted, as `after_finish`, and those
    after it aborted it (a client gone) as the aborted request's (`_Recent.late_outcome`).

    `sink` (the billing ledger's writer, `vllm_piep.ledger`), if set, gets a row for each count:
    one per request under its outcome (plus a row for each part that came later) and one per
    engine increment that belongs to no request, so that its rows sum to what /metrics counts.
    """

    def __init__(self, metrics: EnergyMetrics | None = None, max_closed: int = _MAX_CLOSED,
                 recent_s: float = _RECENT_S, claim_s: float = _CLAIM_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._max_closed = max_closed
        self._recent_s = recent_s
        self._claim_s = claim_s
        self._clock = clock
        self._lock = threading.RLock()
        # Raw rows, decoded only when closed: update() runs for every output of every request.
        self._open: dict[str, tuple[str, StepHeader, bytes]] = {}
        # Closed records by owner, each with its request's info (`note_request`).
        self._closed: OrderedDict[
            str, tuple[float, list[tuple[WireRecord, RequestInfo | None]]]] = OrderedDict()
        self._claimed: dict[str, str] = {}  # open requests taken already -> their outcome
        self._recent: OrderedDict[str, _Recent] = OrderedDict()
        # Each request in flight: its model, tenant, tokens (`note_request`).
        self._info: dict[str, RequestInfo] = {}
        self.sink: LedgerSink | None = None
        self.last_header: StepHeader | None = None
        self.cursor: RowCursor | None = None  # the batch whose rows are being handed out
        self.intensity: Callable[[], float | None] = lambda: None
        self._once = OnceLogger()

    @property
    def metrics(self) -> EnergyMetrics | None:
        return self._metrics

    def observe_header(self, raw: object) -> StepHeader | None:
        """A batch's step header: count the engine's increments; None if it is malformed."""
        try:
            header = StepHeader.decode(raw)
        except (ValueError, TypeError) as exc:
            self._once.warn("reading an engine energy header", exc,
                            "those requests get no usage.energy")
            return None
        metrics = self._metrics
        if metrics is not None:
            metrics.count_engine(header.step_joules, header.errors, header.audit_failures,
                                 header.zero_time_steps)
            metrics.count_total(header.source, "unsent", header.unsent_joules)
            if header.aborted_joules > 0:  # requests aborted before any output carried them
                metrics.count_total(header.source, "aborted", header.aborted_joules)
                intensity = self.intensity()
                if intensity is not None:
                    metrics.gco2e.inc(gco2e(header.aborted_joules, intensity))
            metrics.count_total(header.source, "after_finish", header.after_finish_joules)
            metrics.count_total(header.source, "warmup", header.warmup_joules)
            for timer, steps in zip(STEP_TIMERS, header.steps_by_timer, strict=True):
                if steps:
                    metrics.count_steps(timer, steps)
            metrics.engine_meter(header)
            if header.carries_counts:
                metrics.engine_tracked.labels(header.engine_id).set(header.tracked)
                if header.meter is not None:
                    metrics.count_measured(header)
        if self.sink is not None:
            self._engine_rows(header)
        self.last_header = header
        return header

    def _engine_rows(self, header: StepHeader) -> None:
        """The header's energy that belongs to no request, as billing ledger rows; of its
        aborted requests' energy, what this API server can book to them (`_book_aborted`) is
        in their rows instead."""
        booked = self._book_aborted(header)
        for outcome, joules in (("unsent", header.unsent_joules - booked["unsent"]),
                                ("aborted", header.aborted_joules - booked["aborted"]),
                                ("after_finish", header.after_finish_joules),
                                ("warmup", header.warmup_joules),
                                ("idle", header.idle_joules if header.meter else 0.0)):
            if joules > 0:
                self._row("engine", outcome, joules, header.source, header.bundle_id,
                          header.meter, engine=header.engine_id)

    def _book_aborted(self, header: StepHeader) -> dict[str, float]:
        """Rows for the requests the engine reports aborted with energy no output carried
        (`StepHeader.aborted_ids`), each booked to its request where this API server closed it
        recently (with several API servers, the engine may report it to another one): the
        energy since the row an output last carried, as `aborted` (none did) or `unsent`."""
        booked = {"aborted": 0.0, "unsent": 0.0}
        ids, blob = header.aborted_ids, header.aborted_rows
        if not ids or not is_rows(blob) or len(blob) != len(ids) * ROW_BYTES:
            return booked
        with self._lock:
            for i, internal_id in enumerate(ids):
                entry = self._recent.get(internal_id)
                if entry is None:
                    continue
                row = blob[i * ROW_BYTES:(i + 1) * ROW_BYTES]
                delta = _since(entry.row, row)
                if delta["prefill"] + delta["decode"] <= 0:
                    continue
                outcome = entry.abort_outcome()
                booked[outcome] += delta["prefill"] + delta["decode"]
                self._request_row(outcome, header.source, header.bundle_id, header.meter,
                                  entry.info, delta["prefill"], delta["decode"],
                                  tuple(delta[name] for name in COMPONENTS), later=True)
                self._recent[internal_id] = entry._replace(header=header, row=row)
        return booked

    def note_model(self, internal_id: str, model: str) -> None:
        """A request added to the engine runs this served model or LoRA adapter: its energy
        is counted under it too (`piep_model_energy_joules_total`). Once per request."""
        self.note_request(RequestInfo(internal_id, model=model))

    def note_request(self, info: RequestInfo) -> None:
        """A request added to the engine: its model (counted under it too,
        `piep_model_energy_joules_total`), and for the billing ledger its tenant, ids and
        prompt. Once per request."""
        self._info[info.internal_id] = info

    def update(self, internal_id: str, owner: str, header: StepHeader, row: bytes) -> None:
        """Called for every output of every request: keep it cheap."""
        with self._lock:
            self._open[internal_id] = (owner, header, row)

    def close(self, internal_id: str, outcome: str = "finished",
              output_tokens: int | None = None) -> None:
        """vLLM finished (`finished`) or aborted (`aborted`) the request, having generated
        `output_tokens`: count an aborted one; keep a finished one for its response."""
        with self._lock:
            entry = self._open.pop(internal_id, None)
            info = self._info.pop(internal_id, None)
            if info is not None:
                info.output_tokens = output_tokens
            now = self._clock()
            if entry is None:
                # No output carried a row of it (cancelled while its first step ran, or any
                # abort when only finishing outputs carry rows): one may still come, counted
                # under `late_outcome`; or the engine reports its energy with the abort
                # (`_book_aborted`).
                if internal_id not in self._recent:
                    self._recent[internal_id] = _Recent(now, None, _ZERO_ROW, info,
                                                        outcome == "aborted")
                    self._expire(now)
                    if self.sink is not None and outcome == "aborted":
                        source = self.last_header.source if self.last_header else "none"
                        self._request_row("aborted", source, None, None, info, 0.0, 0.0,
                                          (0.0,) * len(COMPONENTS))
                return
            owner, header, row = entry
            record = WireRecord.from_wire(header, row)
            self._recent[internal_id] = _Recent(now, header, row, info, outcome == "aborted")
            claimed = self._claimed.pop(internal_id, None)
            if claimed is not None:  # its response went out already
                self._count(record, "aborted" if outcome == "aborted" else claimed, info)
            elif outcome != "finished":  # nobody will ask: the client is gone
                self._count(record, outcome, info)
            else:
                self._closed.setdefault(owner, (now, []))[1].append((record, info))
                self._closed.move_to_end(owner)
                while len(self._closed) > self._max_closed:
                    self._unclaimed(self._closed.popitem(last=False)[1][1])
            self._expire(now)

    def late(self, internal_id: str, header: StepHeader, row: bytes) -> None:
        """An output of a request the API server already finished or aborted: count what the
        engine added since the row that was counted, where `_Recent.late_outcome` says."""
        with self._lock:
            entry = self._recent.get(internal_id)
            if entry is None or (self._metrics is None and self.sink is None):
                return
            delta = _since(entry.row, row)
            if delta["prefill"] + delta["decode"] > 0:
                outcome = (entry.late_outcome() if decode_row(row)["incomplete"] == 0.0
                           else "incomplete")
                info = entry.info
                components = tuple(delta[name] for name in COMPONENTS)
                if self._metrics is not None:
                    self._metrics.count_energy(header.source, outcome, components,
                                               delta["prefill"], delta["decode"],
                                               None if info is None else info.model)
                if self.sink is not None:
                    self._request_row(outcome, header.source, header.bundle_id, header.meter,
                                      info, delta["prefill"], delta["decode"], components,
                                      later=True)
            self._recent[internal_id] = entry._replace(header=header, row=row)

    def finished_record(self, internal_id: str) -> WireRecord | None:
        """The last record of a request vLLM closed within `recent_s` (its trace span reads
        it; nothing is taken or counted), or None."""
        with self._lock:
            entry = self._recent.get(internal_id)
        if entry is None or entry.header is None:
            return None
        return WireRecord.from_wire(entry.header, entry.row)

    def take(self, owners: Iterable[str], returned: bool = True, handed_off: bool = False
             ) -> list[WireRecord]:
        """Remove and return the records of these responses' requests (closed, and the latest of
        any still open, which are then counted on close). `returned`: their energy goes out
        in a response (`finished`), else `not_returned`; `handed_off`: in a disaggregated
        prefill's response, whose request the decode instance goes on with (`handed_off`)."""
        wanted = set(owners)
        outcome = ("handed_off" if handed_off else "finished") if returned else "not_returned"
        records: list[WireRecord] = []
        with self._lock:
            for owner in wanted:
                for record, info in self._closed.pop(owner, (0.0, []))[1]:
                    self._count(record, outcome, info)
                    records.append(record)
            for internal_id, (owner, header, row) in self._open.items():
                if owner in wanted:
                    records.append(WireRecord.from_wire(header, row))
                    self._claimed[internal_id] = outcome
        return records

    def housekeep(self) -> None:
        """Expire what nobody claimed and export the state gauges; the housekeeping thread
        calls it every half second, so that an idle server's /metrics is complete."""
        with self._lock:
            self._expire(self._clock())
            if self._metrics is not None:
                tracked = self._metrics.tracked
                tracked.labels("api_open").set(len(self._open))
                tracked.labels("api_closed").set(len(self._closed))
                tracked.labels("api_recent").set(len(self._recent))

    def _count(self, record: WireRecord, outcome: str, info: RequestInfo | None = None
               ) -> None:
        if self._metrics is not None:
            intensity = self.intensity() if record.complete else None
            self._metrics.count_request(record, outcome, None if intensity is None
                                        else gco2e(record.joules, intensity),
                                        None if info is None else info.model)
        if self.sink is not None:
            self._request_row(outcome if record.complete else "incomplete", record.source,
                              record.bundle_id, record.meter, info, record.prefill_joules,
                              record.decode_joules, record.components)

    def _request_row(self, outcome: str, source: str, bundle: str | None, meter: str | None,
                     info: RequestInfo | None, prefill: float, decode: float,
                     components: tuple[float, ...], later: bool = False) -> None:
        """A billing ledger row for a request's energy: all of it, or (`later`) what came
        after its first row, without tokens."""
        breakdown = {name: joules for name, joules in zip(COMPONENTS, components, strict=True)
                     if joules}
        if info is None:
            info = RequestInfo("")
        self._row("request", outcome, prefill + decode, source, bundle, meter,
                  request_id=info.request_id, internal_id=info.internal_id or None,
                  model=info.model, tenant=info.tenant, arrival_at=info.arrival_at,
                  prompt_tokens=None if later else info.prompt_tokens,
                  output_tokens=None if later else info.output_tokens,
                  prefill_joules=prefill, decode_joules=decode, breakdown=breakdown,
                  later=later)

    def _row(self, kind: str, outcome: str, joules: float, source: str, bundle: str | None,
             meter: str | None, **fields: object) -> None:
        sink = self.sink
        if sink is None:
            return
        intensity = self.intensity()
        try:
            sink(LedgerRow(kind, outcome, time.time(), joules, source,  # type: ignore[arg-type]
                           bundle, meter, gco2e=None if intensity is None
                           else gco2e(joules, intensity), **fields))  # type: ignore[arg-type]
        except Exception as exc:  # boundary: the ledger never stops the counting
            self._once.warn("handing a row to the billing ledger", exc, "the row is lost")

    def _unclaimed(self, records: list[tuple[WireRecord, RequestInfo | None]]) -> None:
        for record, info in records:
            self._count(record, "not_returned", info)

    def _expire(self, now: float) -> None:
        recent = self._recent
        while recent and now - next(iter(recent.values())).closed_at > self._recent_s:
            recent.popitem(last=False)
        if len(recent) > 4 * self._max_closed:  # a flood of finishes: stay bounded anyway
            recent.popitem(last=False)
        # A finished request whose response never takes it: an endpoint that carries no
        # energy, or a handler cancelled after the final output.
        closed = self._closed
        while closed and now - next(iter(closed.values()))[0] > self._claim_s:
            self._unclaimed(closed.popitem(last=False)[1][1])

    @property
    def size(self) -> tuple[int, int]:
        """(open, closed) entries: bounded state, checked by the tests."""
        return len(self._open), len(self._closed)
