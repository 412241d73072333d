"""The billing ledger's store: one SQLite database in WAL mode (docs/billing.md says why).

Every flush is one transaction, so a reader, a crash or a second writer sees whole flushes or
nothing; several API server processes of one host write the same file (SQLite serializes their
short transactions; `BUSY_MS` bounds a wait). WAL with `synchronous=NORMAL` keeps every
committed flush through a killed process; only the machine losing power may take the last ones.
The database must be on a local disk: SQLite's locks do not hold on network filesystems.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from vllm_piep.ledger.schema import COLUMNS, SCHEMA_VERSION, LedgerRow, create_table_sql

BUSY_MS = 5000
_INSERT = (f"INSERT OR IGNORE INTO energy ({', '.join(COLUMNS)}) "
           f"VALUES ({', '.join('?' for _ in COLUMNS)})")
_encode = msgspec.json.Encoder().encode
_BREAKDOWN = LedgerRow.__struct_fields__.index("breakdown")  # stored as JSON text


class LedgerError(ValueError):
    """A store that cannot be used; the message says which file and why, in one line."""


def connect(path: str | Path, *, create: bool = True) -> sqlite3.Connection:
    """The store at `path`, made if `create` and absent, its schema checked: LedgerError if
    the file cannot be written or read, is not a ledger, or is of another schema version."""
    path = Path(path)
    if not create and not path.is_file():
        raise LedgerError(f"{path}: no such ledger")
    if create and not path.parent.is_dir():
        raise LedgerError(f"{path}: its directory {path.parent} does not exist")
    try:
        conn = sqlite3.connect(path, timeout=BUSY_MS / 1000, isolation_level=None,
                               check_same_thread=False)
    except sqlite3.Error as exc:
        raise LedgerError(f"{path}: cannot open it as a ledger ({exc})") from None
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
        if create:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("BEGIN IMMEDIATE")  # fails here, at start, on a read-only file
            conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
            conn.execute(create_table_sql())
            conn.execute("COMMIT")
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.Error as exc:
        conn.close()
        raise LedgerError(f"{path}: {_why(exc)}") from None
    if version is None or version[0] != str(SCHEMA_VERSION):
        conn.close()
        found = "none" if version is None else version[0]
        raise LedgerError(f"{path}: a ledger of schema version {found}; this vllm_piep reads "
                          f"and writes version {SCHEMA_VERSION}")
    return conn


def _why(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "not a database" in text or "malformed" in text:
        return f"not a readable ledger (corrupt, or another kind of file: {text})"
    if "readonly" in text or "unable to open" in text:
        return f"cannot be written ({text}); choose a writable path"
    if "no such table" in text:
        return f"an SQLite database that is not a ledger ({text})"
    return text


def insert(conn: sqlite3.Connection, writer: str, first_seq: int,
           rows: Sequence[LedgerRow]) -> None:
    """One transaction: every row, or none."""
    values = [_values(writer, first_seq + i, row) for i, row in enumerate(rows)]
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(_INSERT, values)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # SQLite rolls back by itself on a full disk or an I/O error
            conn.execute("ROLLBACK")
        raise


def _values(writer: str, seq: int, row: LedgerRow) -> tuple[Any, ...]:
    fields = [getattr(row, name) for name in LedgerRow.__struct_fields__]
    if fields[_BREAKDOWN] is not None:
        fields[_BREAKDOWN] = _encode(fields[_BREAKDOWN]).decode()
    return (writer, seq, *fields)


def rows(conn: sqlite3.Connection, since: float | None = None,
         until: float | None = None) -> Iterable[tuple[Any, ...]]:
    """The stored rows (COLUMNS order), recorded in [since, until)."""
    query, args = f"SELECT {', '.join(COLUMNS)} FROM energy", []
    clauses = []
    if since is not None:
        clauses.append("recorded_at >= ?")
        args.append(since)
    if until is not None:
        clauses.append("recorded_at < ?")
        args.append(until)
    if clauses:
        query += " WHERE " + " AND ".join(clauses)
    yield from conn.execute(query, args)
