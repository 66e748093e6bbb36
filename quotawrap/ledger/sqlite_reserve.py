"""What the SQLite ledger runs on a guarded call's path, prepared once: the reserve's one read and its row,
the counters' upsert, a call's tags as its row keeps them, and a settle's move of the row out of holds.

A reserve runs inside ``BEGIN IMMEDIATE`` on the caller's path, so every statement counts: each costs
a microsecond or more of set-up (Python's and SQLite's) before it does anything.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping

from ..quota import Counters, Snapshot
from .sqlite_file import CALL_COLUMNS
from .sqlite_lines import WaiterRow

__all__ = [
    "BUMP",
    "HOLD_COLUMNS",
    "HOLD_ROW",
    "MOVE_HELD",
    "OPEN_HOLDS",
    "RESERVE_INTO_CALLS",
    "RESERVE_INTO_HOLDS",
    "SNAPSHOT_COLUMNS",
    "UPDATE_FINAL",
    "read_for_reserve",
    "tags_column",
]

SNAPSHOT_COLUMNS = "balance, usage_at_sync, lagged_usage, synced_at, day, source"  # Snapshot's fields, in order

# Everything a reserve reads, in one statement. ``key IN (...)`` builds a temporary index on every run,
# so the lookups are equalities joined by UNION ALL. Parameters: the run, model-day and run-cost counter
# keys (the run and model-day keys name the call's two waiting lines too), the model, whether the lines
# are read (the call enforces). Rows: (0, key, settled, in_flight), (1, the snapshot's fields), (2, line,
# ticket, waiter, until): one per counter, snapshot and waiter found.
_RESERVE_READS = f"""
SELECT 0, key, settled, in_flight, NULL, NULL, NULL FROM counters WHERE key = ?1
UNION ALL SELECT 0, key, settled, in_flight, NULL, NULL, NULL FROM counters WHERE key = ?2
UNION ALL SELECT 0, key, settled, in_flight, NULL, NULL, NULL FROM counters WHERE key = ?3
UNION ALL SELECT 1, {SNAPSHOT_COLUMNS} FROM snapshots WHERE model = ?4
UNION ALL SELECT 2, line, ticket, waiter, until, NULL, NULL FROM waiters WHERE ?5 AND line = ?1
UNION ALL SELECT 2, line, ticket, waiter, until, NULL, NULL FROM waiters WHERE ?5 AND line = ?2
"""


def read_for_reserve(
    conn: sqlite3.Connection, scopes: Mapping[str, str], model: str, enforce: bool
) -> tuple[dict[str, Counters], Snapshot | None, list[WaiterRow]]:
    """The counters of ``scopes`` (scope_keys; missing ones read as zero), the model's snapshot, and the
    rows of the call's two waiting lines (none unless it enforces)."""
    found: dict[str, Counters] = {}
    snapshot: Snapshot | None = None
    waiting: list[WaiterRow] = []
    params = (scopes["run"], scopes["model_day"], scopes["run_cost"], model, enforce)
    for kind, *row in conn.execute(_RESERVE_READS, params):
        if kind == 0:
            found[row[0]] = Counters(row[1], row[2])
        elif kind == 1:
            snapshot = Snapshot(*row)
        else:
            waiting.append((row[0], row[1], row[2], row[3]))
    counters = {scope: found[key] if key in found else Counters() for scope, key in scopes.items()}
    return counters, snapshot, waiting


# Add (settled, in_flight) to each of two or three keys' counters (SQLiteLedger._bump), by the count of keys.
BUMP = {
    count: f"INSERT INTO counters (key, settled, in_flight) VALUES {','.join(['(?, ?, ?)'] * count)}"
    " ON CONFLICT (key) DO UPDATE SET settled = settled + excluded.settled, in_flight = in_flight + excluded.in_flight"
    for count in (2, 3)
}

_TAGS: dict[tuple[tuple[str, str], ...], str] = {}


def tags_column(tags: Mapping[str, str]) -> str | None:
    """A call's tags as its row keeps them, encoded once per set (a process's calls all carry its --tag's)."""
    if not tags:
        return None
    key = tuple(tags.items())
    text = _TAGS.get(key)
    if text is None:
        if len(_TAGS) >= 64:  # bounded: a caller may tag its calls in ways without end
            _TAGS.clear()
        text = _TAGS[key] = json.dumps(dict(tags))
    return text


# A reserve's row: a hold taken goes to holds, a refusal straight to calls (it is final).
_RESERVE_COLUMNS = (
    "id, run_id, model, day, endpoint, state, reserved, reserved_cost, would_block, blocked_by, pid, host,"
    " key_fingerprint, tags, started_at, expires_at"
)
RESERVE_INTO_HOLDS, RESERVE_INTO_CALLS = (
    f"INSERT INTO {table} ({_RESERVE_COLUMNS}) VALUES ({', '.join('?' * 16)})" for table in ("holds", "calls")
)
# What a step writes of a call's row. A hold's row moves to calls with these values (then leaves holds);
# an unresolved call's row is updated in place. Parameters: these columns' values in order, then the id.
_STEP_COLUMNS = (
    *("state", "charged", "charged_cost", "prompt_tokens", "completion_tokens", "reasoning_tokens"),
    *("cached_tokens", "overshoot", "ended_at", "latency_s", "usage_anomaly", "handed_to"),
)
_ID = f"?{len(_STEP_COLUMNS) + 1}"
UPDATE_FINAL = (
    f"UPDATE calls SET ({', '.join(_STEP_COLUMNS)})"
    f" = ({', '.join(f'?{n}' for n in range(1, len(_STEP_COLUMNS) + 1))}) WHERE id = {_ID}"
)
MOVE_HELD = (
    f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) SELECT "
    + ", ".join(f"?{_STEP_COLUMNS.index(c) + 1}" if c in _STEP_COLUMNS else c for c in CALL_COLUMNS)
    + f" FROM holds WHERE id = {_ID}"
)

# A call's row as SQLiteLedger._step takes it, led by whether it is a hold in flight (a row of holds, else of
# calls): a hold is in exactly one of the two tables.
HOLD_COLUMNS = "id, run_id, model, day, state, reserved, charged, reserved_cost, charged_cost"
HOLD_ROW = (
    f"SELECT 1, {HOLD_COLUMNS} FROM holds WHERE id = ?1 UNION ALL SELECT 0, {HOLD_COLUMNS} FROM calls WHERE id = ?1"
)
OPEN_HOLDS = f"SELECT 1, {HOLD_COLUMNS} FROM holds WHERE "  # then the condition: the holds in flight, as HOLD_ROW's
