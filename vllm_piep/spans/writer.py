"""The span writer: one rank's records appended to its JSONL file from a background thread."""

from __future__ import annotations

import atexit
import json
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_piep.once import logger
from vllm_piep.spans.records import SpanHeader, header_json


class SpanWriter:
    """Appends records to one JSONL file from a background thread, so that the step loop only
    appends a dict to a deque. Whole lines go out in one `write` with O_APPEND: a crash leaves at
    most one partial last line, which the reader skips."""

    def __init__(self, path: str | Path, header: SpanHeader, flush_interval_s: float = 0.2):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, (header_json(header) + "\n").encode())
        # Dicts, or callables returning lists of dicts: turning a step into records (and
        # resolving GPU events) happens here, off the step loop.
        self._pending: deque[dict[str, Any] | Callable[[], list[dict[str, Any]]]] = deque()
        self._interval = flush_interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.written = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="piep-span-writer", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, SpanWriter._close_quietly, weakref.ref(self))
        atexit.register(self.close)

    def put(self, record: dict[str, Any] | Callable[[], list[dict[str, Any]]]) -> None:
        self._pending.append(record)  # deque.append is atomic: no lock on the hot path

    def flush(self) -> None:
        with self._lock:
            if self._fd < 0:
                return
            lines = []
            while self._pending:
                item = self._pending.popleft()
                try:
                    records = item() if callable(item) else (item,)
                    lines.extend(json.dumps(r, separators=(",", ":")) for r in records)
                except Exception as exc:  # one bad step must not stop the file
                    self.failures += 1
                    if self.failures == 1:
                        logger.warning("vllm_piep: could not write a step's spans to %s "
                                       "(%s: %s); skipping such steps", self.path,
                                       type(exc).__name__, exc, exc_info=exc)
            if lines:
                os.write(self._fd, ("\n".join(lines) + "\n").encode())
                self.written += len(lines)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.flush()
        with self._lock:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        atexit.unregister(self.close)

    @staticmethod
    def _close_quietly(ref: weakref.ref[SpanWriter]) -> None:
        writer = ref()
        if writer is not None:
            writer.close()
