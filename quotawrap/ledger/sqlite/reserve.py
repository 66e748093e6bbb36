"""What the SQLite ledger runs on a guarded call's path, prepared once: the reserve's one read and its row,
what is in flight (summed from holds), the counters' upsert, a call's tags as its row keeps them, and a
settle's move of the row out of holds.

A reserve runs inside ``BEGIN IMMEDIATE`` on the caller's path, so every statement counts: each costs
set-up (Python's and SQLite's) before it does anything.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ...core.identity import UNMAPPED
from ...core.quota import Counters, Snapshot
from ...core.usage import Usage
from ...support.processes import pid_alive
from ..base import ADVANCE, ADVANCE_CLOSED, Drawn, Settle
from ..holds import Deltas, Step, clamp, step
from ..scopes import ModelDay, Run, RunCost, model_day_key, parse_counter_key
from .file import CALL_COLUMNS
from .lines import WaiterRow

__all__ = [
    "BUMP",
    "HOLD_COLUMNS",
    "HOLD_ROW",
    "IN_FLIGHT",
    "LANDED_TOGETHER",
    "MOVE_HELD",
    "OPEN_HOLDS",
    "RESERVE_INTO_CALLS",
    "RESERVE_INTO_HOLDS",
    "SNAPSHOT_COLUMNS",
    "STEP_COLUMNS",
    "UPDATE_FINAL",
    "Owed",
    "close_advance",
    "drawn_runs",
    "land_drawn",
    "read_counters",
    "read_for_reserve",
    "release_dead_advances",
    "split_from_advance",
    "step_values",
    "tags_column",
]

Owed = tuple[tuple[str, str, str], Deltas]  # what one step owes the counters of its (run, model, day)

# At most this many drawn calls are landed by one statement set (land_drawn): an advance holds ADVANCE_CALLS,
# and the statements that read a run's rows, one per length, stay few.
LANDED_TOGETHER = 32

SNAPSHOT_COLUMNS = "balance, usage_at_sync, lagged_usage, synced_at, day, source"  # Snapshot's fields, in order

# What a scope has in flight is the sum over its holds (every row of holds is a hold in flight, and only
# those are): a reserve writes its row and no counter, so its commit copies one b-tree page, not three.
# Per scope_keys' scope: the column summed and the condition on holds, whose parameters are the scope's
# fields (Run: run_id; RunCost: run_id; ModelDay: model, day).
IN_FLIGHT = {
    "run": ("reserved", "run_id = ?"),
    "run_cost": ("reserved_cost", "run_id = ?"),
    "model_day": ("reserved", "model = ? AND day = ?"),
}
_SUMS = ", ".join(
    f"SUM(CASE WHEN {condition.replace('?', '{}')} THEN {column} END)"
    for column, condition in (*IN_FLIGHT.values(), IN_FLIGHT["model_day"])
).format("?6", "?6", "?4", "?7", "?9", "?7")  # run, run_cost, model_day, unmapped: the reserve's parameters below

# Everything a reserve reads, in one statement. ``key IN (...)`` builds a temporary index on every run,
# so the lookups are equalities joined by UNION ALL. Parameters: the run, model-day and run-cost counter
# keys (the run and model-day keys name the call's two waiting lines too), the model, whether the lines
# are read (the call enforces), the run id, the day, the unmapped endpoints' model-day key and model. Rows:
# (0, key, settled), (1, the snapshot's fields), (2, line, ticket, waiter, until), (3, the run's, the run's
# cost, the model-day's and the unmapped endpoints' in flight): one per counter, snapshot and waiter found,
# and always the last.
_RESERVE_READS = f"""
SELECT 0, key, settled, NULL, NULL, NULL, NULL FROM counters WHERE key = ?1
UNION ALL SELECT 0, key, settled, NULL, NULL, NULL, NULL FROM counters WHERE key = ?2
UNION ALL SELECT 0, key, settled, NULL, NULL, NULL, NULL FROM counters WHERE key = ?3
UNION ALL SELECT 0, key, settled, NULL, NULL, NULL, NULL FROM counters WHERE key = ?8
UNION ALL SELECT 1, {SNAPSHOT_COLUMNS} FROM snapshots WHERE model = ?4
UNION ALL SELECT 2, line, ticket, waiter, until, NULL, NULL FROM waiters WHERE ?5 AND line = ?1
UNION ALL SELECT 2, line, ticket, waiter, until, NULL, NULL FROM waiters WHERE ?5 AND line = ?2
UNION ALL SELECT 3, {_SUMS}, NULL, NULL FROM holds
"""


def read_for_reserve(
    conn: sqlite3.Connection, scopes: Mapping[str, str], call: tuple[str, str, str], enforce: bool
) -> tuple[dict[str, Counters], Snapshot | None, list[WaiterRow]]:
    """The counters of ``scopes`` (scope_keys of ``call``, its (run, model, day); missing ones read as zero),
    the model's snapshot, and the rows of the call's two waiting lines (none unless it enforces).

    A model's model-day counters include the calls to endpoints whose model is not known yet (their model-day
    is UNMAPPED's): any of them may turn out to be this model (README, "One identity per model")."""
    run_id, model, day = call
    settled: dict[str, int] = {}
    in_flight = (0, 0, 0, 0)
    snapshot: Snapshot | None = None
    waiting: list[WaiterRow] = []
    unmapped = model_day_key(UNMAPPED, day)
    params = (scopes["run"], scopes["model_day"], scopes["run_cost"], model, enforce, run_id, day, unmapped, UNMAPPED)
    for kind, *row in conn.execute(_RESERVE_READS, params):
        if kind == 0:
            settled[row[0]] = row[1]
        elif kind == 1:
            snapshot = Snapshot(*row)
        elif kind == 2:
            waiting.append((row[0], row[1], row[2], row[3]))
        else:
            in_flight = (row[0] or 0, row[1] or 0, row[2] or 0, row[3] or 0)
    held = dict(zip(IN_FLIGHT, in_flight, strict=False))
    counters = {scope: Counters(settled.get(key, 0), held[scope]) for scope, key in scopes.items()}
    if model != UNMAPPED:
        own = counters["model_day"]
        counters["model_day"] = Counters(own.settled + settled.get(unmapped, 0), own.in_flight + in_flight[3])
    return counters, snapshot, waiting


def read_counters(conn: sqlite3.Connection, keys: Sequence[str]) -> dict[str, Counters]:
    """Each key's counters, in one statement (one snapshot of the file: a settle moving a hold from in flight
    to settled between two reads would hide it from both); a key no scope names reads as zero."""
    selects, params = [], []
    for key in keys:
        scope = parse_counter_key(key)
        scope_params: tuple[str, ...] = ()
        column, condition = "0", "0"  # a key no scope names: nothing in flight
        if isinstance(scope, Run):
            (column, condition), scope_params = IN_FLIGHT["run"], (scope.run_id,)
        elif isinstance(scope, RunCost):
            (column, condition), scope_params = IN_FLIGHT["run_cost"], (scope.run_id,)
        elif isinstance(scope, ModelDay):
            (column, condition), scope_params = IN_FLIGHT["model_day"], (scope.model, scope.day)
        selects.append(
            f"SELECT (SELECT settled FROM counters WHERE key = ?), (SELECT SUM({column}) FROM holds WHERE {condition})"
        )
        params += [key, *scope_params]
    if not keys:
        return {}
    rows = conn.execute(" UNION ALL ".join(selects), params).fetchall()
    return {key: Counters(settled or 0, held or 0) for key, (settled, held) in zip(keys, rows, strict=True)}


# Add what was settled to two or three keys' counters (SQLiteLedger._bump), by the count of keys.
BUMP = {
    count: f"INSERT INTO counters (key, settled) VALUES {','.join(['(?, ?)'] * count)}"
    " ON CONFLICT (key) DO UPDATE SET settled = settled + excluded.settled"
    for count in (1, 2, 3)
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
STEP_COLUMNS = (
    *("state", "charged", "charged_cost", "prompt_tokens", "completion_tokens", "reasoning_tokens"),
    *("cached_tokens", "overshoot", "ended_at", "latency_s", "usage_anomaly", "handed_to"),
)
_ID = f"?{len(STEP_COLUMNS) + 1}"
UPDATE_FINAL = (
    f"UPDATE calls SET ({', '.join(STEP_COLUMNS)})"
    f" = ({', '.join(f'?{n}' for n in range(1, len(STEP_COLUMNS) + 1))}) WHERE id = {_ID}"
)
MOVE_HELD = (
    f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) SELECT "
    + ", ".join(f"?{STEP_COLUMNS.index(c) + 1}" if c in STEP_COLUMNS else c for c in CALL_COLUMNS)
    + f" FROM holds WHERE id = {_ID}"
)

# A call's row as SQLiteLedger._step takes it, led by whether it is a hold in flight (a row of holds, else of
# calls): a hold is in exactly one of the two tables.
HOLD_COLUMNS = "id, run_id, model, day, state, reserved, charged, reserved_cost, charged_cost"
HOLD_ROW = (
    f"SELECT 1, {HOLD_COLUMNS} FROM holds WHERE id = ?1 UNION ALL SELECT 0, {HOLD_COLUMNS} FROM calls WHERE id = ?1"
)
OPEN_HOLDS = f"SELECT 1, {HOLD_COLUMNS} FROM holds WHERE "  # then the condition: the holds in flight, as HOLD_ROW's


# The advance calls are drawn from and land from, open or closed (gone once given back whole).
_ADVANCE_ROW = f"id = {{advance}} AND endpoint IN ('{ADVANCE}', '{ADVANCE_CLOSED}')"
# The advance's row, while the call has none in either table (nothing when the advance is gone, or the call
# was split or landed before).
_ADVANCE_OF_ROWLESS_CALL = (
    f"WHERE {_ADVANCE_ROW}"
    " AND NOT EXISTS (SELECT 1 FROM calls WHERE id = {call}) AND NOT EXISTS (SELECT 1 FROM holds WHERE id = {call})"
)
# A call drawn from an advance (quotawrap.admission.advances) gets its own row in holds, split from the advance's (whose
# run, model, day, pid, host and tags are the call's), the advance giving up what the call reserved: what is
# in flight is unchanged (the sum over holds). Once only (the settle may land twice): a call whose row exists
# in either table is not split again. Parameters: the call's id, endpoint, reserved, reserved_cost,
# key_fingerprint, started_at, expires_at, then the advance's id.
_SPLIT = f"""
INSERT INTO holds ({_RESERVE_COLUMNS})
SELECT ?1, run_id, model, day, ?2, 'held', ?3, ?4, 0, NULL, pid, host, ?5, tags, ?6, ?7 FROM holds
{_ADVANCE_OF_ROWLESS_CALL.format(advance="?8", call="?1")}
"""
_GIVE_UP = "UPDATE holds SET reserved = reserved - ?, reserved_cost = reserved_cost - ? WHERE id = ?"
# An advance all of whose room is drawn and settled, or given back, is gone: it was never a call.
_GONE_IF_EMPTY = "DELETE FROM holds WHERE id = ? AND reserved <= 0 AND reserved_cost <= 0"


# A drawn call whose settle comes while no row of it exists lands straight in calls, final: the row
# split_from_advance would give it in holds, moved on by the same step at once (no row of holds written and
# deleted, on every drawn call the wrapper lands; land_drawn takes a run of them together). Its run, model,
# day, pid, host and tags are the advance's. Parameters: the step's values (STEP_COLUMNS'), the id, the
# advance's columns (_FROM_ADVANCE's), then the Drawn's (endpoint, reserved, reserved_cost, key_fingerprint,
# started_at, expires_at).
_FROM_ADVANCE = ("run_id", "model", "day", "pid", "host", "tags")
_FROM_DRAWN = ("endpoint", "reserved", "reserved_cost", "key_fingerprint", "started_at", "expires_at")
_LAND_PARAMETERS = (*STEP_COLUMNS, "id", *_FROM_ADVANCE, *_FROM_DRAWN)
_NEVER_BLOCKED = {"would_block": "0", "blocked_by": "NULL"}
_LAND_DRAWN = (
    f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) VALUES ("
    + ", ".join(_NEVER_BLOCKED.get(c) or f"?{_LAND_PARAMETERS.index(c) + 1}" for c in CALL_COLUMNS)
    + ")"
)
# What drawn calls land from: their advance's columns (_FROM_ADVANCE). Parameters: the advance's id.
_ADVANCE_SOURCE = f"SELECT {', '.join(_FROM_ADVANCE)} FROM holds WHERE {_ADVANCE_ROW.format(advance='?')}"
# Which of a run's calls have a row in either table (split by their draw, or landed before), by the run's length.
_ROWED = {
    count: f"SELECT id FROM calls WHERE id IN ({marks}) UNION ALL SELECT id FROM holds WHERE id IN ({marks})"
    for count in range(1, LANDED_TOGETHER + 1)
    for marks in [",".join("?" * count)]
}


def step_values(
    moved: Step,
    usage: Usage | None,
    latency_s: float | None,
    anomaly: str | None,
    handed_to: str | None,
    ended_at: float,
) -> tuple[Any, ...]:
    """What a step writes of a call's row, in STEP_COLUMNS' order."""
    return (
        moved.state,
        moved.charged,
        moved.charged_cost,
        clamp(usage.prompt_tokens) if usage else None,
        clamp(usage.completion_tokens) if usage else None,
        clamp(usage.reasoning_tokens) if usage else None,
        clamp(usage.cached_tokens) if usage else None,
        int(moved.overshoot),
        ended_at,
        latency_s,
        anomaly,
        handed_to,
    )


def drawn_runs(settles: Iterable[Settle]) -> Iterator[list[Settle]]:
    """``settles`` in order, in the runs the landing takes together: the settles and releases of calls drawn
    from one advance, one after another, each call once and at most LANDED_TOGETHER of them; any other settle
    is a run of its own. A call's second settle starts the next run, so it meets the row its first one left."""
    run: list[Settle] = []
    ids: set[str] = set()
    run_advance = ""
    for settle in settles:
        drawn = settle.drawn
        advance = drawn.advance_id if drawn is not None and settle.event in ("settle", "release") else None
        if run and (advance != run_advance or settle.hold_id in ids or len(run) == LANDED_TOGETHER):
            yield run
            run, ids = [], set()
        if advance is None:
            yield [settle]
            continue
        run.append(settle)
        ids.add(settle.hold_id)
        run_advance = advance
    if run:
        yield run


def land_drawn(conn: sqlite3.Connection, run: Sequence[Settle], ended_at: float) -> tuple[list[Owed], list[Settle]]:
    """Land a run of drawn_runs' (calls drawn from one advance, each once) whose calls have no row yet: each
    row goes straight to calls (_LAND_DRAWN), as a split then a step would leave it, and the advance gives up
    what they reserved in one step (gone once nothing is left): one read of the advance, one of the calls'
    rows and two writes of it for the whole run. Returns what the landed calls owe, and the settles it did
    not land, in order: those whose row exists (split by their draw, or landed before), or every one when the
    advance is gone."""
    first = run[0].drawn
    assert first is not None  # drawn_runs' runs of drawn calls
    source = conn.execute(_ADVANCE_SOURCE, (first.advance_id,)).fetchone()
    if source is None:
        return [], list(run)
    ids = [settle.hold_id for settle in run]
    rowed = {hold_id for (hold_id,) in conn.execute(_ROWED[len(ids)], ids + ids)}
    run_id, model, day = source[:3]
    owed: list[Owed] = []
    rows: list[tuple[Any, ...]] = []
    left: list[Settle] = []
    given_up, given_up_cost = 0, 0
    for settle in run:
        drawn = settle.drawn
        if drawn is None or settle.hold_id in rowed:
            left.append(settle)
            continue
        reserved, reserved_cost = _reserved(drawn)
        usage = settle.usage
        moved = step(
            "held",
            "release" if settle.event == "release" else "settle",
            reserved=reserved,
            charged=0,
            reserved_cost=reserved_cost,
            charged_cost=0,
            usage_total=None if usage is None else usage.total_tokens,
            cost=settle.cost,
        )
        if moved is None:  # pragma: no cover - a held call's settle and release always move it
            continue
        values = step_values(moved, usage, settle.latency_s, settle.anomaly, None, ended_at)
        of_drawn = (drawn.endpoint, reserved, reserved_cost, drawn.key_fingerprint, drawn.started_at, drawn.expires_at)
        rows.append((*values, settle.hold_id, *source, *of_drawn))
        owed.append(((run_id, model, day), moved.deltas))
        given_up += reserved
        given_up_cost += reserved_cost
    if rows:
        conn.executemany(_LAND_DRAWN, rows)
        _give_up(conn, first.advance_id, given_up, given_up_cost)
    return owed, left


def split_from_advance(conn: sqlite3.Connection, hold_id: str, drawn: Drawn) -> None:
    """Give the call drawn from an advance its own row of holds (its settle then lands on it as on any hold's).

    Nothing when the advance is gone (charged whole as unresolved when its process died: the call's share
    was charged with it, so its settle must not count again) or the call was split before."""
    reserved, reserved_cost = _reserved(drawn)
    split = conn.execute(
        _SPLIT,
        (
            hold_id,
            drawn.endpoint,
            reserved,
            reserved_cost,
            drawn.key_fingerprint,
            drawn.started_at,
            drawn.expires_at,
            drawn.advance_id,
        ),
    )
    if split.rowcount:
        _give_up(conn, drawn.advance_id, reserved, reserved_cost)


def _reserved(drawn: Drawn) -> tuple[int, int]:
    """What a drawn call (or an advance's rest) reserved, never below zero."""
    return max(drawn.reserved, 0), max(drawn.reserved_cost, 0)


def _give_up(conn: sqlite3.Connection, advance_id: str, reserved: int, reserved_cost: int) -> None:
    """The advance gives up what its drawn call reserved (what is in flight, the sum over holds, is unchanged),
    and is gone once nothing is left."""
    conn.execute(_GIVE_UP, (reserved, reserved_cost, advance_id))
    conn.execute(_GONE_IF_EMPTY, (advance_id,))


_ADVANCE_ROWS = f"run_id = ? AND host = ? AND endpoint IN ('{ADVANCE}', '{ADVANCE_CLOSED}')"


def release_dead_advances(conn: sqlite3.Connection, run_id: str, host: str) -> None:
    """Release what is left of the advances the run's dead processes on ``host`` left open: the caller landed
    every draw they made (resolve_run's release_advances), so each call in flight has its own row. A live
    owner may still draw from its advance: that one stays, to be charged whole."""
    owners = conn.execute(f"SELECT DISTINCT pid FROM holds WHERE {_ADVANCE_ROWS}", (run_id, host)).fetchall()
    dead = [pid for (pid,) in owners if not pid_alive(pid)]
    if dead:
        marks = ",".join("?" * len(dead))
        conn.execute(f"DELETE FROM holds WHERE {_ADVANCE_ROWS} AND pid IN ({marks})", (run_id, host, *dead))


def close_advance(conn: sqlite3.Connection, advance_id: str, left: Drawn) -> None:
    """Give back what a process did not draw of its advance: once (its row then reads ADVANCE_CLOSED)."""
    closed = conn.execute(
        f"UPDATE holds SET reserved = reserved - ?, reserved_cost = reserved_cost - ?, endpoint = '{ADVANCE_CLOSED}'"
        f" WHERE id = ? AND endpoint = '{ADVANCE}'",
        (*_reserved(left), advance_id),
    )
    if closed.rowcount:
        conn.execute(_GONE_IF_EMPTY, (advance_id,))
