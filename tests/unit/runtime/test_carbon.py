"""Grid carbon intensity: a fixed number or a watched file, parsed, re-read only when the file
changes and the interval has passed, and a bad file keeps the last good value with one
warning per kind of problem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_piep.config import ConfigError, PiepConfig
from vllm_piep.runtime.api_server import carbon
from vllm_piep.runtime.api_server.carbon import (
    GridIntensity,
    InvalidIntensity,
    gco2e,
    parse_intensity,
)

# The shape of Electricity Maps' /v3/carbon-intensity/latest response (gCO2eq/kWh).
ELECTRICITY_MAPS = {"zone": "DE", "carbonIntensity": 302, "datetime": "2026-01-05T10:00:00Z",
                    "updatedAt": "2026-01-05T09:48:12Z", "emissionFactorType": "lifecycle",
                    "isEstimated": True, "estimationMethod": "TIME_SLICER_AVERAGE"}
# WattTime's MOER (v3 signal-index): lbs CO2/MWh, which must be converted, not taken as is.
WATTTIME = {"data": [{"point_time": "2026-01-05T10:00:00+00:00", "value": 870.0}],
            "meta": {"region": "CAISO_NORTH", "signal_type": "co2_moer",
                     "units": "lbs_co2_per_mwh"}}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def warnings(piep_logs):
    """The plugin's warnings about the intensity file."""
    return lambda: [m for m in piep_logs.messages() if "carbon intensity file" in m]


def _write(path: Path, text: str) -> None:
    """Write and move the mtime clearly forward (a coarse-mtime filesystem would not)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_static_intensity_and_grams() -> None:
    grid = GridIntensity.static(350)
    assert grid.current() == 350.0
    assert grid.source == "static 350 gCO2e/kWh"
    assert grid.gco2e(3.6e6) == pytest.approx(350.0)  # one kWh
    assert gco2e(7200.0, 500.0) == pytest.approx(1.0)  # 2 Wh at 500 g/kWh
    with pytest.raises(InvalidIntensity):
        GridIntensity.static(-1.0)


@pytest.mark.parametrize(("text", "value"), [
    ("350", 350.0),
    (" 412.5\n", 412.5),
    ("0", 0.0),
    ("123.4e0", 123.4),
    (json.dumps({"gco2e_per_kwh": 123.4, "zone": "FR"}), 123.4),
    (json.dumps(ELECTRICITY_MAPS), 302.0),
    (json.dumps({"carbonIntensity": 300, "gco2e_per_kwh": 111}), 111.0),  # ours wins
    ("56.5", 56.5),
])
def test_file_formats(text: str, value: float) -> None:
    assert parse_intensity(text) == pytest.approx(value)


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty"),
    ("-1", "finite number >= 0"),
    ("nan", "finite number >= 0"),
    ("inf", "finite number >= 0"),
    ('{"gco2e_per_kwh": NaN}', "finite number >= 0"),
    ('{"carbonIntensity": null}', "not a number"),
    ('{"carbonIntensity": true}', "not a number"),
    ('{"carbonIntensity": "300"}', "not a number"),
    ('{"carbonIntensity": -5}', "finite number >= 0"),
    ("[300]", "not a number"),
    ("350 gCO2e/kWh", "neither a number nor JSON"),
    (json.dumps(WATTTIME), "0.45359237"),
])
def test_invalid_contents(text: str, message: str) -> None:
    with pytest.raises(InvalidIntensity, match=message):
        parse_intensity(text)


def test_file_is_reread_when_it_changes_after_the_interval(tmp_path: Path) -> None:
    path = tmp_path / "intensity"
    path.write_text("100")
    clock = FakeClock()
    grid = GridIntensity.file(path, min_interval_s=5.0, clock=clock)
    assert grid.current() == 100.0
    assert grid.source.startswith(f"file {path} (read 20")

    _write(path, json.dumps({"gco2e_per_kwh": 250}))
    clock.advance(4.9)
    assert grid.current() == 100.0  # within the interval: not even looked at
    clock.advance(0.2)
    assert grid.current() == 250.0
    _write(path, json.dumps(ELECTRICITY_MAPS))
    clock.advance(5.0)
    assert grid.current() == 302.0


def test_unchanged_stat_means_no_reread(tmp_path: Path) -> None:
    """Same mtime, size and inode: the content is not read again (the file is only stat'ed)."""
    path = tmp_path / "intensity"
    path.write_text("100")
    clock = FakeClock()
    grid = GridIntensity.file(path, min_interval_s=1.0, clock=clock)
    st = path.stat()
    path.write_text("200")  # same size, same inode
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    clock.advance(2.0)
    assert grid.current() == 100.0
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    clock.advance(2.0)
    assert grid.current() == 200.0


def test_hot_path_does_not_touch_the_file(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "intensity"
    path.write_text("100")
    clock = FakeClock()
    grid = GridIntensity.file(path, min_interval_s=5.0, clock=clock)
    stats: list[object] = []
    real_stat = os.stat
    monkeypatch.setattr(carbon.os, "stat", lambda p, *a, **k: stats.append(p) or
                        real_stat(p, *a, **k))
    for _ in range(1000):
        assert grid.current() == 100.0
    assert stats == []
    clock.advance(5.0)
    assert grid.current() == 100.0
    assert len(stats) == 1


def test_bad_file_keeps_last_value_and_warns_once_per_problem(tmp_path: Path, warnings) -> None:
    path = tmp_path / "intensity"
    path.write_text("100")
    clock = FakeClock()
    grid = GridIntensity.file(path, min_interval_s=5.0, clock=clock)
    assert grid.current() == 100.0
    read_at = grid.source

    for bad in ("garbage", "-3", '{"carbonIntensity": null}', "nan", "also garbage"):
        _write(path, bad)
        clock.advance(5.0)
        assert grid.current() == 100.0
    assert len(warnings()) == 1
    assert "InvalidIntensity" in warnings()[0] and "keeping the last good value, 100" in \
        warnings()[0]
    assert grid.source == read_at  # still says when the value in use was read

    path.unlink()
    for _ in range(3):
        clock.advance(5.0)
        assert grid.current() == 100.0
    assert len(warnings()) == 2 and "FileNotFoundError" in warnings()[1]

    _write(path, "150")
    clock.advance(5.0)
    assert grid.current() == 150.0
    assert len(warnings()) == 2


def test_missing_file_at_start_gives_none_then_the_value(tmp_path: Path, warnings) -> None:
    path = tmp_path / "not-yet"
    clock = FakeClock()
    grid = GridIntensity.file(path, clock=clock)  # warns now, at startup, not per request
    assert len(warnings()) == 1 and "no gco2e until the file holds a valid value" in \
        warnings()[0]
    assert grid.current() is None and grid.gco2e(1000.0) is None
    assert grid.source == f"file {path} (no valid value read yet)"
    path.write_text("36")
    clock.advance(5.0)
    assert grid.current() == 36.0
    assert grid.gco2e(1e5) == pytest.approx(1.0)


def test_from_config(tmp_path: Path) -> None:
    assert GridIntensity.from_config(PiepConfig.from_sources(None, {})) is None
    static = GridIntensity.from_config(PiepConfig.from_sources(
        None, {"PIEP_CARBON_INTENSITY": "420"}))
    assert static is not None and static.current() == 420.0
    (tmp_path / "ci.json").write_text(json.dumps(ELECTRICITY_MAPS))
    watched = GridIntensity.from_config(PiepConfig.from_sources(
        {"piep": {"carbon_intensity_file": str(tmp_path / "ci.json")}}, {}))
    assert watched is not None and watched.current() == 302.0
    with pytest.raises(ConfigError, match="not both"):
        PiepConfig.from_sources({"piep": {"carbon_intensity": 1.0,
                                          "carbon_intensity_file": "x"}}, {})
