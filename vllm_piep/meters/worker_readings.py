"""Meters that run in vLLM's worker processes, read together by the engine core as one meter
(`meter_scope: worker`): each worker reads the GPUs it drives, on whatever node it runs.

A worker's `ReadingSender` reads its own meter every period on a thread of its own and sends
`(rank, Unix time ns, joules per device)` over a ZeroMQ PUSH socket to the engine core's
`ReadingSink` (TCP, so that workers on other nodes reach it too; a meter that fails sends its
error instead). The address carries a random token that every message must repeat: the sink
drops anything else that reaches its port. Unix time, not the host's monotonic clock: it is
the clock that hosts share (NTP keeps them within about a millisecond); the sink converts each
reading to the engine's own clock (`vllm_piep.clock`) when it arrives.

`WorkerMeter.read()` gives every rank's counter at one instant: the latest that every rank has
a reading at or after, so that no counter is extrapolated; a rank's counter between two of its
readings is interpolated linearly. The differences of consecutive readings therefore add up,
over the ranks, to their counters' own rises: nothing lost, nothing counted twice. A rank whose
meter fails, or that has sent nothing for `stall_s`, has its energy estimated from the other
ranks' at the share it drew while every rank was read: the reading counts the estimate as
`fitted`, so the responses of the steps it covers say `fitted` and the other ranks stay
measured. Only when no rank can be read does `read()` raise `MeterError` (the engine's meter
thread then settles the steps by the fit, `runtime/engine_core/measured.py`). A worker whose
read failed tries again every second; its next good reading puts it back.
No vLLM imports.
"""

from __future__ import annotations

import bisect
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence

import msgspec

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import (
    Device,
    DeviceKind,
    Meter,
    MeterError,
    MeterReading,
    Source,
    least_measured,
    refuse_shared_boards,
)
from vllm_piep.once import logger

# The environment variable that tells a worker where to send its readings (set by the engine
# core before it starts its workers; Ray copies the `PIEP_` variables to its workers).
SINK_ENV = "PIEP_WORKER_METER_SINK"
# A worker's global rank, set in its environment before its meter is built: a `module:callable`
# meter reads it to know which of the node's devices, or which stand-in, it is.
RANK_ENV = "PIEP_WORKER_RANK"
_KEEP = 256  # readings kept per rank: the instant read lags the newest by a period or two


class WorkerReading(msgspec.Struct, array_like=True):
    """One worker's message: its counter per device at `t_unix_ns`, or why it has none;
    `token`, the sink's, so that nothing else on the network can add readings."""

    token: str
    rank: int
    t_unix_ns: int
    joules: dict[str, float]
    meter: str
    source: str
    resolution_s: float
    error: str | None = None


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(WorkerReading).decode


def unix_to_local(t_unix_ns: int) -> int:
    """A Unix time in this process's monotonic clock (`vllm_piep.clock`)."""
    return t_unix_ns - (time.time_ns() - now_ns())


class ReadingSender:
    """A worker's meter, read every `period_s` and sent to the engine core's sink: `address`,
    or what `address()` gives on the sender's thread (None: no sink, nothing is sent), then
    `on_address(address)`."""

    def __init__(self, address: str | Callable[[], str | None], rank: int,
                 make_meter: Callable[[], Meter], period_s: float = 0.02,
                 on_address: Callable[[str], None] | None = None) -> None:
        self._address = address
        self._on_address = on_address
        self.address = self.token = ""
        if isinstance(address, str):
            self.address, _, self.token = address.partition("#")
        self.rank = rank
        self._make_meter = make_meter
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0

    def start(self) -> ReadingSender:
        self._thread = threading.Thread(target=self._run, name="piep-worker-meter",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        import zmq

        if not isinstance(self._address, str):
            try:
                found = self._address()
            except Exception as exc:  # noqa: BLE001  (no sink: this worker does not meter)
                logger.warning("vllm_piep: worker rank %d found no address for its meter "
                               "readings (%s): it does not meter itself", self.rank,
                               f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                return
            if found is None:
                return
            self.address, _, self.token = found.partition("#")
        if self._on_address is not None:
            self._on_address(self.address)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(self.address)

        def send(message: WorkerReading) -> None:
            try:  # never blocks: with the engine core gone, readings are dropped
                sock.send(_encode(message), zmq.NOBLOCK)
            except zmq.Again:
                pass

        meter: Meter | None = None
        try:
            try:
                meter = self._make_meter()
                meter.start()
                refuse_shared_boards(meter)
                period = max(self.period_s, float(meter.resolution_s or 0.0) / 2)
            except Exception as exc:  # noqa: BLE001  (said to the engine core, which falls back)
                send(self._failed(exc, meter))
                return
            while True:
                try:
                    r = meter.read()
                    # The reading's own time, in Unix time: its monotonic stamp moved by this
                    # host's offset between the two clocks.
                    t_unix = r.t_ns + (time.time_ns() - now_ns())
                    message = WorkerReading(self.token, self.rank, t_unix, dict(r.joules),
                                            meter.name, meter.source,
                                            float(meter.resolution_s or 0.0))
                except Exception as exc:  # noqa: BLE001  (as above)
                    message = self._failed(exc, meter)
                send(message)
                self.sent += 1
                # after a failed read, the next try a second later (the engine core settles
                # by the fit meanwhile, and takes the readings again once they come)
                if self._stop.wait(period if message.error is None else max(period, 1.0)):
                    return
        finally:
            if meter is not None:
                try:
                    meter.stop()
                except Exception:  # noqa: BLE001  (stopping is best effort)
                    pass
            sock.close()

    def _failed(self, exc: BaseException, meter: Meter | None) -> WorkerReading:
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return WorkerReading(self.token, self.rank, time.time_ns(), {},
                             meter.name if meter is not None else "?", "measured", 0.0, why)


class _Rank:
    __slots__ = ("t", "joules", "meter", "source", "resolution_s", "error", "seen_ns",
                 "series")

    def __init__(self) -> None:
        self.series = 0  # counts the errors: readings after one are a new series
        self.t: deque[int] = deque(maxlen=_KEEP)  # local monotonic ns, non-decreasing
        self.joules: deque[dict[str, float]] = deque(maxlen=_KEEP)
        self.meter = "?"
        self.source = "measured"
        self.resolution_s = 0.0
        self.error: str | None = None
        self.seen_ns = 0

    def at(self, t: int) -> dict[str, float]:
        """The counter per device at `t` (within the readings held), interpolated."""
        times = self.t
        i = bisect.bisect_left(times, t)
        if i < len(times) and times[i] == t:
            return self.joules[i]
        a, b = self.joules[i - 1], self.joules[i]
        w = (t - times[i - 1]) / (times[i] - times[i - 1])
        return {d: a[d] + (b.get(d, a[d]) - a[d]) * w for d in a}


class RankReadings:
    """Each worker's readings, filed by rank (`add`: the sink's thread; tests call it)."""

    def __init__(self, token: str = "", to_local: Callable[[int], int] = unix_to_local,
                 clock: Callable[[], int] = now_ns) -> None:
        self.token = token
        self._to_local = to_local
        self.clock = clock
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        self.ranks: dict[int, _Rank] = {}

    def add(self, m: WorkerReading) -> None:
        if m.token != self.token:
            return  # not one of this engine's workers
        with self.lock:
            rank = self.ranks.setdefault(m.rank, _Rank())
            rank.seen_ns = self.clock()
            rank.meter, rank.source, rank.resolution_s = m.meter, m.source, m.resolution_s
            if m.error is not None:
                rank.error = m.error
                rank.series += 1
                rank.t.clear()  # what comes after is read afresh (the counter may have reset)
                rank.joules.clear()
            else:
                rank.error = None
                t = self._to_local(m.t_unix_ns)
                if rank.t and t < rank.t[-1]:
                    t = rank.t[-1]  # a clock step back on the worker's host: keep the order
                rank.t.append(t)
                rank.joules.append(m.joules)
            self.arrived.notify_all()


class ReadingSink:
    """The engine core's end: a PULL socket bound on `host` (a free port), and a thread that
    files each worker's readings (`readings`)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        import zmq

        self.readings = RankReadings(secrets.token_hex(16))
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 65536)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        # what a worker's `ReadingSender` is given (`SINK_ENV`)
        self.address = f"tcp://{host}:{port}#{self.readings.token}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="piep-worker-readings",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                try:
                    self.readings.add(_decode(self._sock.recv()))
                except msgspec.DecodeError:
                    continue  # not a worker's reading: ignored
        finally:
            self._sock.close()


def _kind(device: str) -> DeviceKind:
    """A device's kind from the name its meter gives it (`gpu0`, `package-0`, `dram-0`)."""
    for prefix, kind in (("gpu", "gpu"), ("package", "cpu"), ("cpu", "cpu"), ("dram", "dram")):
        if device.startswith(prefix):
            return kind  # type: ignore[return-value]
    return "system"


class WorkerMeter(Meter):
    """The ranks' meters as one (module docstring): devices `rank<r>:<device>`.

    Each reading's counter per device is the sum of its rises between the instants read, so it
    goes on rising where a rank's series breaks. A rank that cannot be read at an instant (its
    meter failed, it sent nothing for `stall_s`, its readings start after that instant or its
    counter went back) has its rise over that interval estimated from the ranks read: the
    others' rise times the share of the engine's energy its devices drew over the intervals
    when every rank was read (exponentially weighted, half-life `share_half_life` readings).
    The estimate is counted in the reading's `fitted`, so the steps it covers say `fitted`;
    the rank is read again from its next good reading on. Only when no rank can be read, or a
    failed rank has no measured share yet, does `read()` raise `MeterError` (the engine then
    settles its steps by the fit).
    """

    name = "workers"
    source: Source = "measured"

    def __init__(self, readings: RankReadings, ranks: Sequence[int], start_s: float = 30.0,
                 stall_s: float = 2.0, on_stop: Callable[[], None] | None = None,
                 share_half_life: float = 500.0) -> None:
        self.readings = readings
        self._on_stop = on_stop
        self.expected = tuple(ranks)
        self.start_s = start_s
        self.stall_s = stall_s
        self.resolution_s = 0.0
        self._decay = 0.5 ** (1.0 / share_half_life)
        self._t: int | None = None  # the instant of the last reading
        # Per rank, its counter per device at `_t` and the series it was on (None: not read).
        self._at: dict[int, tuple[int, dict[str, float]] | None] = {}
        self._devices: dict[int, list[str]] = {}  # each rank's devices, as last read
        self._total: dict[str, float] = {}  # the reading's counter per device
        self._fitted = 0.0
        self._share: dict[str, float] = {}  # decayed rises per device, every rank read
        self._estimating: dict[int, str] = {}  # the ranks estimated now, and why

    @classmethod
    def available(cls) -> bool:
        return True

    def start(self) -> None:
        """Wait until every rank has sent a reading (MeterError naming those that did not, or
        the first rank whose meter failed)."""
        sink = self.readings
        with sink.lock:
            sink.arrived.wait_for(lambda: self._failed() is not None or all(
                sink.ranks.get(r) is not None and sink.ranks[r].t for r in self.expected),
                self.start_s)
            failed = self._failed()
            if failed is not None:
                raise MeterError(f"the meter of worker rank {failed[0]} failed: {failed[1]}")
            missing = [r for r in self.expected if r not in sink.ranks or not sink.ranks[r].t]
            if missing:
                raise MeterError(f"no reading from the meter of worker rank(s) "
                                 f"{', '.join(map(str, missing))} within {self.start_s:g} s")
            ranks = [sink.ranks[r] for r in self.expected]
            names = sorted({r.meter for r in ranks})
            self.name = f"workers ({', '.join(names)})"
            self.source = least_measured(r.source for r in ranks)
            self.resolution_s = max(r.resolution_s for r in ranks)

    def _failed(self) -> tuple[int, str] | None:
        for r in self.expected:
            rank = self.readings.ranks.get(r)
            if rank is not None and rank.error is not None:
                return r, rank.error
        return None

    def devices(self) -> Sequence[Device]:
        with self.readings.lock:
            return [Device(f"rank{r}:{d}", _kind(d))
                    for r in self.expected if r in self.readings.ranks and self.readings.ranks[r].t
                    for d in self.readings.ranks[r].joules[-1]]

    def _unreadable(self, now: int) -> dict[int, str]:
        """The ranks that have no reading to give, and why."""
        out: dict[int, str] = {}
        for r in self.expected:
            rank = self.readings.ranks.get(r)
            if rank is not None and rank.error is not None:
                out[r] = f"its meter failed: {rank.error}"
            elif rank is None or not rank.t:
                out[r] = "it has sent no reading"
            elif (now - rank.seen_ns) / 1e9 > self.stall_s:
                out[r] = f"it sent no reading for {self.stall_s:g} s"
        return out

    def read(self) -> MeterReading:
        sink = self.readings
        now = sink.clock()
        with sink.lock:
            why = self._unreadable(now)
            good = [r for r in self.expected if r not in why]
            if not good:
                r, reason = next(iter(why.items()))
                raise MeterError(f"no worker's meter can be read (rank {r}: {reason})")
            ranks = sink.ranks
            if self._t is not None:  # a rank whose newest reading is older than the last instant
                for r in [r for r in good if ranks[r].t[-1] < self._t]:
                    why[r] = "its newest reading is older than the last instant read"
                    good.remove(r)
                if not good:
                    raise MeterError("no worker's meter has a reading newer than the last")
            t = min(ranks[r].t[-1] for r in good)
            rises: dict[int, dict[str, float]] = {}
            for r in good:
                rank = ranks[r]
                if t < rank.t[0]:  # its series starts after the instant (a rank back)
                    why[r] = "its readings start after the instant read"
                    self._at[r] = None
                    continue
                now_j = rank.at(t)
                last = self._at.get(r)
                self._at[r] = (rank.series, now_j)
                self._devices[r] = list(now_j)
                if self._t is None:
                    continue
                if last is None or last[0] != rank.series:
                    why[r] = "its counter starts again"
                    continue
                rise = {d: j - last[1].get(d, j) for d, j in now_j.items()}
                if any(v < 0.0 for v in rise.values()):
                    why[r] = "its counter went back"
                    continue
                rises[r] = rise
            for r in why:
                if r not in good:
                    self._at[r] = None
            if self._t is None:  # the base: every rank's counter as it stands
                if why:
                    r, reason = next(iter(why.items()))
                    raise MeterError(f"worker rank {r} cannot be read: {reason}")
                for r in self.expected:
                    at = self._at[r]
                    assert at is not None
                    for d, j in at[1].items():
                        self._total[f"rank{r}:{d}"] = j
                self._t = t
            else:
                self._t = t
                self._add(rises, why)  # raises where the estimate cannot be made
            return MeterReading(t, dict(self._total), self._fitted)

    def _add(self, rises: dict[int, dict[str, float]], why: dict[int, str]) -> None:
        """One interval's rises into the counters: measured where read, estimated for the
        ranks in `why`."""
        measured = {f"rank{r}:{d}": v for r, rise in rises.items() for d, v in rise.items()}
        for name, v in measured.items():
            self._total[name] = self._total.get(name, 0.0) + v
        if not why:
            decay, share = self._decay, self._share
            for name in share:
                share[name] *= decay
            for name, v in measured.items():
                share[name] = share.get(name, 0.0) + v
            self._recovered()
            return
        missing = [f"rank{r}:{d}" for r in why for d in self._devices.get(r, ())]
        known = math.fsum(self._share.get(name, 0.0) for name in measured)
        if known <= 0.0 or not missing or any(name not in self._share for name in missing):
            r, reason = next(iter(why.items()))
            raise MeterError(f"worker rank {r} cannot be read ({reason}) and no share of the "
                             "engine's energy was measured for it yet")
        others = math.fsum(measured.values())
        for name in missing:
            estimate = others * self._share[name] / known
            self._total[name] = self._total.get(name, 0.0) + estimate
            self._fitted += estimate
        for r, reason in why.items():
            if r not in self._estimating:
                self._estimating[r] = reason
                logger.warning(
                    "vllm_piep: worker rank %d's meter cannot be read (%s): its GPUs' energy is "
                    "estimated from the other ranks' at the share it drew before, and the "
                    "responses say `fitted`, until it reads again", r, reason)
        self._recovered(why)

    def _recovered(self, still: Collection[int] = ()) -> None:
        """The ranks estimated until now and not `still`: read again, said once."""
        for r in [r for r in self._estimating if r not in still]:
            del self._estimating[r]
            logger.info("vllm_piep: worker rank %d's meter reads again: its GPUs are measured", r)

    def stop(self) -> None:
        if self._on_stop is not None:
            self._on_stop()
