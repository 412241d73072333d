"""A load that keeps the device busy while the NVML section reads the counter and the power."""

from __future__ import annotations

import threading
from typing import Any

from vllm_piep.tools.gpu_check.backend import Burner


class BackgroundLoad:
    """Matmuls on a thread until stopped, synchronised every ~`chunk_s` so that the host never
    runs far ahead of the GPU."""

    def __init__(self, burner: Burner, chunk_s: float = 0.05) -> None:
        self.burner = burner
        self.ops = burner.ops_for(chunk_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-check-load", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.burner.run(self.ops)
                self.burner.backend.sync()
        except BaseException as exc:  # noqa: BLE001  (reported by the caller)
            self.error = exc

    def __enter__(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
