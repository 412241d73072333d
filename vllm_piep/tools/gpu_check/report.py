"""A section's result: its figures and pass criteria, written as JSON whenever they change."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Status = Literal["running", "passed", "failed", "skipped", "error", "timeout"]
FAILING: frozenset[str] = frozenset({"failed", "error", "timeout"})


class SectionSkipped(Exception):
    """The section cannot run here (no GPU, no NVML, a MIG instance...): one line says why."""


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300]


def plain(value: Any) -> Any:
    """JSON-ready: numpy scalars and arrays, tuples, paths, non-finite floats (as strings)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalar or array
        return plain(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Path):
        return str(value)
    return value


@dataclass
class Criterion:
    """One pass criterion: what is checked, the figure, the rule, and the verdict (None: the
    figure is reported, not gated)."""

    name: str
    value: Any
    target: str
    passed: bool | None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": plain(self.value), "target": self.target,
                "passed": self.passed}


class SectionReport:
    """What one section found, kept in `path` (rewritten atomically after every change, so
    that a section stopped by its budget leaves what it had)."""

    def __init__(self, name: str, title: str, path: Path, dry_run: bool) -> None:
        self.name, self.path = name, path
        self.started = time.monotonic()
        self.criteria: list[Criterion] = []
        self.data: dict[str, Any] = {
            "section": name, "title": title, "status": "running", "reason": None,
            "dry_run": dry_run, "complete": False, "seconds": 0.0, "figures": {},
            "criteria": []}

    def figure(self, key: str, value: Any) -> Any:
        self.data["figures"][key] = plain(value)
        self.write()
        return value

    def check(self, name: str, value: Any, target: str, passed: bool | None,
              host_timing: bool = False) -> bool:
        """Record a criterion; returns its verdict (True for one that is not gated).
        `host_timing`: the criterion holds this host's wall time against the device's; in a
        dry run the device is simulated in the host's own time on a CPU other work shares, so
        the figure is recorded and not gated."""
        verdict = None if passed is None else bool(passed)
        if host_timing and self.data["dry_run"]:
            verdict, target = None, f"{target} (not gated in a dry run: {passed and 'met' or 'missed'})"
        self.criteria.append(Criterion(name, value, target, verdict))
        self.write()
        return verdict is not False

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.criteria if c.passed is False]

    def finish(self, status: Status | None = None, reason: str | None = None) -> Status:
        """The verdict: `status` when given (skipped, error), else failed when a gated
        criterion failed, passed when at least one passed."""
        if status is None:
            if self.failed:
                status, reason = "failed", reason or "failed: " + ", ".join(self.failed)
            elif any(c.passed for c in self.criteria):
                status = "passed"
            else:
                status, reason = "error", reason or "no criterion was evaluated"
        self.data.update(status=status, reason=reason, complete=True)
        self.write()
        return status

    def write(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.started, 3)
        self.data["criteria"] = [c.as_dict() for c in self.criteria]
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)
