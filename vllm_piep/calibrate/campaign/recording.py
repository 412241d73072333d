"""What the meter measures around an attempt: its readings logged all along by a thread,
and the idle window after the server is ready."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from vllm_piep.calibrate.campaign.state import IdleWindow, write_atomic
from vllm_piep.clock import now_ns  # CLOCK_MONOTONIC: the clock of span files and meter logs
from vllm_piep.meters.common import Meter, MeterError


class MeterRecording:
    """The meter started and its readings logged to `path` by a daemon thread, until `stop()`.
    `check()` raises once the logging thread has died: cells measured after that would have no
    energy."""

    def __init__(self, meter: Meter, path: Path, interval_s: float,
                 extra: dict[str, Any]) -> None:
        self.meter, self.path = meter, path
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._record, args=(interval_s, extra),
                                        name="piep-campaign-meter", daemon=True)

    def _record(self, interval_s: float, extra: dict[str, Any]) -> None:
        from vllm_piep.meters.log import record
        try:
            record(self.meter, self.path, interval_s, self._stop, extra)
        except Exception as exc:  # noqa: BLE001  (reported by check())
            self._error = exc

    def start(self) -> None:
        self.meter.start()
        self._thread.start()

    def check(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise MeterError(f"the {self.meter.name} meter stopped logging to {self.path}: "
                             f"{self._error!r}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.meter.stop()


def measure_idle(seconds: float, path: Path) -> IdleWindow:
    """A window with the server ready and no request: its energy is the static baseline."""
    start = now_ns()
    time.sleep(seconds)
    end = now_ns()
    idle = IdleWindow(start_ns=start, end_ns=end, seconds=(end - start) / 1e9)
    write_atomic(path, idle.model_dump_json(indent=1).encode())
    return idle
