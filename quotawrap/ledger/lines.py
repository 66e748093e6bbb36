"""Waiting lines kept in the ledger: who may take room now (first come, first served).

A call that does not fit only because of holds in flight waits in a line, and the reserve of
every call checks the lines it touches in the same atomic step that checks the limits. Both
stores apply the rule below; lua/lib.lua mirrors it (``line_ahead``, ``line_crowded``,
``line_decide``), proven equal by tests/unit/test_ledger_lua.py.

* **Lines.** One per run (its token and cost caps: every call of a run touches both, so one
  line serves both) and one per model-day (the daily cap, the synced pool). A call touches the
  line of its run and the line of its model-day.
* **Tickets.** A waiter takes one ticket from a ledger-wide sequence at its first wait and keeps
  it: it stands at the same place in every line it joins, so the order is total and two
  waiters can never each wait for the other across lines. Equal tickets (none in practice) are
  ordered by waiter id.
* **The rule.** A call may take room only when no live waiter stands ahead of it in any line it
  touches (:func:`ahead` is 0 for both). Otherwise it is *queued*: it joins the lines where
  others stand ahead, writes no refused row and changes no counter. A waiter at the head whose
  call does not fit only because of holds in flight *waits*: it joins the lines of the limits
  that refused it. A call that cannot wait (``--wait 0``, its deadline passed) and finds others
  ahead is refused by the line itself (``LINE_LIMIT``). Admission takes the waiter out of every
  line in the same step; a call that gives up leaves its lines.
* **Leases.** A waiter's place lasts :data:`LEASE_S` seconds from its last reserve; every poll
  renews it. A waiter whose process died is skipped once its lease ran out (and dropped by the
  next reserve that reads the line), so a crash never blocks the others for longer than that.
* ``--watch`` enforces nothing, so lines do not apply to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, NamedTuple

from ..core.quota import Counters, Limit, Scope, charge

__all__ = [
    "LEASE_S",
    "LINES",
    "LINE_LIMIT",
    "Answer",
    "Entry",
    "LineName",
    "Outcome",
    "ahead",
    "crowded",
    "decide",
    "line_limit",
    "line_of",
    "reads_room",
]

# Seconds a waiter's place outlives its last poll. Waiters poll at most every LEASE_S / 5 (the
# guard's slow poll), so a live waiter keeps its place through a busy second or two of its host;
# a dead one blocks the line at most this long.
LEASE_S = 5.0

LineName = Literal["run", "model_day"]
LINES: tuple[LineName, ...] = ("run", "model_day")
LINE_LIMIT = "waiting_line"  # the name of the "limit" a call refused by the line is blocked by

# What a reserve does: take the hold; refuse it (a blocked row); queue it behind waiters ahead;
# wait at the head for holds in flight; refuse a call that cannot wait because others wait ahead.
Outcome = Literal["take", "refuse", "queued", "wait", "line_refused"]


def line_of(scope: Scope) -> LineName:
    return "model_day" if scope == "model_day" else "run"


class Entry(NamedTuple):
    """One waiter's place in one line."""

    ticket: int
    waiter: str
    until: float  # its lease


def ahead(entries: Iterable[Entry], waiter: str | None, ticket: int | None, now: float) -> int:
    """How many live waiters stand ahead of a call in one line.

    A waiter whose lease ran out (``until <= now``) is not counted; a call without a ticket
    stands behind every live waiter; a call never stands behind itself.
    """
    count = 0
    for entry in entries:
        if entry.until <= now or entry.waiter == waiter:
            continue
        if ticket is None or waiter is None or (entry.ticket, entry.waiter) < (ticket, waiter):
            count += 1
    return count


def crowded(
    limits: Sequence[Limit], counters: Mapping[str, Counters], reserve: int, *, reserve_cost: int = 0
) -> tuple[LineName, ...]:
    """The lines of the hold limits the call does not fit now (in ``LINES`` order): where it waits."""
    found: set[LineName] = set()
    for limit in limits:
        if limit.kind != "hold":
            continue
        c = counters.get(limit.scope, Counters())
        if c.settled + c.in_flight + charge(limit.scope, reserve, reserve_cost) > limit.cap:
            found.add(line_of(limit.scope))
    return tuple(line for line in LINES if line in found)


class Answer(NamedTuple):
    outcome: Outcome
    join: tuple[LineName, ...]  # the lines the waiter joins (it keeps any place it has)


def decide(
    aheads: Mapping[LineName, int],
    *,
    allowed: bool,
    never: bool,
    crowd: Sequence[LineName],
    can_wait: bool,
    enforce: bool,
) -> Answer:
    """The rule: what a reserve does, given the waiters ahead of it in each line it touches.

    ``allowed``: quota.verdict lets the call through; ``never``: quota.never_fits names a limit
    (waiting cannot help); ``crowd``: :func:`crowded`; ``can_wait``: the call waits for room
    (a waiter before its deadline); ``enforce``: False in ``--watch`` (hold whatever the answer).
    """
    if not enforce:
        return Answer("take", ())
    behind = tuple(line for line in LINES if aheads.get(line, 0) > 0)
    if behind:
        return Answer("queued", behind) if can_wait else Answer("line_refused", ())
    if allowed:
        return Answer("take", ())
    if can_wait and not never:
        return Answer("wait", tuple(crowd))
    return Answer("refuse", ())


def reads_room(aheads: Mapping[LineName, int], *, allowed: bool, can_wait: bool, enforce: bool) -> bool:
    """Whether :func:`decide` reads ``never`` and ``crowd`` for this call: only a call at the head of its
    lines that does not fit and may wait. Every other call is decided without them, so a reserve can skip
    computing them (most calls fit and nobody waits)."""
    return enforce and not allowed and can_wait and not any(aheads.get(line, 0) > 0 for line in LINES)


def line_limit(line: LineName, waiting: int) -> Limit:
    """The "limit" a call that cannot wait is refused by when others wait ahead of it."""
    scope: Scope = "model_day" if line == "model_day" else "run"
    where = "this model today" if line == "model_day" else "this run"
    detail = f"{waiting} call(s) wait for room ahead of it on {where}: first come, first served"
    return Limit(LINE_LIMIT, scope, 0, "hold", detail)
