"""API-server side: the latest energy record of every request in flight, the energy object that
goes into `usage.energy`, and the Prometheus counters. No vLLM imports.

A record arrives with every engine output of a request (cumulative, so the latest one is all
that is kept). When vLLM finishes or aborts a request the ledger closes it and counts it in
/metrics; the serving code then takes the closed records of its response's requests. Closed
records nobody takes (the client went away) are evicted, oldest first, past a fixed bound.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from pydantic import BaseModel, ConfigDict

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
)
from vllm_piep.runtime.worker.steptime import STEP_TIMERS

_MAX_CLOSED = 4096
_RECENT_S = 10.0  # late outputs arrive within a step or two of the finish
_CLOSED_S = 120.0  # a response is built right after its request finishes
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

    def to_usage(self) -> dict:
        return self.model_dump(exclude={"gco2e"} if self.gco2e is None else None)


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
    )


class EnergyLedger:
    """Latest record per engine request, keyed by vLLM's internal and external request ids.

    State per request: `_open` until vLLM finishes or aborts it; a finished request's record
    then waits in `_closed` until its response takes it (bounded: unclaimed ones are evicted);
    `_recent` keeps each closed request's last counted row for `recent_s` seconds, so outputs
    that arrive after the API server finished it (a stop string, a client gone) are still
    counted, as `after_finish`.
    """

    def __init__(self, metrics: EnergyMetrics | None = None, max_closed: int = _MAX_CLOSED,
                 recent_s: float = _RECENT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._max_closed = max_closed
        self._recent_s = recent_s
        self._clock = clock
        # Raw rows, decoded only when closed: update() runs for every output of every request.
        self._open: dict[str, tuple[str, StepHeader, bytes]] = {}
        self._closed: OrderedDict[str, tuple[float, list[WireRecord]]] = OrderedDict()
        self._claimed: set[str] = set()  # open requests whose response already went out
        self._recent: OrderedDict[str, tuple[float, StepHeader | None, bytes]] = OrderedDict()
        self._engines: dict[str, StepHeader] = {}  # the totals seen so far, per engine
        self.last_header: StepHeader | None = None
        self.cursor: RowCursor | None = None  # the batch whose rows are being handed out
        self.intensity: Callable[[], float | None] = lambda: None
        self._once = OnceLogger()
        if metrics is not None:
            try:
                for where, size in (("api_open", lambda: len(self._open)),
                                    ("api_closed", self._closed_size),
                                    ("api_recent", self._recent_size),
                                    ("engine", self.engine_tracked)):
                    metrics.tracked.labels(where).set_function(size)
            except Exception as exc:  # prometheus_client's multiprocess mode has no callbacks
                self._once.warn("exporting piep_tracked_requests", exc,
                                "the gauge stays empty")

    def observe_header(self, raw: object) -> StepHeader | None:
        """A batch's step header: export the engine's totals; None if it is malformed."""
        try:
            header = StepHeader.decode(raw)
        except (ValueError, TypeError) as exc:
            self._once.warn("reading an engine energy header", exc,
                            "those requests get no usage.energy")
            return None
        seen = self._engines.get(header.engine_id) or StepHeader(
            source=header.source, bundle_id=header.bundle_id, engine_id=header.engine_id,
            engine_joules=0.0, engine_errors=0, predictor_ok=header.predictor_ok)
        if self._metrics is not None:
            if (header.engine_joules > seen.engine_joules
                    or header.engine_errors > seen.engine_errors):
                self._metrics.count_engine(max(0.0, header.engine_joules - seen.engine_joules),
                                           max(0, header.engine_errors - seen.engine_errors))
            if header.unsent_joules > seen.unsent_joules:
                self._metrics.count_total(header.source, "unsent",
                                          header.unsent_joules - seen.unsent_joules)
            if header.after_finish_joules > seen.after_finish_joules:
                self._metrics.count_total(header.source, "after_finish",
                                          header.after_finish_joules - seen.after_finish_joules)
            for timer, now, before in zip(STEP_TIMERS, header.steps_by_timer,
                                          seen.steps_by_timer, strict=True):
                if now > before:
                    self._metrics.count_steps(timer, now - before)
        # Totals only grow: a header of a client that is not sent the totals carries zeros.
        self._engines[header.engine_id] = header.replace(
            engine_joules=max(seen.engine_joules, header.engine_joules),
            engine_errors=max(seen.engine_errors, header.engine_errors),
            unsent_joules=max(seen.unsent_joules, header.unsent_joules),
            after_finish_joules=max(seen.after_finish_joules, header.after_finish_joules),
            steps_by_timer=tuple(map(max, seen.steps_by_timer, header.steps_by_timer)))
        self.last_header = header
        return header

    def engine_tracked(self) -> int:
        """Requests the engines held state for, as of their last step."""
        return sum(e.tracked for e in self._engines.values())

    def update(self, internal_id: str, external_id: str, header: StepHeader, row: bytes) -> None:
        """Called for every output of every request: keep it cheap."""
        self._open[internal_id] = (external_id, header, row)

    def close(self, internal_id: str, outcome: str = "finished") -> None:
        """vLLM finished (`finished`) or aborted (`aborted`) the request: count it; keep a
        finished one for its response."""
        entry = self._open.pop(internal_id, None)
        now = self._clock()
        if entry is None:
            # No output of it yet (cancelled while its first step ran): one may still come,
            # and all of it is then after the finish.
            if internal_id not in self._recent:
                self._recent[internal_id] = (now, None, _ZERO_ROW)
                self._expire(now)
            return
        external_id, header, row = entry
        record = WireRecord.from_wire(header, row)
        if self._metrics is not None:
            intensity = self.intensity() if record.complete else None
            self._metrics.count_request(record, outcome, None if intensity is None
                                        else gco2e(record.joules, intensity))
        self._recent[internal_id] = (now, header, row)
        self._expire(now)
        if internal_id in self._claimed:  # its response went out already
            self._claimed.discard(internal_id)
            return
        if outcome != "finished":  # nobody will ask: the client is gone
            return
        self._closed.setdefault(external_id, (now, []))[1].append(record)
        self._closed.move_to_end(external_id)
        while len(self._closed) > self._max_closed:
            self._closed.popitem(last=False)

    def late(self, internal_id: str, header: StepHeader, row: bytes) -> None:
        """An output of a request the API server already finished or aborted: count what the
        engine added since the row that was counted."""
        entry = self._recent.get(internal_id)
        if entry is None or self._metrics is None:
            return
        before, after = decode_row(entry[2]), decode_row(row)
        delta = {name: float(after[name] - before[name]) for name in ROW_FIELDS}
        if delta["prefill"] + delta["decode"] > 0:
            outcome = "after_finish" if after["incomplete"] == 0.0 else "incomplete"
            self._metrics.count_energy(header.source, outcome,
                                       tuple(delta[name] for name in COMPONENTS),
                                       delta["prefill"], delta["decode"])
        self._recent[internal_id] = (entry[0], header, row)

    def take(self, external_ids: Iterable[str]) -> list[WireRecord]:
        """Remove and return the records of these requests (closed, and the latest of any
        still open, which are then counted on close but not kept)."""
        wanted = set(external_ids)
        records: list[WireRecord] = []
        for ext in wanted:
            records.extend(self._closed.pop(ext, (0.0, []))[1])
        for internal_id, (ext, header, row) in self._open.items():
            if ext in wanted:
                records.append(WireRecord.from_wire(header, row))
                self._claimed.add(internal_id)
        return records

    def _expire(self, now: float) -> None:
        recent = self._recent
        while recent and now - next(iter(recent.values()))[0] > self._recent_s:
            recent.popitem(last=False)
        if len(recent) > 4 * self._max_closed:  # a flood of finishes: stay bounded anyway
            recent.popitem(last=False)
        # A finished request whose response is never built (an endpoint the plugin does not
        # wrap, a handler cancelled after the final output): its record is dropped.
        closed = self._closed
        while closed and now - next(iter(closed.values()))[0] > _CLOSED_S:
            closed.popitem(last=False)

    def _closed_size(self) -> int:
        self._expire(self._clock())
        return len(self._closed)

    def _recent_size(self) -> int:
        self._expire(self._clock())
        return len(self._recent)

    @property
    def size(self) -> tuple[int, int]:
        """(open, closed) entries: bounded state, checked by the tests."""
        return len(self._open), len(self._closed)
