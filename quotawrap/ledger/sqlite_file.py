"""The SQLite ledger's file: its schema, its migrations, and the checks before anything writes to it."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from .._errors import StoreCorrupt

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "create_schema", "private_file", "refuse_foreign", "retry_locked"]

SCHEMA_VERSION = "2"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (
    key TEXT PRIMARY KEY, settled INTEGER NOT NULL DEFAULT 0, in_flight INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS calls (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    model TEXT NOT NULL,
    day TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    state TEXT NOT NULL,
    reserved INTEGER NOT NULL,
    charged INTEGER NOT NULL DEFAULT 0,
    reserved_cost INTEGER NOT NULL DEFAULT 0,
    charged_cost INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER, completion_tokens INTEGER, reasoning_tokens INTEGER, cached_tokens INTEGER,
    overshoot INTEGER NOT NULL DEFAULT 0,
    would_block INTEGER NOT NULL DEFAULT 0,
    blocked_by TEXT,
    pid INTEGER NOT NULL,
    host TEXT NOT NULL,
    key_fingerprint TEXT,
    tags TEXT,
    started_at REAL NOT NULL,
    ended_at REAL,
    latency_s REAL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_run ON calls (run_id);
CREATE INDEX IF NOT EXISTS calls_started ON calls (started_at);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, started_at REAL NOT NULL, ended_at REAL, command TEXT, tags TEXT, exit_code INTEGER
);
CREATE INDEX IF NOT EXISTS calls_open ON calls (state, expires_at) WHERE state = 'held';
CREATE TABLE IF NOT EXISTS snapshots (
    model TEXT PRIMARY KEY, day TEXT NOT NULL, balance INTEGER NOT NULL, usage_at_sync INTEGER NOT NULL,
    lagged_usage INTEGER NOT NULL, synced_at REAL NOT NULL, source TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sync_history (
    model TEXT NOT NULL, day TEXT NOT NULL, synced_at REAL NOT NULL, balance INTEGER NOT NULL,
    usage_at_sync INTEGER NOT NULL, source TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS packages (
    model TEXT PRIMARY KEY, synced_at REAL NOT NULL, packages TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, until REAL NOT NULL);
CREATE TABLE IF NOT EXISTS usage_series (
    model TEXT NOT NULL, day TEXT NOT NULL, minute INTEGER NOT NULL, cumulative INTEGER NOT NULL,
    PRIMARY KEY (model, day, minute)
);
"""


# schema version -> the statements that bring it to the next one
MIGRATIONS: dict[str, tuple[str, ...]] = {
    "1": (
        "ALTER TABLE calls ADD COLUMN reserved_cost INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE calls ADD COLUMN charged_cost INTEGER NOT NULL DEFAULT 0",
        "UPDATE meta SET value = '2' WHERE key = 'schema'",
    ),
}


def retry_locked(action: Callable[[], object], attempts: int = 100) -> None:
    """Switching to WAL and creating the schema can report "locked" at once, without waiting on the
    busy handler, while another process opens the same new file: try again briefly."""
    for attempt in range(attempts):
        try:
            action()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.05)


def refuse_foreign(path: Path, url: str) -> None:
    """Raise StoreCorrupt unless ``path`` is missing, empty, or a quotawrap ledger; reads only."""
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return
        with path.open("rb") as file:
            header = file.read(16)
    except OSError:
        return  # private_file says what is wrong with the path
    if header != b"SQLite format 3\0":  # SQLite itself takes a short file of garbage for an empty database
        raise StoreCorrupt("ledger is damaged (file is not a database); it was left untouched", store=url)
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=60.0)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        except sqlite3.OperationalError:  # no meta table, or not ours
            row = None
    finally:
        conn.close()
    if row is None:
        raise StoreCorrupt("this SQLite file is not a quotawrap ledger; it was left untouched", store=url)
    if row[0] != SCHEMA_VERSION and row[0] not in MIGRATIONS:
        raise StoreCorrupt(f"ledger schema {row[0]!r} is not {SCHEMA_VERSION!r}", store=url)


def create_schema(conn: sqlite3.Connection) -> None:
    """Tables and the schema mark in one transaction: no opener ever sees tables without the mark."""
    mark = f"INSERT OR IGNORE INTO meta VALUES ('schema', '{int(SCHEMA_VERSION)}');"
    try:
        conn.executescript(f"BEGIN IMMEDIATE;\n{_SCHEMA}\n{mark}\nCOMMIT;")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def private_file(path: Path) -> None:
    """Create the ledger file (and its directory) readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
