"""The billing ledger's row: one per request whose energy became final (`kind` request), or
per engine, outcome and flush for energy that belongs to no request (`kind` engine). Never a
prompt or an output's text.

A row's key is (`writer`, `seq`): `writer` names one process run (host, pid, a random tag), `seq`
counts its rows, so that rows read from several copies of a store are counted once.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

SCHEMA_VERSION: Final = 1


class LedgerRow(msgspec.Struct, array_like=True, frozen=True):
    """A row as the API server makes it; the writer adds `writer` and `seq`."""

    kind: Literal["request", "engine"]
    outcome: str
    recorded_at: float  # Unix seconds when the energy became final
    joules: float
    source: str  # usage.energy.source (`prior`, `bundle`, `nvml`, `fitted`...)
    bundle: str | None = None
    meter: str | None = None
    request_id: str | None = None  # vLLM's request id, as in the response's `id`
    internal_id: str | None = None  # vLLM's internal request id (unique per engine request)
    model: str | None = None  # served model or LoRA adapter
    tenant: str | None = None
    engine: str | None = None  # engine rows: the engine's id
    arrival_at: float | None = None  # Unix seconds when the API server added the request
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    prefill_joules: float | None = None
    decode_joules: float | None = None
    breakdown: dict[str, float] | None = None  # joules by module or collective
    gco2e: float | None = None  # at the configured grid intensity, where one is set
    # A further row of a request whose first row is elsewhere (energy that came later: after
    # its finish, or booked when the engine reported its abort): no tokens, not a new request.
    later: bool = False


# Columns in store order: the writer's key, then LedgerRow's fields (breakdown as JSON text).
COLUMNS: Final = ("writer", "seq", *LedgerRow.__struct_fields__)
SQL_TYPES: Final = {"writer": "TEXT NOT NULL", "seq": "INTEGER NOT NULL", "kind": "TEXT NOT NULL",
                    "outcome": "TEXT NOT NULL", "recorded_at": "REAL NOT NULL",
                    "joules": "REAL NOT NULL", "source": "TEXT NOT NULL",
                    "arrival_at": "REAL", "prompt_tokens": "INTEGER", "output_tokens": "INTEGER",
                    "prefill_joules": "REAL", "decode_joules": "REAL", "gco2e": "REAL",
                    "later": "INTEGER NOT NULL"}


def create_table_sql() -> str:
    columns = ",\n  ".join(f"{name} {SQL_TYPES.get(name, 'TEXT')}" for name in COLUMNS)
    return (f"CREATE TABLE IF NOT EXISTS energy (\n  {columns},\n"
            "  PRIMARY KEY (writer, seq)\n) WITHOUT ROWID")
