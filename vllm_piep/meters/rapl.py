"""RAPL energy counters through the Linux powercap tree (`/sys/class/powercap/intel-rapl*`).

Intel and AMD (amd_energy / the kernel's RAPL driver on Zen) expose the same tree: each CPU
package is a zone `intel-rapl:N` named `package-N`, with subzones `intel-rapl:N:M` named `core`,
`uncore` or `dram`. This meter reads `energy_uj` of every package zone and every `dram` zone
(devices `package-N` and `dram-N`); `core` and `uncore` are skipped because the package counter
already contains them, and `psys` (platform) is skipped because it contains the packages too.
`intel-rapl-mmio:*` zones mirror the package zones through MMIO and are skipped as duplicates.

Counter wrap-around: `energy_uj` is a free-running counter that wraps at `max_energy_range_uj`.
A reading lower than the previous one means the counter wrapped once, and the range is added. A
counter that wraps twice between two reads loses a whole range without any visible sign, so
the counter must be read at least once per wrap period. On current CPUs the range is 2^32
energy units, about 262 kJ for the package domain (65 kJ on some DRAM domains): at 500 W that is
a wrap every ~130-500 s. The meter therefore runs a small background poll thread (default every
1 s: two orders of magnitude below the shortest wrap period we know of at realistic power, and a
few file reads per second cost nothing), so callers may read it as rarely as they like. Pass
`poll_interval_s=None` to disable the thread; then `read()` itself must be called at least once
per wrap period (the CLI and tests do this).

Since Linux 5.10 (CVE-2020-8694, "PLATYPUS") `energy_uj` is readable only by root; the
error raised then says how to grant access.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_piep.clock import now_ns
from vllm_piep.meters.common import Device, Meter, MeterError, MeterReading

DEFAULT_ROOT = "/sys/class/powercap"
_ZONE_RE = re.compile(r"^intel-rapl:(\d+)(?::(\d+))?$")
_SKIP_NAMES = ("core", "uncore", "psys")
# RAPL counters update about every millisecond (976 us on Intel); shorter windows see no change.
_UPDATE_PERIOD_S = 0.001


@dataclass(frozen=True)
class RaplZone:
    device: Device
    energy_path: Path
    range_uj: int


def _permission_hint(path: Path, exc: BaseException) -> str:
    return (f"cannot read {path} ({exc.__class__.__name__}: {exc}). Since Linux 5.10 RAPL "
            f"energy_uj is readable only by root (permissions): run as root or grant read "
            f"access with `sudo chmod a+r {path.parent.parent}/intel-rapl:*/energy_uj "
            f"{path.parent.parent}/intel-rapl:*:*/energy_uj`")


def _zone_dirs(root: Path) -> list[Path]:
    """`intel-rapl:N` and `intel-rapl:N:M` directories, flat (real sysfs symlinks them all into
    the root) or nested inside their parent zone; each zone once."""
    found: dict[str, Path] = {}
    if not root.is_dir():
        return []
    for top in sorted(root.iterdir()):
        if not _ZONE_RE.match(top.name):
            continue
        found.setdefault(top.name, top)
        if top.is_dir():
            for sub in sorted(top.iterdir()):
                if _ZONE_RE.match(sub.name):
                    found.setdefault(sub.name, sub)
    return [found[k] for k in sorted(found, key=lambda n: tuple(
        int(x) if x else -1 for x in _ZONE_RE.match(n).groups()))]  # type: ignore[union-attr]


def discover_zones(root: str | Path = DEFAULT_ROOT) -> list[RaplZone]:
    """The package and DRAM zones under `root`. Raises MeterError when there is none or one of
    them cannot be read (the message says why and what to do)."""
    root = Path(root)
    zones: list[RaplZone] = []
    used: set[str] = set()
    try:
        zone_dirs = _zone_dirs(root)
    except OSError as exc:
        raise MeterError(f"cannot list the powercap tree {root}: {exc}") from exc
    for zdir in zone_dirs:
        m = _ZONE_RE.match(zdir.name)
        assert m is not None
        pkg = int(m.group(1))
        try:
            name = (zdir / "name").read_text().strip()
        except OSError:
            continue
        if name.startswith("package"):
            dev = Device(name if re.fullmatch(r"package-\d+", name) else f"package-{pkg}", "cpu")
        elif name == "dram":
            dev = Device(f"dram-{pkg}", "dram")
        else:  # core / uncore are inside the package; psys contains the packages
            continue
        if dev.name in used:
            dev = Device(f"{dev.name}-{zdir.name.replace(':', '-')}", dev.kind)
        used.add(dev.name)
        energy = zdir / "energy_uj"
        try:
            int(energy.read_text().strip())
        except (OSError, ValueError) as exc:
            raise MeterError(_permission_hint(energy, exc)) from exc
        try:
            rng = int((zdir / "max_energy_range_uj").read_text().strip())
        except (OSError, ValueError) as exc:
            raise MeterError(f"cannot read {zdir / 'max_energy_range_uj'} ({exc}); without it "
                             "counter wrap-around cannot be corrected") from exc
        zones.append(RaplZone(dev, energy, rng))
    if not zones:
        raise MeterError(f"no RAPL package or dram zone under {root} (needs the intel_rapl "
                         "powercap driver on Linux, Intel or AMD Zen CPUs, not in most VMs)")
    return zones


class RaplMeter(Meter):
    """Package and DRAM energy from RAPL. See the module docstring on wrap-around and the
    optional poll thread (`poll_interval_s`, default 1 s; None = no thread)."""

    name = "rapl"
    source = "measured"
    resolution_s = _UPDATE_PERIOD_S

    def __init__(self, root: str | Path = DEFAULT_ROOT, poll_interval_s: float | None = 1.0,
                 clock: Callable[[], int] = now_ns) -> None:
        if poll_interval_s is not None and poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be positive or None")
        self.root = Path(root)
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._zones = discover_zones(self.root)
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        self._acc: dict[str, float] = {}
        self._started = False
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def available(cls, root: str | Path = DEFAULT_ROOT) -> bool:
        try:
            discover_zones(root)
        except (MeterError, OSError, ValueError):
            return False
        return True

    @staticmethod
    def why_unavailable(root: str | Path = DEFAULT_ROOT) -> str | None:
        """None when RAPL is usable under `root`, else the reason."""
        try:
            discover_zones(root)
        except MeterError as exc:
            return str(exc)
        except OSError as exc:
            return f"cannot list {root}: {exc}"
        return None

    def devices(self) -> Sequence[Device]:
        return [z.device for z in self._zones]

    def _raw(self, zone: RaplZone) -> int:
        try:
            return int(zone.energy_path.read_text().strip())
        except (OSError, ValueError) as exc:
            raise MeterError(_permission_hint(zone.energy_path, exc)) from exc

    def _update(self) -> int:
        """Read all counters and accumulate; caller holds the lock. Returns the timestamp."""
        t = self._clock()
        for z in self._zones:
            cur = self._raw(z)
            prev = self._last[z.device.name]
            delta = cur - prev
            if delta < 0:  # wrapped (once: see the module docstring)
                delta += z.range_uj
            self._acc[z.device.name] += delta / 1e6
            self._last[z.device.name] = cur
        return t

    def start(self) -> None:
        with self._lock:
            self._last = {z.device.name: self._raw(z) for z in self._zones}
            self._acc = {z.device.name: 0.0 for z in self._zones}
            self._started = True
        if self.poll_interval_s is not None and self._thread is None:
            self._stop_evt.clear()
            self._thread = threading.Thread(target=self._poll, name="piep-rapl-poll",
                                             daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        assert self.poll_interval_s is not None
        while not self._stop_evt.wait(self.poll_interval_s):
            try:
                with self._lock:
                    self._update()
            except MeterError:
                pass  # surfaced by the next read()

    def read(self) -> MeterReading:
        with self._lock:
            if not self._started:
                raise MeterError("rapl: read() before start()")
            t = self._update()
            return MeterReading(t, dict(self._acc))

    def stop(self) -> None:
        self._stop_evt.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
