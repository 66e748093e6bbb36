"""The SQLite ledger's waiting lines (ledger/lines.py): a call's place, read and changed inside the reserve's
``BEGIN IMMEDIATE`` transaction, so the lines and the counters are checked in one atomic step."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence

from ...core.quota import Counters, Limit, Verdict, never_fits
from ..base import Decision, HoldRequest
from ..holds import clamp
from ..lines import LEASE_S, Entry, LineName, Outcome, ahead, crowded, decide, line_limit, reads_room
from ..scopes import model_day_key, run_key

__all__ = ["Place", "WaiterRow", "count_waiting", "leave"]

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
        (``sqlite_reserve.read_for_reserve``); ``scopes``: the call's counter keys (``scope_keys``), which
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
