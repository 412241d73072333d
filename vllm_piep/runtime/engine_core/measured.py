"""Engine core, measured mode: the meter decides each step's energy, the model its split.

`EngineMeter` reads the instance's meter on a thread of its own (off the engine loop) every
`period_s` (the meter's update period, 5-100 ms) into the accountant's `IntervalSplitter`
(`vllm_piep.meters.split`). The steps the readings cover are settled where each batch of outputs
is accounted (`settle_in_loop`: off the engine loop's critical path, `deferred.py`);
when the engine is idle the meter thread settles them itself.

The settlement rule for a finishing request: its final output waits in the engine core until a
reading after its last step has been split (`hold`), then goes out with its measured energy.
A reading taken while a later step runs can be split only once that step has ended (its
interval holds part of that step), so the wait is about one meter period plus the step running
then (the README states the bound). A meter that fails, stalls (its counter unchanged for
`stall_s` while steps run) or goes back settles the waiting steps by the fit
(`IntervalSplitter.fallback`): those responses say `fitted`, the fallback is counted in the
header and logged once, no request fails. A held output whose steps no reading covers after
`hold_s` of engine time known since it was held (a meter slower than it said) is the same
fallback; a long step is not the meter's delay and does not count. A reading whose meter
estimated part of it (a worker's meter that cannot be read, `WorkerMeter`) is split as any
other; the steps it covers take that fraction as estimated, and their responses say `fitted`.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import psutil

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import Meter, MeterError, NoMeter, refuse_shared_boards
from vllm_piep.meters.split import IntervalSplitter
from vllm_piep.once import OnceLogger, logger
from vllm_piep.runtime.engine_core.accountant import EngineAccountant

_MIN_PERIOD_S, _MAX_PERIOD_S, _DEFAULT_PERIOD_S = 0.005, 0.1, 0.02
_FLUSH_NS = 1_000_000_000
_LOOK_NS = 10_000_000_000  # how often the meter thread lists the metered GPUs' processes


# The engine's reason for prediction mode where nothing here measures (`piep_engine_measured`).
NO_MEASURING_METER = "no measuring meter"


class HeldOutput(NamedTuple):
    client: int
    output: Any  # vLLM's EngineCoreOutput of a finished request
    since_ns: int


class EngineMeter:
    """The engine's meter thread and its held outputs (module docstring)."""

    def __init__(self, acc: EngineAccountant, factory: Callable[[], Meter], label: str,
                 idle_watts: Callable[[], float | None],
                 put_outputs: Callable[[int, list[Any]], None] | None = None,
                 flush: Callable[[], None] | None = None,
                 period_s: float | None = None, clock: Callable[[], int] = now_ns) -> None:
        self.acc = acc
        self.label = label
        self._factory = factory
        self._idle_watts = idle_watts
        self.put_outputs = put_outputs  # (client, outputs) into the engine's output queue
        self._flush = flush  # sends the counts not yet sent (the idle engine's energy)
        self._flushed_ns = 0
        self._period_s = period_s
        self._clock = clock
        self.held: list[HeldOutput] = []
        self.meter: Meter | None = None
        self.period_s = _DEFAULT_PERIOD_S
        self.hold_s = 5 * _DEFAULT_PERIOD_S
        self.stall_s = 1.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_value: float | None = None
        self._changed_ns = 0
        self._down = False
        self._looked_ns = 0
        self._shared_said = False
        self._once = OnceLogger("further failures of this kind are not logged (the responses "
                                "say `fitted`; piep_meter_fallback_steps_total counts them)",
                                traceback=lambda exc: not isinstance(exc, MeterError))

    # -- thread -------------------------------------------------------------------------------
    def start(self) -> EngineMeter:
        self._thread = threading.Thread(target=self._run, name="piep-engine-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def open(self) -> bool:
        """Open the meter and switch the accountant to measured mode; False (logged once) if
        the meter cannot serve: the engine stays in prediction mode."""
        try:
            meter = self._factory()
            meter.start()
            try:
                refuse_shared_boards(meter)
            except MeterError:
                meter.stop()
                raise
        except Exception as exc:  # noqa: BLE001  (no meter: prediction mode, said once)
            return self._cannot_open(exc)
        resolution = float(getattr(meter, "resolution_s", 0.0) or 0.0)
        period = self._period_s or (resolution if resolution > 0 else _DEFAULT_PERIOD_S)
        self.period_s = min(_MAX_PERIOD_S, max(_MIN_PERIOD_S, period))
        self.hold_s = max(5 * self.period_s, 2 * resolution)
        self.stall_s = max(1.0, 10 * max(resolution, self.period_s))
        idle = self._idle_watts()  # loads the predictor, which can take a while
        splitter = IntervalSplitter(idle if idle is not None and math.isfinite(idle) else 0.0)
        # The base reading and the switch under the accountant's lock, after everything slow:
        # no step is accounted between them, so every step after the base is the meter's and
        # every step before it the model's.
        with self.acc.lock:
            try:
                first = meter.read()
            except Exception as exc:  # noqa: BLE001  (a meter that cannot read: as above)
                with contextlib.suppress(Exception):  # its failure is the one said
                    meter.stop()
                return self._cannot_open(exc)
            splitter.add_reading(first.t_ns, first.total, first.fitted)
            self._last_value, self._changed_ns = first.total, first.t_ns
            self.meter = meter
            self.acc.meter_note = None
            self.acc.measure_with(splitter, meter.name, meter.source)
        self._look_for_others(first.t_ns)
        devices = ", ".join(f"{d.name} ({d.note})" if d.note else d.name
                            for d in meter.devices())
        logger.info("vllm_piep: measured mode: the %s meter (%s, read every %.0f ms) on %s "
                    "decides each step's energy, the model its split among the requests; a "
                    "finished request's response waits for the meter's next reading and the "
                    "step running then (~%.0f ms plus that step; after %.0f ms of engine time "
                    "without a reading, the fit settles it). Energy is counted from its "
                    "reading of %r J.", meter.name, meter.source,
                    self.period_s * 1e3, devices,
                    (self.period_s + max(resolution, self.period_s)) * 1e3, self.hold_s * 1e3,
                    first.total)
        return True

    def _cannot_open(self, exc: BaseException) -> bool:
        """Prediction mode, said once (False, for `open`)."""
        if isinstance(exc, NoMeter):  # the usual CPU case
            logger.info("vllm_piep: prediction mode: %s", exc)
            self.acc.meter_note = NO_MEASURING_METER
        else:
            self._once.warn(f"opening the meter {self.label} for measured energy", exc,
                            "responses carry the model's prediction")
            self.acc.meter_note = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return False

    def _look_for_others(self, now_ns: int) -> None:
        """Other processes on the metered GPUs (NVML's process lists; this process and its
        children are the instance's): their energy is in the meter's. Said once when first
        seen; the state goes out with every header."""
        self._looked_ns = now_ns
        look = getattr(self.meter, "other_processes", None)
        if look is None:
            return
        try:
            own = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
            others = look(own)
        except Exception as exc:  # noqa: BLE001  (a look that fails: cannot tell)
            logger.debug("vllm_piep: listing the GPUs' processes: %s", exc)
            others = None
        self.acc.meter_shared = -1 if others is None else len(others)
        if others and not self._shared_said:
            self._shared_said = True
            logger.warning(
                "vllm_piep: %d other process(es) (pids %s) run on the GPUs the %s meter reads; "
                "it reads whole boards, so their energy is split among this instance's "
                "requests: responses say meter_shared: true, piep_engine_meter_shared counts "
                "them. Meter one instance per GPU (or use MIG and prediction mode) to bill "
                "only yours.", len(others), ", ".join(map(str, others[:8])), self.label)

    def _run(self) -> None:
        if not self.open():
            return
        try:
            while not self._stop.wait(self.period_s):
                self.tick()
        finally:
            meter, self.meter = self.meter, None
            if meter is not None:
                try:
                    meter.stop()
                except Exception as exc:  # noqa: BLE001  (stopping is best effort)
                    logger.debug("vllm_piep: stopping meter %s: %s", self.label, exc)

    def tick(self) -> None:
        """One reading; with the engine idle, settle and send what waited. Never raises."""
        try:
            self._read()
            if self._clock() - self._looked_ns > _LOOK_NS:
                self._look_for_others(self._clock())
            acc = self.acc
            with acc.lock:
                acc.deferred.run()  # the loop's queued steps: the state settled below
                if not acc.steps_in_flight():  # idle: no step will come to settle them
                    acc.settle()
                    self._expire_holds()
                    self.send(self.releasable())
                    now = self._clock()
                    # The idle energy reaches /metrics about once a second, not per reading.
                    if self._flush is not None and now - self._flushed_ns > _FLUSH_NS:
                        self._flushed_ns = now
                        self._flush()
        except Exception as exc:  # noqa: BLE001  (a bug here must not stop the thread)
            self._once.warn("settling measured energy", exc, "steps are settled by the fit")

    def _read(self) -> None:
        acc, meter = self.acc, self.meter
        assert meter is not None and acc.splitter is not None
        try:
            reading = meter.read()
            value = reading.total
            if not math.isfinite(value):
                raise MeterError(f"{meter.name} read a non-finite total ({value})")
        except Exception as exc:  # noqa: BLE001  (any meter failure stays here)
            self._once.warn(f"reading the meter {meter.name}", exc,
                            "the steps it cannot speak for are settled by the fit")
            self._fall_back()
            return
        now = reading.t_ns
        if value != self._last_value:
            if self._last_value is not None and value < self._last_value:
                self._once.warn(
                    f"reading the meter {meter.name} (a counter going back)",
                    MeterError(f"its counter went back from {self._last_value:g} to {value:g} "
                               "J (a driver reset?)"),
                    "the steps of that interval are settled by the fit")
            self._last_value, self._changed_ns = value, now
            self._down = False
            with acc.lock:
                acc.splitter.add_reading(now, value, reading.fitted)
            return
        # An unchanged counter is not a reading of "no energy since": NVML updates its counter
        # every few to ~100 ms, and that energy shows at its next update.
        if (now - self._changed_ns) / 1e9 > self.stall_s and acc.splitter.pending:
            if not self._down:
                self._once.warn(
                    f"reading the meter {meter.name} (a stalled counter)",
                    MeterError(f"its counter has not moved for {self.stall_s:g} s while steps "
                               "ran"), "those steps are settled by the fit until it moves")
            self._fall_back()

    def _fall_back(self) -> None:
        self._down = True
        self._last_value = None  # the next value that comes re-bases the meter
        acc = self.acc
        with acc.lock:
            acc.deferred.run()
            acc.settle(fallback_until_ns=acc.known_until_ns())

    # -- held outputs -------------------------------------------------------------------------
    def hold(self, client: int, output: Any) -> None:
        acc = self.acc
        acc.waiting.add(output.request_id)
        self.held.append(HeldOutput(client, output, self._clock()))

    def _expire_holds(self) -> None:
        """Held outputs whose steps no reading has covered after `hold_s` of known engine time
        (a meter slower than it said): settle by the fit. Known time (now when idle, else the
        end of the last step done), not wall time: a reading taken during a step waits for
        that step's end, however long it runs, without the meter being late."""
        acc = self.acc
        waiting = next((h for h in self.held if acc.unsettled(h.output.request_id)),
                       None)
        if waiting is None:
            return
        known = acc.known_until_ns()
        if (known - waiting.since_ns) / 1e9 > self.hold_s:
            self._once.warn(f"waiting for the meter {self.label}", MeterError(
                f"a finished request waited over {self.hold_s * 1e3:.0f} ms of engine time "
                "for a reading"), "its last steps are settled by the fit")
            acc.settle(fallback_until_ns=known)

    def releasable(self) -> list[HeldOutput]:
        """Held outputs whose steps are all settled, taken out of `held`. Lock held."""
        if not self.held:
            return []
        acc = self.acc
        ready = [h for h in self.held if not acc.unsettled(h.output.request_id)]
        if ready:
            self.held = [h for h in self.held if acc.unsettled(h.output.request_id)]
            for h in ready:
                acc.waiting.discard(h.output.request_id)
        return ready

    def settle_in_loop(self) -> list[HeldOutput]:
        """After a step (engine loop, lock held): settle what the readings cover; the held
        outputs now ready, to go out with this step's outputs."""
        self.acc.settle()
        self._expire_holds()
        return self.releasable()

    def send(self, ready: list[HeldOutput]) -> None:
        """Held outputs out on their own (lock held), or back to waiting without a queue."""
        if not ready:
            return
        if self.put_outputs is None:  # no queue to send them on: keep them for the loop
            self.held[:0] = ready
            for h in ready:
                self.acc.waiting.add(h.output.request_id)
            return
        by_client: dict[int, list[Any]] = {}
        for h in ready:
            by_client.setdefault(h.client, []).append(h.output)
        for client, outputs in by_client.items():
            self.put_outputs(client, outputs)
