"""What the SQLite ledger runs to reserve, prepared once: the reserve's one read and its row, what is in flight
(summed from holds), the counters' upsert, a call's tags as its row keeps them, and the call's place in the
waiting lines (ledger/lines.py), read and changed inside the reserve's ``BEGIN IMMEDIATE`` transaction, so
the lines and the counters are checked in one atomic step.

A reserve runs inside ``BEGIN IMMEDIATE`` on the caller's path, so every statement counts: each costs
set-up (Python's and SQLite's) before it does anything.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence

from ...core.identity import UNMAPPED
from ...core.quota import Counters, Limit, Snapshot, Verdict, never_fits
from ..base import Decision, HoldRequest
from ..holds import clamp
from ..lines import LEASE_S, Entry, LineName, Outcome, ahead, crowded, decide, line_limit, reads_room
from ..scopes import ModelDay, Run, RunCost, model_day_key, parse_counter_key, run_key
from .rows import RESERVE_COLUMNS

__all__ = [
    "BUMP",
    "IN_FLIGHT",
    "RESERVE_INTO_CALLS",
    "RESERVE_INTO_HOLDS",
    "SNAPSHOT_COLUMNS",
    "Place",
    "WaiterRow",
    "count_waiting",
    "leave",
    "read_counters",
    "read_for_reserve",
    "tags_column",
]


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
UNION ALL SELECT 4, budget, NULL, NULL, NULL, NULL, NULL FROM budgets WHERE run_id IN ('', ?6)
UNION ALL SELECT 3, {_SUMS}, NULL, NULL FROM holds
"""


def read_for_reserve(
    conn: sqlite3.Connection, scopes: Mapping[str, str], call: tuple[str, str, str], enforce: bool
) -> tuple[dict[str, Counters], Snapshot | None, list[WaiterRow], list[str]]:
    """The counters of ``scopes`` (scope_keys of ``call``, its (run, model, day); missing ones read as zero),
    the model's snapshot, the rows of the call's two waiting lines (none unless it enforces), and the budgets
    that may apply to it as stored (the ledger's and its run's own: ledger/sqlite/budgets.py).

    A model's model-day counters include the calls to endpoints whose model is not known yet (their model-day
    is UNMAPPED's): any of them may turn out to be this model (README, "One identity per model")."""
    run_id, model, day = call
    settled: dict[str, int] = {}
    in_flight = (0, 0, 0, 0)
    snapshot: Snapshot | None = None
    waiting: list[WaiterRow] = []
    budgets: list[str] = []
    unmapped = model_day_key(UNMAPPED, day)
    params = (scopes["run"], scopes["model_day"], scopes["run_cost"], model, enforce, run_id, day, unmapped, UNMAPPED)
    for kind, *row in conn.execute(_RESERVE_READS, params):
        if kind == 0:
            settled[row[0]] = row[1]
        elif kind == 1:
            snapshot = Snapshot(*row)
        elif kind == 2:
            waiting.append((row[0], row[1], row[2], row[3]))
        elif kind == 4:
            budgets.append(row[0])
        else:
            in_flight = (row[0] or 0, row[1] or 0, row[2] or 0, row[3] or 0)
    held = dict(zip(IN_FLIGHT, in_flight, strict=False))
    counters = {scope: Counters(settled.get(key, 0), held[scope]) for scope, key in scopes.items()}
    if model != UNMAPPED:
        own = counters["model_day"]
        counters["model_day"] = Counters(own.settled + settled.get(unmapped, 0), own.in_flight + in_flight[3])
    return counters, snapshot, waiting, budgets


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


# A reserve's row (RESERVE_COLUMNS): a hold taken goes to holds, a refusal straight to calls (it is final).
RESERVE_INTO_HOLDS, RESERVE_INTO_CALLS = (
    f"INSERT INTO {table} ({RESERVE_COLUMNS}) VALUES ({', '.join('?' * 16)})" for table in ("holds", "calls")
)
WaiterRow = tuple[str, int, str, float]  # (line, ticket, waiter, until): one waiter's row in one line


class Place:
    """A call's place in the lines of its run and model-day, inside the reserve's transaction."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        request: HoldRequest,
        now: float,
        waiting: Sequence[WaiterRow],
        scopes: Mapping[str, str],
    ) -> None:
        """``waiting``: the rows of the call's two lines, read in the reserve's transaction
        (read_for_reserve); ``scopes``: the call's counter keys (``scope_keys``), which
        name its lines."""
        lines: dict[LineName, str] = {"run": scopes["run"], "model_day": scopes["model_day"]}
        self._conn, self._request, self._lines, self._now = conn, request, lines, now
        self.ticket = request.ticket
        self.aheads: dict[LineName, int] = {"run": 0, "model_day": 0}
        if not request.enforce or not waiting:  # nearly always both lines are empty: nobody ahead
            return
        names = {line: name for name, line in lines.items()}
        read: dict[LineName, list[Entry]] = {"run": [], "model_day": []}
        for line, ticket, waiter, until in waiting:
            read[names[line]].append(Entry(ticket, waiter, until))
        for entries in read.values():
            for entry in entries:
                if entry.waiter == request.waiter and entry.until > now and self.ticket is None:
                    self.ticket = entry.ticket
        for name, entries in read.items():
            self.aheads[name] = ahead(entries, request.waiter, self.ticket, now)
            if any(entry.until <= now for entry in entries):  # a dead waiter's place: dropped
                conn.execute("DELETE FROM waiters WHERE line = ? AND until <= ?", (lines[name], now))

    def decide(self, limits: Sequence[Limit], counters: Mapping[str, Counters], allowed: bool) -> Outcome:
        """lines.decide for this call; joins the lines it says, and leaves them all when the call is taken."""
        crowd: tuple[LineName, ...]
        request = self._request
        reserve, reserve_cost = clamp(request.reserve), clamp(request.reserve_cost)
        can_wait = request.can_wait and request.waiter is not None
        never, crowd = False, ()  # read only where decide reads them (lines.reads_room)
        if reads_room(self.aheads, allowed=allowed, can_wait=can_wait, enforce=request.enforce):
            never = never_fits(limits, counters, reserve, reserve_cost=reserve_cost) is not None
            crowd = crowded(limits, counters, reserve, reserve_cost=reserve_cost)
        answer = decide(
            self.aheads, allowed=allowed, never=never, crowd=crowd, can_wait=can_wait, enforce=request.enforce
        )
        if answer.outcome in ("queued", "wait"):
            self.join(answer.join)
        elif answer.outcome == "take":
            self.leave()
        return answer.outcome

    def decision(self, verdict: Verdict, counters: Mapping[str, Counters]) -> Decision:
        """The answer of a call that stays in line: nothing held, no row written."""
        queued = max(self.aheads.values())
        return Decision(self._request.hold_id, verdict, False, counters, queued, not queued, self.ticket)

    def join(self, names: tuple[LineName, ...]) -> int:
        """Join ``names`` and renew the lease in every line of the call; returns its ticket."""
        request, conn = self._request, self._conn
        if self.ticket is None:
            conn.execute(
                "INSERT INTO meta VALUES ('ticket', '1') ON CONFLICT (key)"
                " DO UPDATE SET value = CAST(value AS INTEGER) + 1"
            )
            self.ticket = int(conn.execute("SELECT value FROM meta WHERE key = 'ticket'").fetchone()[0])
        until = self._now + LEASE_S
        conn.execute(
            "UPDATE waiters SET until = ? WHERE waiter = ? AND line IN (?, ?)",
            (until, request.waiter, *self._lines.values()),
        )
        for name in names:
            conn.execute(
                "INSERT OR IGNORE INTO waiters VALUES (?, ?, ?, ?, ?)",
                (self._lines[name], request.waiter, self.ticket, until, request.model),
            )
        return self.ticket

    def refusal(self) -> Verdict:
        """The verdict of a call that cannot wait and finds others waiting ahead of it."""
        line: LineName = "model_day" if self.aheads["model_day"] else "run"
        return Verdict(False, line_limit(line, self.aheads[line]))

    def leave(self) -> None:
        if self._request.waiter is not None and self.ticket is not None:
            leave(self._conn, self._request.waiter, tuple(self._lines.values()))

    @staticmethod
    def leave_lines(conn: sqlite3.Connection, request: HoldRequest) -> None:
        """The waiter of ``request`` leaves the lines of its run and model-day (it gave up)."""
        if request.waiter is not None:
            leave(conn, request.waiter, (run_key(request.run_id), model_day_key(request.model, request.day)))


def leave(conn: sqlite3.Connection, waiter: str, lines: tuple[str, ...]) -> None:
    conn.execute(f"DELETE FROM waiters WHERE waiter = ? AND line IN ({','.join('?' * len(lines))})", (waiter, *lines))


def count_waiting(conn: sqlite3.Connection, now: float) -> dict[str, int]:
    """Per model, the live waiters of every line (a waiter in two lines counts once)."""
    rows = conn.execute(
        "SELECT model, COUNT(DISTINCT waiter) FROM waiters WHERE until > ? GROUP BY model", (now,)
    ).fetchall()
    return {model: count for model, count in rows}
