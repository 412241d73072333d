"""A meter sampled while serving, so /metrics shows measured device energy beside the predicted
energy. Off unless configured (`meter` in the plugin config, or PIEP_METER).

`MeterSampler` runs a daemon thread that reads the meter's cumulative joules every
`interval_s` and adds the increments to

    piep_meter_joules_total{meter="<meter name>", source="measured"|"estimated"|"simulated"}
    piep_meter_up          1 while readings succeed, 0 before the first and after a failure

`source` is the meter's own (`Meter.source`): the CPU estimate is "estimated", never
"measured". A meter that fails to open or to read logs one warning per kind of failure, sets
`piep_meter_up` to 0 and is retried with a back-off that doubles up to `max_backoff_s`; nothing
is raised into the server. A read that fails keeps the opened meter, so its cumulative counter
still covers the failed interval when a later read succeeds.

Meter settings (`meter_factory`): the names `make_meter` accepts (`auto`, `nvml`, `rapl`,
`cpu-estimate`, `simulated`), `external:PATH` (a wall meter's CSV power log whose timestamps
are Unix epoch seconds on this host's clock), or `module:callable` returning a Meter (called
with no arguments; tests inject stand-ins this way).
"""

from __future__ import annotations

import math
import os
import threading
from typing import IO, TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from vllm_piep.meters.common import Meter, MeterError
from vllm_piep.meters.factory import MeterFactory, meter_factory
from vllm_piep.once import OnceLogger, logger

if TYPE_CHECKING:
    from vllm_piep.config import PiepConfig

class MeterSampler:
    """Reads a meter on a daemon thread and counts its joules on /metrics (module docstring).
    `start()` and `stop()` are idempotent and thread-safe; `stop()` joins the thread."""

    def __init__(self, factory: MeterFactory, label: str, interval_s: float = 1.0,
                 max_backoff_s: float = 30.0, registry: CollectorRegistry = REGISTRY) -> None:
        if interval_s <= 0 or max_backoff_s < interval_s:
            raise ValueError("need 0 < interval_s <= max_backoff_s")
        self.label = label
        self.interval_s = float(interval_s)
        self.max_backoff_s = float(max_backoff_s)
        self._factory = factory
        self._counter = Counter(
            "piep_meter_joules", "Device energy read from the serve-time meter since it "
            "started (J); source says whether the meter measures it or estimates it",
            ["meter", "source"], registry=registry)
        # livemin: with several API server processes, 0 if any live one's meter fails.
        self._up = Gauge("piep_meter_up", "1 while the serve-time meter's readings succeed, "
                         "0 before the first and after a failure", registry=registry,
                         multiprocess_mode="livemin")
        self._up.set(0)
        # A traceback only for bugs, not for a meter's own MeterError.
        self._once = OnceLogger("further failures of this kind are not logged "
                                "(piep_meter_up shows them)",
                                traceback=lambda exc: not isinstance(exc, MeterError))
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self._meter: Meter | None = None
        self._child: Counter | None = None
        self._last: float | None = None  # the meter's cumulative joules at the last reading
        self._announced = False
        self.joules = 0.0  # counted so far (what the counter holds)
        self.up = False

    @property
    def meter(self) -> Meter | None:
        """The opened meter (None until it opens)."""
        return self._meter

    def start(self) -> MeterSampler:
        with self._lock:
            if self._thread is None:
                self._stop_evt.clear()
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="piep-meter-sampler")
                self._thread.start()
        return self

    def stop(self, timeout_s: float | None = 10.0) -> None:
        """Stops and joins the thread, which stops the meter. A meter stuck in its own call
        longer than `timeout_s` is left to the daemon thread (and a warning says so)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop_evt.set()
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("vllm_piep: the serve-time meter %s did not stop within %s s",
                           self.label, timeout_s)

    def _run(self) -> None:
        delay = self.interval_s
        try:
            while not self._stop_evt.is_set():
                ok = self.sample()
                delay = self.interval_s if ok else min(self.max_backoff_s, 2 * delay)
                if self._stop_evt.wait(delay):
                    break
        finally:
            self._close()

    def sample(self) -> bool:
        """One step of the thread: open the meter if needed, read it, count the increment.
        True when a reading succeeded. Never raises. Only the thread calls it once started
        (tests may drive it by hand instead of starting the thread)."""
        if self._meter is None and not self._open():
            return self._down()
        assert self._meter is not None
        name = self._meter.name
        try:
            total = self._meter.read().total
            if not math.isfinite(total):
                raise MeterError(f"{name} read a non-finite total ({total})")
        except Exception as exc:  # noqa: BLE001  (any meter failure must stay in this thread)
            self._once.warn(f"reading the serve-time meter {name}", exc,
                            "piep_meter_up is 0 and piep_meter_joules_total pauses; retrying "
                            f"with a back-off up to {self.max_backoff_s:g} s")
            return self._down()
        last, self._last = self._last, total
        if last is not None:
            if total >= last:
                assert self._child is not None
                self._child.inc(total - last)
                self.joules += total - last
            else:  # a counter that went back (reset by its driver): never decrease ours
                self._once.warn(f"counting the serve-time meter {name}",
                                MeterError(f"cumulative joules fell from {last:g} to "
                                           f"{total:g}"), "that interval is not counted")
        if not self._announced:  # once: a flapping meter must not fill the log either
            self._announced = True
            logger.info("vllm_piep: serve-time meter %s (%s) read every %g s into "
                        "piep_meter_joules_total", name, self._meter.source, self.interval_s)
        self.up = True
        self._up.set(1)
        return True

    def _open(self) -> bool:
        meter: Meter | None = None
        try:
            meter = self._factory()
            meter.start()
        except Exception as exc:  # noqa: BLE001  (as above)
            self._once.warn(f"opening the serve-time meter {self.label}", exc,
                            "piep_meter_up is 0 and nothing is counted; retrying with a "
                            f"back-off up to {self.max_backoff_s:g} s")
            if meter is not None:
                _quietly_stop(meter)
            return False
        self._meter, self._last = meter, None
        self._child = self._counter.labels(meter=meter.name, source=meter.source)
        return True

    def _down(self) -> bool:
        self.up = False
        self._up.set(0)
        return False

    def _close(self) -> None:
        meter, self._meter = self._meter, None
        if meter is not None:
            _quietly_stop(meter)
        self._down()


def _quietly_stop(meter: Meter) -> None:
    try:
        meter.stop()
    except Exception as exc:  # noqa: BLE001  (stopping is best effort)
        logger.debug("vllm_piep: stopping meter %s: %s", meter.name, exc)


_serving: MeterSampler | None = None
_serving_lock = threading.Lock()
_sole_lock: IO[bytes] | None = None  # held for the process's life (see _sole_sampler)


def _sole_sampler() -> bool:
    """With several API server processes (PROMETHEUS_MULTIPROC_DIR set, their counters summed)
    only one may sample the devices, or /metrics would count their energy once per process:
    the first to lock a file in that directory does."""
    global _sole_lock
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory is None:
        return True
    import fcntl

    f = open(os.path.join(directory, "piep_meter.lock"), "ab")  # noqa: SIM115  (kept open)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return False
    _sole_lock = f
    return True


def start_serve_meter(config: PiepConfig, registry: CollectorRegistry = REGISTRY,
                      interval_s: float = 1.0,
                      cuda_devices: int | None = None) -> MeterSampler | None:
    """The API server's meter sampler, started; None when no meter is configured (or another
    API server process samples it). Call it once the Prometheus registry is chosen; later
    calls return the same sampler. `cuda_devices`: see `meter_factory`. None too where the
    workers meter their own devices (`meter_scope: worker`), which may be on other nodes than
    this one. Never raises."""
    global _serving
    if config.meter is None or config.meter_scope == "worker":
        return None
    with _serving_lock:
        if _serving is not None:
            return _serving
        try:
            if not _sole_sampler():
                logger.info("vllm_piep: another API server process samples the meter")
                return None
            factory, label = meter_factory(config.meter, cuda_devices)
            _serving = MeterSampler(factory, label, interval_s=interval_s,
                                    registry=registry).start()
        except Exception as exc:  # noqa: BLE001  (a metrics extra must not stop the server)
            logger.warning("vllm_piep: cannot start the serve-time meter %r (%s: %s); "
                           "/metrics has no piep_meter_* series", config.meter,
                           type(exc).__name__, exc)
            return None
        return _serving
