"""API-server side: the latest energy record of every request in flight, the energy object that
goes into `usage.energy`, and the Prometheus counters. No vLLM imports.

A record arrives with every engine output of a request (cumulative, so the latest one is all
that is kept). When vLLM finishes or aborts a request the ledger closes it and counts it in
/metrics; the serving code then takes the closed records of its response's requests. Closed
records nobody takes (the client went away) are evicted, oldest first, past a fixed bound.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from vllm_piep.components import COMPONENTS
from vllm_piep.metrics import EnergyMetrics
from vllm_piep.once import OnceLogger
from vllm_piep.wire import StepHeader, WireRecord, is_row

_MAX_CLOSED = 4096


class UsageEnergy(BaseModel):
    """`usage.energy` of a response (DESIGN.md, "The response contract")."""

    model_config = ConfigDict(frozen=True)

    joules: float
    joules_per_output_token: float | None
    prefill_joules: float
    decode_joules: float
    breakdown: dict[str, float]
    interval: tuple[float, float] | None  # the prior has no held-out residuals to give one
    bundle: str
    source: str


def usage_energy(records: list[WireRecord], completion_tokens: int) -> UsageEnergy | None:
    """The energy of a response made of these requests; None if any step went unaccounted."""
    if not records or not all(r.complete for r in records):
        return None
    breakdown = {name: math.fsum(r.components[i] for r in records)
                 for i, name in enumerate(COMPONENTS)}
    joules = math.fsum(breakdown.values())
    sources = {r.source for r in records}
    bundles = {r.bundle_id for r in records}
    return UsageEnergy(
        joules=joules,
        joules_per_output_token=joules / completion_tokens if completion_tokens > 0 else None,
        prefill_joules=math.fsum(r.prefill_joules for r in records),
        decode_joules=math.fsum(r.decode_joules for r in records),
        breakdown=breakdown,
        interval=None,
        bundle=bundles.pop() if len(bundles) == 1 else ",".join(sorted(bundles)),
        source=sources.pop() if len(sources) == 1 else "mixed",
    )


class EnergyLedger:
    """Latest record per engine request, keyed by vLLM's internal and external request ids."""

    def __init__(self, metrics: EnergyMetrics | None = None, max_closed: int = _MAX_CLOSED):
        self._metrics = metrics
        self._max_closed = max_closed
        # Raw rows, decoded only when closed: update() runs for every output of every request.
        self._open: dict[str, tuple[str, StepHeader, bytes]] = {}
        self._closed: OrderedDict[str, list[WireRecord]] = OrderedDict()
        self._engines: dict[str, tuple[float, int]] = {}
        self.last_header: StepHeader | None = None
        self._once = OnceLogger()

    def observe_header(self, raw: object) -> StepHeader | None:
        """A batch's step header: export the engine's totals; None if it is malformed."""
        try:
            header = StepHeader.decode(raw)
        except (ValueError, TypeError) as exc:
            self._once.warn("reading an engine energy header", exc,
                            "those requests get no usage.energy")
            return None
        seen_joules, seen_errors = self._engines.get(header.engine_id, (0.0, 0))
        if header.engine_joules > seen_joules or header.engine_errors > seen_errors:
            if self._metrics is not None:
                self._metrics.count_engine(max(0.0, header.engine_joules - seen_joules),
                                           max(0, header.engine_errors - seen_errors))
            self._engines[header.engine_id] = (max(seen_joules, header.engine_joules),
                                               max(seen_errors, header.engine_errors))
        self.last_header = header
        return header

    def update(self, internal_id: str, external_id: str, header: StepHeader, row: object) -> None:
        """Called for every output of every request: keep it cheap."""
        if not is_row(row):
            self._once.warn("reading an engine energy record", ValueError(repr(row)[:200]),
                            "that request gets no usage.energy")
            return
        self._open[internal_id] = (external_id, header, row)  # type: ignore[assignment]

    def close(self, internal_id: str) -> None:
        """vLLM finished or aborted the request: count it, keep it for its response."""
        entry = self._open.pop(internal_id, None)
        if entry is None:
            return
        external_id, header, row = entry
        record = WireRecord.from_wire(header, row)
        if self._metrics is not None:
            self._metrics.count_request(record)
        self._closed.setdefault(external_id, []).append(record)
        self._closed.move_to_end(external_id)
        while len(self._closed) > self._max_closed:
            self._closed.popitem(last=False)

    def take(self, external_ids: Iterable[str]) -> list[WireRecord]:
        """Remove and return the records of these requests (closed, and any still open)."""
        wanted = set(external_ids)
        records: list[WireRecord] = []
        for ext in wanted:
            records.extend(self._closed.pop(ext, ()))
        still_open = [i for i, (ext, _, _) in self._open.items() if ext in wanted]
        for internal_id in still_open:
            _, header, row = self._open.pop(internal_id)
            records.append(WireRecord.from_wire(header, row))
        return records

    @property
    def size(self) -> tuple[int, int]:
        """(open, closed) entries: bounded state, checked by the tests."""
        return len(self._open), len(self._closed)
