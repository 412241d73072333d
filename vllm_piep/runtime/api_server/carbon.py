"""Grid carbon intensity, for `usage.energy.gco2e` = joules / 3.6e6 * intensity.

Units: grams of CO2-equivalent per kilowatt-hour (gCO2e/kWh) everywhere; 1 kWh = 3.6e6 J.

The intensity is either a fixed number (`carbon_intensity`) or a file (`carbon_intensity_file`)
that something else keeps current (a cron job, a sidecar polling a grid feed). The file holds:

- a plain number, e.g. `350` or `350.5\\n`; or
- JSON: a number, or an object with `gco2e_per_kwh` (this plugin's key, preferred) or
  `carbonIntensity` (Electricity Maps' `/v3/carbon-intensity/latest` response, which is in
  gCO2eq/kWh, so it can be saved as is).

WattTime's MOER is in lbs CO2 per MWh and marginal rather than average: it is NOT accepted as
is. Convert it first: g/kWh = lbs/MWh * 0.45359237 (453.59237 g per lb, 1000 kWh per MWh), and
write `{"gco2e_per_kwh": ...}`.

`current()` sits on the response path, so it costs a `clock()` compare except once every
`min_interval_s`, when it stats the file and re-reads it only if its mtime, size or inode
changed (an atomic rename counts). A missing, unreadable or invalid file keeps the last good
value (None if there never was one) and logs one warning per kind of problem; it never raises.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from vllm_piep.once import OnceLogger

if TYPE_CHECKING:
    from vllm_piep.config import PiepConfig

JOULES_PER_KWH = 3.6e6
# Keys of a JSON object that hold gCO2e/kWh, in order of preference.
JSON_KEYS = ("gco2e_per_kwh", "carbonIntensity")
# A feed's file is a few hundred bytes; never pull a huge file into the API server.
MAX_FILE_BYTES = 1 << 16


class InvalidIntensity(ValueError):
    """The file's content is not a usable gCO2e/kWh value."""


def gco2e(joules: float, intensity: float) -> float:
    """Grams of CO2e for `joules` at `intensity` gCO2e/kWh."""
    return joules / JOULES_PER_KWH * intensity


def _check(value: Any, what: str) -> float:
    # bool is an int in Python; `true` in a JSON file is a mistake, not 1 gCO2e/kWh.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidIntensity(f"{what} is {value!r}, not a number")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise InvalidIntensity(f"{what} is {value!r}; it must be a finite number >= 0 "
                               "(gCO2e/kWh)")
    return v


def parse_intensity(text: str) -> float:
    """gCO2e/kWh from a file's text (see the module docstring); InvalidIntensity otherwise."""
    stripped = text.strip()
    if not stripped:
        raise InvalidIntensity("the file is empty")
    try:
        number = float(stripped)
    except ValueError:
        number = None  # not a plain number: JSON, then
    if number is not None:
        return _check(number, "the number")
    try:
        data = json.loads(stripped)
    except ValueError:
        raise InvalidIntensity(f"{stripped[:60]!r} is neither a number nor JSON") from None
    if not isinstance(data, dict):
        return _check(data, "the JSON value")
    for key in JSON_KEYS:
        if key in data:
            return _check(data[key], f"JSON {key!r}")
    raise InvalidIntensity(
        f"the JSON object has none of the keys {', '.join(JSON_KEYS)} (gCO2e/kWh); WattTime's "
        "MOER (lbs/MWh) must be converted first: g/kWh = lbs/MWh * 0.45359237")


def read_intensity_file(path: str | os.PathLike[str]) -> float:
    """gCO2e/kWh from the file at `path`; OSError or InvalidIntensity otherwise."""
    with open(path, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise InvalidIntensity(f"the file is larger than {MAX_FILE_BYTES} bytes")
    return parse_intensity(raw.decode("utf-8", "replace"))


class GridIntensity:
    """The grid's carbon intensity now, in gCO2e/kWh: a fixed value or a watched file."""

    def __init__(self, value: float | None = None, path: str | os.PathLike[str] | None = None,
                 min_interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (value is None) == (path is None):
            raise ValueError("GridIntensity needs exactly one of `value` and `path`")
        if min_interval_s < 0:
            raise ValueError("min_interval_s must be >= 0")
        self.path = None if path is None else os.fspath(path)
        self.min_interval_s = float(min_interval_s)
        self._clock = clock
        self._value: float | None = None if value is None else _check(value, "the intensity")
        self._read_at: datetime | None = None
        self._stamp: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) last seen
        self._next_check = -math.inf
        self._lock = threading.Lock()
        # A file's problem is all in the message: no traceback.
        self._once = OnceLogger("this problem is not logged again", traceback=lambda exc: False)
        if self.path is not None:
            self.current()  # a misconfigured file warns at startup, not at the first request

    @classmethod
    def static(cls, value: float) -> GridIntensity:
        return cls(value=value)

    @classmethod
    def file(cls, path: str | os.PathLike[str], min_interval_s: float = 5.0,
             clock: Callable[[], float] = time.monotonic) -> GridIntensity:
        return cls(path=path, min_interval_s=min_interval_s, clock=clock)

    @classmethod
    def from_config(cls, config: PiepConfig) -> GridIntensity | None:
        """The configured intensity, or None when neither option is set (no `gco2e`)."""
        if config.carbon_intensity is not None:
            return cls.static(config.carbon_intensity)
        if config.carbon_intensity_file is not None:
            return cls.file(config.carbon_intensity_file)
        return None

    @property
    def source(self) -> str:
        """Where the value comes from, for logs and /metrics help text."""
        if self.path is None:
            return f"static {self._value:g} gCO2e/kWh"
        if self._read_at is None:
            return f"file {self.path} (no valid value read yet)"
        return f"file {self.path} (read {self._read_at.isoformat(timespec='seconds')})"

    def current(self) -> float | None:
        """gCO2e/kWh now, or None while a file has never held a valid value. Never raises."""
        if self.path is None or self._clock() < self._next_check:
            return self._value
        # Another thread is re-reading: answer with the value in hand rather than wait.
        if self._lock.acquire(blocking=False):
            try:
                self._next_check = self._clock() + self.min_interval_s
                self._refresh(self.path)
            except Exception as exc:  # noqa: BLE001  (the response path must never see it)
                self._once.warn(f"reading the carbon intensity file {self.path}", exc,
                                self._keeping())
            finally:
                self._lock.release()
        return self._value

    def gco2e(self, joules: float) -> float | None:
        """Grams of CO2e for `joules` at the current intensity (None without one)."""
        intensity = self.current()
        return None if intensity is None else gco2e(joules, intensity)

    def _keeping(self) -> str:
        if self._value is None:
            return "responses carry no gco2e until the file holds a valid value"
        return f"keeping the last good value, {self._value:g} gCO2e/kWh"

    def _refresh(self, path: str) -> None:
        try:
            st = os.stat(path)
        except OSError as exc:
            self._once.warn(f"reading the carbon intensity file {path}", exc, self._keeping())
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        # Remembered even when the content is bad: the same bad file is not parsed again
        # every interval, and the writer's next change (new mtime or size) is.
        self._stamp = stamp
        try:
            value = read_intensity_file(path)
        except (OSError, InvalidIntensity) as exc:
            self._once.warn(f"reading the carbon intensity file {path}", exc, self._keeping())
            return
        self._value = value
        self._read_at = datetime.now(UTC)
