"""The Redis ledger's waiting lines (ledger/lines.py): what the reserve scripts are told and answer about them.

A line is a sorted set of waiters by ticket plus a hash of their leases, in its scope's slot (the run's
``{qw:run:<run>}:line``, the model-day's ``{qw:md:<day>:<model>}:line``); tickets come from ``qw:tickets``.
The scripts check and change the lines in the same step as the limits (lua/lib.lua ``line_*``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ...core.quota import Counters, Limit, Verdict
from ..base import Decision, HoldRequest
from ..lines import LineName, line_limit
from .client import Client
from .keys import Keys
from .records import parse_model_day_member

__all__ = ["NO_LINE", "LineReply", "count_waiting", "leave", "leave_lines", "with_ticket"]

LINE_TTL_S = 86_400  # a line nobody joined for a day is dropped (a live one is renewed by every poll)


class LineReply(NamedTuple):
    """What a reserve script says of the lines: waiters ahead in each, its outcome, the call's ticket (0: none)."""

    ahead_run: int
    ahead_md: int
    outcome: str  # "" when the lines were not consulted, else a lines.Outcome
    ticket: int

    def decision(
        self,
        request: HoldRequest,
        ordered: Sequence[Limit],
        blocking: int,
        counters: Mapping[str, Counters],
        held: bool,
    ) -> Decision:
        ticket = self.ticket or request.ticket
        if blocking < 0:  # refused by the line itself: it could not wait and others wait ahead
            line: LineName = "model_day" if self.ahead_md else "run"
            limit = line_limit(line, self.ahead_md or self.ahead_run)
            return Decision(request.hold_id, Verdict(False, limit), False, counters, ticket=ticket)
        result = Verdict(True) if blocking == 0 else Verdict(False, ordered[blocking - 1])
        if self.outcome in ("queued", "wait"):
            ahead = max(self.ahead_run, self.ahead_md)
            return Decision(request.hold_id, result, False, counters, ahead, not ahead, ticket)
        return Decision(request.hold_id, result, held, counters, ticket=ticket)


NO_LINE = LineReply(0, 0, "", 0)


def count_waiting(client: Client, keys: Keys, now: float) -> dict[str, int]:
    """Per model, the live waiters of the model-day lines of the active model-days (today's and yesterday's);
    ``now``: the server's clock, which the scripts write the leases on."""
    counts: dict[str, int] = {}

    def read() -> None:
        for member in client.zrangebyscore(keys.active(), str(now - 2 * 86_400), "+inf"):
            day, model = parse_model_day_member(member)
            leases = client.hgetall(keys.md_line(day, model)[1])
            live = sum(1 for until in leases.values() if float(until or 0) > now)
            if live:
                counts[model] = counts.get(model, 0) + live

    client.retrying("read", read)
    return counts


def with_ticket(client: Client, keys: Keys, request: HoldRequest) -> HoldRequest:
    """Cluster: a call that may wait draws its ticket before its first reserve (a script touches one slot)."""
    if not request.can_wait or request.waiter is None or request.ticket is not None:
        return request
    ticket = client.retrying("reserve", lambda: client.incr(keys.tickets()))
    return dataclasses.replace(request, ticket=int(ticket))


def leave(client: Client, lines: Sequence[str], waiter: str) -> None:
    """Take ``waiter`` out of ``lines`` (pairs of line and leases, one slot on Cluster)."""
    client.retrying("leave", lambda: client.script("line_leave", lines, [waiter]))


def leave_lines(client: Client, keys: Keys, request: HoldRequest) -> None:
    """The waiter of ``request`` leaves the lines of its run and model-day."""
    if request.waiter is None:
        return
    run_line, md_line = keys.run_line(request.run_id), keys.md_line(request.day, request.model)
    if client.cluster:
        leave(client, run_line, request.waiter)
        leave(client, md_line, request.waiter)
    else:
        leave(client, [*run_line, *md_line], request.waiter)
