"""Writes ledger rows off the serving path: `put` only queues (it never blocks); a thread
commits what is queued once per flush interval (sooner when `capacity` rows wait), in one
transaction.

Bounded: at most `capacity` rows in the batch being committed and `capacity` in the queue. A
full queue (the thread is behind: a slow or failing commit) drops the row, counted
(`on_dropped`) and logged once. A failed commit (a full disk, a store locked past its timeout)
keeps its rows for the next flush, and logs once per kind of failure; serving never stops for
the ledger. A process killed with SIGKILL loses the rows of at most its last flush interval;
`close` (at exit) commits what is left.
"""

from __future__ import annotations

import atexit
import os
import queue
import secrets
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from vllm_piep.ledger.schema import LedgerRow
from vllm_piep.ledger.store import BUSY_MS, LedgerError, connect, insert
from vllm_piep.once import OnceLogger

FLUSH_S = 1.0
CAPACITY = 100_000  # rows waiting to be written; about 40 MB at most


def writer_id() -> str:
    """This process run's name in the rows' key: host, pid and a random tag."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class LedgerWriter:
    def __init__(self, path: str | Path, flush_s: float = FLUSH_S, capacity: int = CAPACITY,
                 on_written: Callable[[int], None] = lambda n: None,
                 on_dropped: Callable[[int], None] = lambda n: None) -> None:
        self.path = Path(path)
        self.flush_s = flush_s
        self.writer = writer_id()
        self._capacity = capacity
        self._queue: queue.Queue[LedgerRow | None] = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self._closed = False
        self._on_written, self._on_dropped = on_written, on_dropped
        self._once = OnceLogger(further="further failures of this kind are counted in "
                                "piep_ledger_records_total{result=\"dropped\"}, not logged",
                                traceback=lambda exc: False)
        self._seq = 0
        self._pending: list[LedgerRow] = []
        self._conn: sqlite3.Connection | None = None  # opened on the thread, off the loop
        self._thread = threading.Thread(target=self._run, name="piep-ledger-writer",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def put(self, row: LedgerRow) -> None:
        """Queue a row; never blocks."""
        if self._closed:
            self._on_dropped(1)
            return
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self._on_dropped(1)
            self._once.warn("queueing a billing ledger row",
                            RuntimeError(f"{self._capacity} rows wait to be written"),
                            "the row is dropped")

    def close(self) -> None:
        """Commit what is queued and stop (idempotent); rows put later are dropped, counted."""
        self._closed = True
        if self._thread.is_alive():
            self._stop.set()
            try:
                self._queue.put_nowait(None)  # wakes the thread at once
            except queue.Full:
                pass  # it is not waiting for rows
            self._thread.join(self.flush_s + BUSY_MS / 1000 + 5.0)

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if len(self._pending) >= self._capacity:  # a failing store: retry, take no more
                self._stop.wait(self.flush_s)
            deadline = time.monotonic() + (0.0 if stopping else self.flush_s)
            while len(self._pending) < self._capacity:
                left = deadline - time.monotonic()
                try:
                    row = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if row is not None:
                    self._pending.append(row)
            committed = self._flush()
            if stopping and (not committed or self._queue.empty()):
                left_over = len(self._pending) + self._queue.qsize()
                if left_over:  # the store failed to the end
                    self._on_dropped(left_over)
                if self._conn is not None:
                    self._conn.close()
                return

    def _flush(self) -> bool:
        """Commit the pending rows; False if the store failed (they stay pending)."""
        if not self._pending:
            return True
        rows = self._pending = coalesce(self._pending)
        try:
            if self._conn is None:
                self._conn = connect(self.path)
            insert(self._conn, self.writer, self._seq, rows)
        except (sqlite3.OperationalError, LedgerError) as exc:  # a full disk, a lock: retry
            self._once.warn(f"writing the billing ledger {self.path}", exc,
                            "its rows are kept for the next flush")
            return False
        except Exception as exc:  # boundary: a row the store refuses must not block the rest
            self._once.warn(f"writing a billing ledger row to {self.path}", exc,
                            "the rows it refuses are dropped, one by one")
            return self._flush_one_by_one()
        self._seq += len(rows)
        self._on_written(len(rows))
        self._pending = []
        return True

    def _flush_one_by_one(self) -> bool:
        assert self._conn is not None
        while self._pending:
            row = self._pending[0]
            try:
                insert(self._conn, self.writer, self._seq, [row])
            except sqlite3.OperationalError:
                return False
            except Exception:  # noqa: BLE001  (this row only: counted, logged above)
                self._on_dropped(1)
            else:
                self._seq += 1
                self._on_written(1)
            del self._pending[0]
        return True


def coalesce(rows: list[LedgerRow]) -> list[LedgerRow]:
    """Engine rows of one engine, outcome, source, bundle and meter summed into one (a header
    per step may carry them); request rows kept as they are, in order."""
    out: list[LedgerRow] = []
    engine: dict[tuple, int] = {}
    for row in rows:
        if row.kind != "engine":
            out.append(row)
            continue
        key = (row.engine, row.outcome, row.source, row.bundle, row.meter)
        at = engine.get(key)
        if at is None:
            engine[key] = len(out)
            out.append(row)
            continue
        first = out[at]
        out[at] = msgspec.structs.replace(
            first, joules=first.joules + row.joules, recorded_at=row.recorded_at,
            gco2e=None if first.gco2e is None and row.gco2e is None
            else (first.gco2e or 0.0) + (row.gco2e or 0.0))
    return out
