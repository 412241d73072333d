"""The campaign's state, `OUT/campaign.json`: the plan, and per config its attempts (server
starts) and finished cells. Saved atomically after every cell; `open_state` starts it or, with
`resume`, reloads it, refuses a different plan and stops the servers of killed drivers."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_piep.calibrate.campaign.plan import CampaignError, CampaignPlan
from vllm_piep.calibrate.campaign.servers import stop_stale_server

SCHEMA = "piep.campaign/1"
STATE_FILE = "campaign.json"
Outcome = Literal["running", "completed", "failed", "interrupted"]


class IdleWindow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start_ns: int
    end_ns: int
    seconds: float


class AttemptRecord(BaseModel):
    """One server start. `idle` and `server_pid` stay None when it never became ready."""

    model_config = ConfigDict(extra="forbid")

    attempt: int
    dir: str  # relative to the campaign directory
    meter: str
    meter_source: str
    idle: IdleWindow | None = None
    server_pid: int | None = None  # also its process group: vLLM runs in a session of its own
    outcome: Outcome = "running"
    error: str | None = None


class CellRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: int
    out_len: int
    attempt: int
    start_ns: int  # just before the first request was sent
    end_ns: int  # just after the last response arrived
    requests: int
    prompt_tokens: int  # summed over the requests, as vLLM reported them
    completion_tokens: int


class ConfigRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempts: list[AttemptRecord] = Field(default_factory=list)
    cells: dict[str, CellRecord] = Field(default_factory=dict)
    done: bool = False


class CampaignState(BaseModel):
    """`OUT/campaign.json`: the plan, and per config its attempts and finished cells."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: str = Field(default=SCHEMA, alias="schema")
    plan: dict[str, Any]
    configs: dict[str, ConfigRecord]
    finished: bool = False

    @classmethod
    def new(cls, plan: CampaignPlan) -> CampaignState:
        return cls(plan=plan.model_dump(), configs={c: ConfigRecord() for c in plan.configs()})

    @classmethod
    def load(cls, path: Path) -> CampaignState:
        try:
            state = cls.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            raise CampaignError(f"cannot read the campaign state {path}: {exc}") from exc
        if state.schema_ != SCHEMA:
            raise CampaignError(f"{path}: schema {state.schema_!r}, expected {SCHEMA!r}")
        return state

    def save(self, path: Path) -> None:
        write_atomic(path, self.model_dump_json(by_alias=True, indent=1).encode())

    def pending_cells(self, config: str, cells: list[str]) -> list[str]:
        return [c for c in cells if c not in self.configs[config].cells]


def write_atomic(path: Path, data: bytes) -> None:
    """Readers see the old file or the new one, never a part: a temporary file in the same
    directory, flushed to disk, then renamed over the target."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def plan_differences(saved: dict[str, Any], plan: CampaignPlan) -> list[str]:
    given = plan.model_dump()
    return [f"{k}: {saved.get(k)!r} in the campaign, {given.get(k)!r} now"
            for k in sorted(set(saved) | set(given)) if saved.get(k) != given.get(k)]


def open_state(plan: CampaignPlan, out: Path, resume: bool) -> CampaignState:
    path = out / STATE_FILE
    if not path.exists():
        return CampaignState.new(plan)
    if not resume:
        raise CampaignError(f"{out} already holds a campaign ({path}): use --resume to go on "
                            f"with it, or another --out")
    state = CampaignState.load(path)
    differences = plan_differences(state.plan, plan)
    if differences:
        raise CampaignError(f"--resume: the plan differs from the one in {path}: "
                            + "; ".join(differences)
                            + ". Give the same options as the first run, or another --out")
    for record in state.configs.values():
        for attempt in record.attempts:
            if attempt.outcome == "running" and attempt.server_pid:
                stop_stale_server(attempt.server_pid)
    return state
