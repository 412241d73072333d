"""Resource features (PIE-P Table 1, IrEne §A.3): CPU and GPU utilization, memory
utilization, clocks and memory bytes, sampled by one background thread per process at a bounded
rate into a bounded buffer, then averaged over span windows and aggregated across ranks
(mean, std, min, max). No vLLM imports; GPUs are read through an NVML-like library object
(`pynvml`, or a stand-in in tests)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import psutil

from vllm_piep.clock import now_ns

MIN_INTERVAL_S = 0.01  # bounded rate: at most 100 samples a second
CPU_FEATURES = ("cpu_util", "cpu_mem_util", "cpu_clock_mhz", "process_rss_bytes")
GPU_FEATURES = ("gpu_util", "gpu_mem_util", "gpu_clock_mhz", "gpu_mem_clock_mhz",
                "gpu_mem_bytes")


def cpu_sample(process: psutil.Process) -> dict[str, float]:
    freq = psutil.cpu_freq()
    return {"cpu_util": psutil.cpu_percent(interval=None),
            "cpu_mem_util": psutil.virtual_memory().percent,
            "cpu_clock_mhz": float(freq.current) if freq else float("nan"),
            "process_rss_bytes": float(process.memory_info().rss)}


def gpu_sample(nvml: Any, handles: Sequence[Any]) -> dict[str, float]:
    """Means over this process's GPUs (a rank usually has one)."""
    rows = []
    for h in handles:
        util = nvml.nvmlDeviceGetUtilizationRates(h)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        rows.append((float(util.gpu), float(util.memory),
                     float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                     float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM)),
                     float(mem.used)))
    means = np.mean(np.array(rows), axis=0) if rows else [float("nan")] * len(GPU_FEATURES)
    return dict(zip(GPU_FEATURES, map(float, means), strict=True))


class ResourceSampler:
    """`with ResourceSampler(interval_s=0.05) as s: ...; s.frame()` -- one background thread;
    the buffer keeps the last `max_samples` samples (older ones are dropped, counted in
    `dropped`). A failing GPU read stops GPU sampling (recorded in `gpu_error`), not the rest."""

    def __init__(self, interval_s: float = 0.05, max_samples: int = 20_000,
                 nvml: Any = None, gpu_indices: Sequence[int] = (),
                 cpu_reader: Callable[[], Mapping[str, float]] | None = None,
                 on_sample: Callable[[int, dict[str, float]], None] | None = None):
        self.interval_s = max(interval_s, MIN_INTERVAL_S)
        self._buffer: deque[tuple[int, dict[str, float]]] = deque(maxlen=max_samples)
        self.dropped = 0
        self._nvml = nvml
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in gpu_indices] if nvml else []
        process = psutil.Process()
        self._cpu = cpu_reader or (lambda: cpu_sample(process))
        self.gpu_error: str | None = None
        self._on_sample = on_sample  # e.g. into the rank's span file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        values = dict(self._cpu())
        if self._handles and self.gpu_error is None:
            try:
                values.update(gpu_sample(self._nvml, self._handles))
            except Exception as exc:  # a GPU that stopped answering: keep the CPU features
                self.gpu_error = f"{type(exc).__name__}: {exc}"
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        t = now_ns()
        self._buffer.append((t, values))
        if self._on_sample is not None:
            self._on_sample(t, values)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if self._thread is not None:
            return
        psutil.cpu_percent(interval=None)  # the first call only sets psutil's reference point
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="piep-resources", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> ResourceSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def frame(self) -> pd.DataFrame:
        """The buffered samples: one row each, `t_ns` and one column per feature."""
        items = list(self._buffer)
        return pd.DataFrame([{"t_ns": t, **v} for t, v in items])


def window_features(samples: pd.DataFrame, start_ns: int, end_ns: int) -> dict[str, float]:
    """Mean of each feature over the samples inside [start, end]; a window shorter than the
    sampling period, holding none, takes the last sample before its end."""
    if samples.empty:
        return {}
    inside = samples[(samples["t_ns"] >= start_ns) & (samples["t_ns"] <= end_ns)]
    if inside.empty:
        before = samples[samples["t_ns"] <= end_ns]
        inside = before.tail(1) if not before.empty else samples.head(1)
    return {c: float(inside[c].mean()) for c in samples.columns if c != "t_ns"}


def across_ranks(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """PIE-P's aggregation of runtime features from several ranks: `<feature>_mean`, `_std`
    (population), `_min`, `_max`."""
    out: dict[str, float] = {}
    features = sorted({k for r in per_rank for k in r})
    for feature in features:
        values = np.array([r[feature] for r in per_rank if feature in r], dtype=np.float64)
        out[f"{feature}_mean"] = float(values.mean())
        out[f"{feature}_std"] = float(values.std())
        out[f"{feature}_min"] = float(values.min())
        out[f"{feature}_max"] = float(values.max())
    return out
