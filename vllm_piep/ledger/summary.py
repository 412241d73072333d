"""Reading billing ledgers: their rows as one table (each row once, however many copies of a
store are given), and that table summed by tenant, model, day... for a bill or a report."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from vllm_piep.cli_errors import UsageError
from vllm_piep.ledger.schema import COLUMNS
from vllm_piep.ledger.store import LedgerError, connect, rows

# Grouping keys: a row's own columns, or a UTC period of `recorded_at`.
PERIODS = {"hour": "%Y-%m-%dT%H:00Z", "day": "%Y-%m-%d", "month": "%Y-%m"}
COLUMN_KEYS = ("tenant", "model", "outcome", "kind", "source", "engine", "bundle", "meter")
KEYS = (*COLUMN_KEYS, *PERIODS)


def parse_time(text: str, option: str) -> float:
    """Unix seconds from `text`: a number of seconds, or an ISO date or date-time (UTC unless
    it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected an ISO date or date-time "
                         "(2026-11-01, 2026-11-01T12:00Z) or Unix seconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def read(paths: Sequence[str | Path], since: float | None = None,
         until: float | None = None) -> pd.DataFrame:
    """The rows of these ledgers recorded in [since, until), each (writer, seq) once."""
    frames = []
    for path in paths:
        try:
            conn = connect(path, create=False)
        except LedgerError as exc:
            raise UsageError(str(exc)) from None
        try:
            frames.append(pd.DataFrame.from_records(list(rows(conn, since, until)),
                                                    columns=list(COLUMNS)))
        finally:
            conn.close()
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    return frame.drop_duplicates(["writer", "seq"]).reset_index(drop=True)


def parse_keys(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in KEYS]
    if unknown:
        raise UsageError(f"--by {text!r}: unknown key {unknown[0]!r}; keys: {', '.join(KEYS)}")
    return keys


def summarize(frame: pd.DataFrame, keys: Sequence[str]) -> list[dict]:
    """One row per group: its keys, `requests` (the requests whose first row is in it),
    `joules`, `gco2e` (None where no row has one), `prompt_tokens` and `output_tokens` (from
    those first rows: each request once, whatever later rows it has); sorted by the keys."""
    frame = frame.assign(joules=frame["joules"].astype(float),
                         gco2e=frame["gco2e"].astype(float), _all="")
    stamps = pd.to_datetime(frame["recorded_at"].astype(float), unit="s", utc=True)
    for period, spelling in PERIODS.items():
        if period in keys:
            frame[period] = stamps.dt.strftime(spelling)
    by = list(keys) or ["_all"]
    energy = frame.groupby(by, dropna=False, sort=True).agg(
        joules=("joules", "sum"), gco2e=("gco2e", lambda s: s.sum(min_count=1)))
    # Each request once, by its first row: later rows (`LedgerRow.later`) add energy only.
    first = frame[(frame["kind"] == "request") & frame["internal_id"].notna()
                  & (frame["later"].astype(int) == 0)].drop_duplicates([*by, "internal_id"])
    counts = first.groupby(by, dropna=False).agg(
        requests=("internal_id", "nunique"),
        prompt_tokens=("prompt_tokens", lambda s: s.fillna(0).astype(int).sum()),
        output_tokens=("output_tokens", lambda s: s.fillna(0).astype(int).sum()))
    table = energy.join(counts, how="left").reset_index()
    out = []
    for record in table.to_dict("records"):
        row = {k: (None if pd.isna(record[k]) else record[k]) for k in keys}
        row["requests"] = 0 if pd.isna(record["requests"]) else int(record["requests"])
        row["joules"] = float(record["joules"])
        row["gco2e"] = None if pd.isna(record["gco2e"]) else float(record["gco2e"])
        for name in ("prompt_tokens", "output_tokens"):
            row[name] = 0 if pd.isna(record[name]) else int(record[name])
        out.append(row)
    return out


def significant(value: float, digits: int = 4) -> str:
    """`value` for a person to read: fixed-point with `digits` significant digits (0.6400,
    0.0000002500), every integer digit of a larger one (123457); never rounded to zero."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    rounded = float(f"{value:.{digits - 1}e}")  # 999.95 -> 1000: the magnitude after rounding
    magnitude = math.floor(math.log10(abs(rounded)))
    if magnitude >= digits - 1:
        return f"{value:.0f}"
    return f"{rounded:.{digits - 1 - magnitude}f}"


def to_csv(table: list[dict], keys: Sequence[str]) -> str:
    """Every figure at full precision (Python's shortest repr), as the JSON has it."""
    columns = [*keys, "requests", "joules", "gco2e", "prompt_tokens", "output_tokens"]
    return pd.DataFrame(table, columns=columns).to_csv(index=False)


def to_json(table: list[dict]) -> str:
    return json.dumps(table, indent=1)


def export_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows for analysts: the breakdown spread into `joules_<component>` columns, times
    as UTC timestamps."""
    frame = frame.copy()
    breakdown = frame.pop("breakdown").map(
        lambda text: json.loads(text) if isinstance(text, str) else {})
    parts = pd.DataFrame(breakdown.tolist(), index=frame.index).add_prefix("joules_")
    for column in ("recorded_at", "arrival_at"):
        frame[column] = pd.to_datetime(frame[column].astype(float), unit="s", utc=True)
    return pd.concat([frame, parts.astype(float)], axis=1)
