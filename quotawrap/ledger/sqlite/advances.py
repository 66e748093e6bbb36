"""Advances' landing on the SQLite ledger (quotawrap.admission.advances): a call drawn from an advance split
into its own row of holds, drawn calls landed straight into calls, an advance's rest given back, and the
advances of dead processes released. One seam: it goes whole if advances go.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ...support.processes import pid_alive
from ..base import ADVANCE, ADVANCE_CLOSED, Drawn, Settle
from ..holds import step
from .file import CALL_COLUMNS
from .rows import RESERVE_COLUMNS, STEP_COLUMNS, Owed, step_values

__all__ = [
    "LANDED_TOGETHER",
    "close_advance",
    "drawn_runs",
    "land_drawn",
    "release_dead_advances",
    "split_from_advance",
]

# At most this many drawn calls are landed by one statement set (land_drawn): an advance holds ADVANCE_CALLS,
# and the statements that read a run's rows, one per length, stay few.
LANDED_TOGETHER = 32

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
INSERT INTO holds ({RESERVE_COLUMNS})
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
