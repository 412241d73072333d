"""A meter setting as users write it (`meter` option, PIEP_METER), read without building the
meter, so that configuration can be checked in any process."""

from __future__ import annotations

from typing import Literal, NamedTuple

# The meters `make_meter` builds by name (and aliases) with no argument; `external` needs its
# log's path. Kept here, not imported from `auto`, so that reading a setting imports no meter.
METER_NAMES = ("auto", "nvml", "amdsmi", "rapl", "nvml+rapl", "cpu-estimate", "simulated",
               "external")
SIMPLE_NAMES = tuple(n for n in METER_NAMES if n != "external") + ("cpu", "sim")


class MeterSetting(NamedTuple):
    kind: Literal["name", "external", "callable"]
    name: str  # a meter's name, a log's path, or `module`
    attr: str = ""  # the callable's name

    @property
    def label(self) -> str:
        return {"name": self.name, "external": f"external:{self.name}",
                "callable": f"{self.name}:{self.attr}"}[self.kind]


def parse_meter_setting(setting: str) -> MeterSetting:
    """`auto`, `nvml`, `amdsmi`, `rapl`, `nvml+rapl`, `cpu-estimate`, `simulated`,
    `external:PATH` or `module:callable`; ValueError saying what is expected otherwise."""
    text = setting.strip()
    head, sep, tail = text.partition(":")
    if sep and head.strip().lower() == "external":
        path = tail.strip()
        if not path:
            raise ValueError("meter `external:PATH` needs the power log's path")
        return MeterSetting("external", path)
    if sep:
        module, attr = head.strip(), tail.strip()
        if not module or not attr.isidentifier():
            raise ValueError(f"meter {setting!r}: expected `module:callable`")
        return MeterSetting("callable", module, attr)
    key = text.lower()
    if key == "external":
        raise ValueError("meter `external` needs its power log: `external:PATH`")
    if key not in SIMPLE_NAMES:
        raise ValueError(f"unknown meter {setting!r}; use one of "
                         f"{', '.join(n for n in METER_NAMES if n != 'external')}, "
                         "external:PATH or module:callable")
    return MeterSetting("name", key)
