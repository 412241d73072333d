"""Waiting, by what a real server reports rather than by the clock, until the work it does after
its responses has reached /metrics and the billing ledger.

After its last response a server still has work on the way: the engines send their last counts
when they go idle (aborts, steps no output carried), the API servers' housekeeping (every half
second) expires records no response claimed, and the billing ledger commits its rows once per
flush interval. `quiet_metrics` waits until all of that has reached /metrics; `ledger_settled`
until the ledger file holds every joule /metrics counts. The records an API server keeps for a
few seconds after a request closes (`api_recent`, for outputs that arrive late) are not waited
for: only an engine that still holds the request can send such an output, and dropping the
record counts nothing. Both poll with a generous deadline, so a
loaded machine makes them slower but not wrong, and fail saying what was still pending.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import TypeVar

from support.metrics_text import by_label, samples, total
from vllm_piep.tools.server import VllmServer

DEADLINE_S = 120.0
READ_EVERY_S = 0.5  # the housekeeping's period: each read may see a new round of it
# Reads in a row that must find the server quiet: a gauge the housekeeping has not set again yet
# (its thread starved on a busy machine) is not taken for quiet after one round.
QUIET_READS = 3
# Where an API server holds requests whose energy is still to be counted: open, or closed with
# their records awaiting a response (or their expiry, counted as `unclaimed`).
PLACES = ("api_open", "api_closed")
OUTCOMES = "piep_request_outcome_joules_total"
# Counters that move until the engines have sent everything. Not piep_idle_joules_total: a
# measured-mode engine adds to it while it waits.
SETTLING = ("piep_engine_step_joules_total", OUTCOMES)

T = TypeVar("T")


def pending(text: str, previous: str | None) -> list[str]:
    """What keeps a server from being quiet in this read of its /metrics, `previous` being the
    read before it (None: the first, with nothing to compare its counters with)."""
    left = []
    tracked = by_label(text, "piep_tracked_requests", "where")
    if not tracked:
        left.append("no piep_tracked_requests on /metrics (is the plugin loaded?)")
    left += [f'piep_tracked_requests{{where="{where}"}} = {tracked[where]:g}'
             for where in PLACES if tracked.get(where, 0.0)]
    engines = by_label(text, "piep_engine_tracked_requests", "engine")
    left += [f"engine {engine} holds {n:g} requests" for engine, n in sorted(engines.items())
             if n]
    if previous is None:
        left.append("a second read of the counters")
    else:
        now, then = _settling(text), _settling(previous)
        left += [f"{name}{dict(labels)} moved from {then.get((name, labels), 0.0)!r} to {v!r}"
                 for (name, labels), v in sorted(now.items())
                 if then.get((name, labels)) != v]
    return left


def _settling(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {key: v for key, v in samples(text).items() if key[0] in SETTLING}


def wait_until_quiet(server: VllmServer, deadline_s: float = DEADLINE_S
                     ) -> tuple[str, list[str]]:
    """(/metrics, []) once the server is quiet: no request held by an API server (open, or
    closed awaiting its response) nor by an engine, and the engines' counters
    (`SETTLING`) unchanged over `QUIET_READS` reads in a row. After `deadline_s`: the last read
    and what was still pending."""
    deadline = time.monotonic() + deadline_s
    previous: str | None = None
    quiet = 0
    while True:
        text = server.get_text("/metrics")
        left = pending(text, previous)
        quiet = 0 if left else quiet + 1
        if quiet >= QUIET_READS:
            return text, []
        if time.monotonic() > deadline:
            return text, left or [f"{QUIET_READS} quiet reads in a row (had {quiet})"]
        previous = text
        time.sleep(READ_EVERY_S)


def quiet_metrics(server: VllmServer, deadline_s: float = DEADLINE_S) -> str:
    """/metrics once the server is quiet (`wait_until_quiet`); fails if it is not by the
    deadline, saying what was pending."""
    text, left = wait_until_quiet(server, deadline_s)
    assert not left, f"the server is not quiet after {deadline_s:.0f} s: {left}"
    return text


def poll(read: Callable[[], T], done: Callable[[T], bool], what: str,
         deadline_s: float = DEADLINE_S, every_s: float = READ_EVERY_S,
         show: Callable[[T], object] = lambda got: got) -> T:
    """`read()` again every `every_s` until `done` says yes of what it returned, which is
    returned; fails after `deadline_s` naming `what` it waited for and the last value read (as
    `show` puts it)."""
    deadline = time.monotonic() + deadline_s
    while True:
        got = read()
        if done(got):
            return got
        assert time.monotonic() < deadline, (
            f"{what}: not after {deadline_s:.0f} s ({show(got)!r})")
        time.sleep(every_s)


def ledger_rows(path: Path, since: float | None = None) -> tuple[dict[str, float], int]:
    """(joules by outcome, rows) of the billing ledger file at `path`, over the rows recorded at
    or after `since` (Unix seconds; None: all); none before its first commit creates it."""
    if not path.exists():
        return {}, 0
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as conn:
        after = -math.inf if since is None else since
        joules = dict(conn.execute("SELECT outcome, SUM(joules) FROM energy WHERE "
                                   "recorded_at >= ? GROUP BY outcome", (after,)))
        [(rows,)] = conn.execute("SELECT count(*) FROM energy WHERE recorded_at >= ?",
                                 (after,))
    return {outcome: float(j) for outcome, j in joules.items()}, int(rows)


def ledger_settled(server: VllmServer, path: Path, since: float | None = None,
                   deadline_s: float = DEADLINE_S) -> str:
    """/metrics of the server, quiet (`quiet_metrics`), once its billing ledger file at `path`
    holds every joule it counts: each outcome's rows sum to its counter, the idle rows reach
    piep_idle_joules_total, and the file has as many rows as piep_ledger_records_total{result=
    "written"} says were committed. `since`: the server's rows start then (the file holds an
    earlier server's too)."""
    quiet = quiet_metrics(server, deadline_s)
    counted = by_label(quiet, OUTCOMES, "outcome")
    idle = total(quiet, "piep_idle_joules_total")

    def read() -> tuple[str, list[str]]:
        text = server.get_text("/metrics")
        joules, rows = ledger_rows(path, since)
        left = [f"{outcome}: {joules.get(outcome, 0.0):g} J in the file, "
                f"{counted.get(outcome, 0.0):g} J on /metrics"
                for outcome in sorted((set(counted) | set(joules)) - {"idle"})
                if not math.isclose(joules.get(outcome, 0.0), counted.get(outcome, 0.0),
                                    rel_tol=1e-9, abs_tol=1e-12)]
        if joules.get("idle", 0.0) < idle * (1 - 1e-9):
            left.append(f"idle: {joules.get('idle', 0.0):g} J in the file, {idle:g} J on "
                        "/metrics")
        written = total(text, "piep_ledger_records_total", result="written")
        if rows != written:
            left.append(f"{rows} rows in the file, {written:g} written on /metrics")
        return text, left

    return poll(read, lambda got: not got[1], f"the ledger {path} holding what /metrics counts",
                deadline_s, show=lambda got: got[1])[0]
