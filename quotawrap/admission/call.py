"""The reserve of one call, and its wait for room in the ledger's line, as steps the guard drives.

Each step yields the pause (seconds) before the next: ``Guard.begin`` sleeps it, ``Guard.abegin`` and the
gateway await it, so an event loop is never blocked. Order is the ledger's (ledger/lines.py): a call
that must wait holds a place in the lines of its run and model-day, by a ticket fixed at its first wait,
across threads, processes, runs and hosts.

* The head of its lines (the ledger answered *waiting*) polls fast, with a doubling backoff from
  5 ms to 250 ms, and a settle in this process wakes it at once. It looks at the counters before it
  asks (a read takes no lock), but asks at least every ``LEASE_S / 5`` to keep its place.
* A call queued behind others (the ledger answered *queued*) polls slower the further back it
  stands (25 ms per waiter ahead, at most 1 s), and a settle does not wake it: it only keeps its
  place and learns when it is at the head.
* Whatever ends the wait (admitted, refused, deadline, an error, a cancelled task) leaves the
  lines in ``finally``; a process that dies leaves them when its lease runs out.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Generator, Mapping
from typing import Any, NamedTuple, Protocol

from ..core import endpoints, quota
from ..core.endpoint_prices import CostRule
from ..core.errors import StoreError
from ..core.estimate import Estimate, Kind, usage_bound
from ..core.identity import UNMAPPED
from ..core.output_bound import without_bound_mark
from ..ledger import CallPath, HoldRequest
from ..ledger.base import Decision, Settle
from ..ledger.lines import LEASE_S
from ..settling import readahead
from ..settling.call import GuardedCall
from ..support.events import QueuedPause
from ..support.log import warn
from .advances import ENDPOINTS
from .room import Plan, Room, Wait, only_in_flight_in_the_way

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..config.settings import Settings
    from ..core.usage import UsageBound
    from ..support.events import BoundEvent, EventLog
    from .advances import Advances

__all__ = ["Admitter", "Call", "reserve_steps"]

_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.005, 0.25
_LAND_OWN_SETTLES_S = 1.0  # before refusing, how long a call waits for its own process's settles to land
_OTHERS_READ_AHEAD_S = 2.0  # and for the read-ahead of streams other threads of its process left
_ASK_AGAIN = 3  # at most this many times (a stream the cyclic collector closes meanwhile settles then)
_RENEW_S = LEASE_S / 5  # the head asks the ledger at least this often: every reserve renews its place
# A queued call polls every 25 ms per waiter ahead of it, at most every second: the next in line
# learns it is the head within 25 ms, and a long line asks the ledger some 40 times a second per
# 40 waiters ahead at most (each poll renews the lease, LEASE_S, which outlasts the slowest poll).
_QUEUED_PER_WAITER_S, _QUEUED_MAX_S = 0.025, 1.0
# Every call that may wait names itself, and most never wait: a random prefix drawn once, the pid
# (a forked child shares the prefix, never the pid) and a counter are unique across hosts for a
# fraction of a uuid4's cost.
_WAITER_PREFIX = os.urandom(8).hex()
_INF = float("inf")
_waiter_numbers = itertools.count()


class Call(NamedTuple):
    """What one call's reserve loop works from (fixed before it starts).

    A NamedTuple, as the ledger's Settle, rather than a frozen record: every guarded call makes one, and a
    frozen record sets each of its 13 fields through object.__setattr__, a cost on every call's path.
    """

    found: endpoints.Route
    kind: Kind
    url: str
    headers: Mapping[str, str]
    raw: bytes | None  # the request's body as the caller sent it
    request: dict[str, Any]
    model: str
    day: str
    now: float
    enforce: bool
    estimate: Estimate
    rule: CostRule
    refusal_status: int
    endpoint_id: str | None = None  # the endpoint id the request names (quotawrap.core.identity), if any


class Admitter(Protocol):
    """What a reserve loop needs of the process that drives it (the guard satisfies it): the store, the call's
    plan and hold, and the three ends of a call (admitted, refused, unreadable). This module never imports the
    guard, so the loop sees nothing of it beyond these."""

    @property
    def settings(self) -> Settings: ...

    @property
    def ledger(self) -> CallPath: ...

    @property
    def advances(self) -> Advances | None: ...

    @property
    def events(self) -> EventLog: ...

    def clock(self) -> float: ...

    def snapshot(self, model: str) -> quota.Snapshot | None: ...

    def plan(self, kind: Kind, url: str, request: dict[str, Any], model: str, room: Room, estimate: Estimate) -> Plan:
        """What the call is sent as and reserves, planned from the room's counters."""
        ...

    def hold(
        self,
        call: Call,
        plan: Plan,
        *,
        pid: int,
        waiter: str | None,
        ticket: int | None,
        can_wait: bool,
        hold_id: str | None = None,
    ) -> HoldRequest: ...

    def settles_in_transit(self) -> bool: ...

    def flush(self, timeout: float = -1) -> bool: ...

    def land(self, settle: Settle, landed: Callable[[], None] | None, bound: BoundEvent | None = None) -> None: ...

    def audit_refusal(self, plan: Plan, hold: HoldRequest, decision: Decision) -> None: ...

    def admitted(
        self, call: Call, plan: Plan, hold: HoldRequest, decision: Decision, answer_bound: UsageBound
    ) -> GuardedCall: ...

    def refused(
        self, call: Call, plan: Plan, hold: HoldRequest, decision: Decision, waited: Wait | None
    ) -> GuardedCall: ...

    def unreadable(self, model: str, exc: BaseException) -> GuardedCall: ...


def queued_poll(ahead: int) -> QueuedPause:
    """How long a call with ``ahead`` waiters before it waits before it asks again."""
    return QueuedPause(min(_QUEUED_MAX_S, _QUEUED_PER_WAITER_S * max(1, ahead)))


def _refits_lower(guard: Admitter, call: Call, room: Room, reserve: int) -> bool:
    """Whether the call, planned again from the counters just read, reserves less than ``reserve``: its bound
    fitted lower, or a reserve the cap can no longer hold sent with its max_tokens as the bound instead."""
    return guard.plan(call.kind, call.url, call.request, call.model, room, call.estimate).estimate.total < reserve


def _admit(guard: Admitter, call: Call, room: Room, hold: HoldRequest, *, first: bool) -> Decision:
    """The ledger's answer to ``hold``; where room is plenty, a call's first ask draws from (or takes) an advance
    of its process instead (quotawrap.admission.advances), so most calls do not ask the ledger."""
    advances = guard.advances
    if (
        advances is not None
        and first
        and call.enforce
        and call.found.endpoint in ENDPOINTS
        and call.model != UNMAPPED  # its hold must be checked against every model's room (Guard.admitted)
        and getattr(guard.ledger, "takes_advances", False)  # a Ledger written before advances takes none
        and not advances.declined  # its store refuses every advance (Redis Cluster): no limits to read for one
    ):
        drawn = advances.draw(hold, call.now)
        if drawn is not None:
            return drawn
        seen = room.last_seen()
        if seen is not None:
            limits = room.limits_for(guard.snapshot(call.model))
            taken = advances.take(hold, call.now, room.limits_for, limits, seen)
            if taken is not None:
                return taken
    return guard.ledger.reserve(hold, room.limits_for)


def reserve_steps(guard: Admitter, call: Call, room: Room) -> Generator[float, None, GuardedCall]:
    """Reserve for ``call``, waiting in line for room up to ``--wait``; the call's answer."""
    settings = guard.settings
    wait_s = settings.wait if call.enforce and 0 < settings.wait < _INF else 0.0
    deadline = time.monotonic() + wait_s
    waits = wait_s > 0
    pid = os.getpid()  # asked once a call: a system call each time (the hold and the waiter both name it)
    waiter = f"{_WAITER_PREFIX}-{pid}-{next(_waiter_numbers)}" if waits else None
    ticket: int | None = None
    wait: Wait | None = None
    head = False  # the ledger's last answer: at the head of its lines, waiting for holds in flight
    asked_at = -_INF
    backoff = _BACKOFF_MIN_S
    superseded = 0  # refused attempts this call left in the ledger before its final answer
    retry: str | None = None  # the hold id that names the next attempt the retry of the last of them
    asked_again = 0  # times asked again once this process's settles in transit had landed
    others_until = -_INF  # until then, the read-ahead of streams other threads left may make room
    outcome = "abandoned"
    hold: HoldRequest | None = None
    try:
        while True:
            try:  # nothing may raise once the hold is taken: whatever can, is computed here
                plan = guard.plan(call.kind, call.url, call.request, call.model, room, call.estimate)
                answer_bound = usage_bound(call.kind, plan.body, plan.estimate)
            except (ValueError, RecursionError) as exc:
                outcome = "refused"
                return guard.unreadable(call.model, exc)
            overdue = not waits or time.monotonic() >= deadline  # a call that cannot wait is past its deadline
            # a retry is numbered after the refused attempt: no view may count that one as blocked
            can_wait = waits and not overdue
            hold = guard.hold(call, plan, pid=pid, waiter=waiter, ticket=ticket, can_wait=can_wait, hold_id=retry)
            # The head looks before it asks (a read takes no lock), but asks often enough to keep its place.
            looks = head and not overdue and time.monotonic() - asked_at < _RENEW_S
            if looks and only_in_flight_in_the_way(room.read(), hold):
                yield backoff
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            drains = readahead.mine_pending() or (time.monotonic() < others_until and readahead.any_pending())
            if drains and only_in_flight_in_the_way(room.read(), hold):
                yield _BACKOFF_MAX_S  # left streams are being read ahead: their settles make the room
                continue
            # A call that cannot wait looks before it asks: when only holds in flight are in the way and its
            # own process's settles are on their way, it lands them first, so no refused row is left.
            if (
                not waits
                and not asked_again
                and guard.settles_in_transit()
                and only_in_flight_in_the_way(room.read(), hold)
            ):
                asked_again += 1
                guard.flush(_LAND_OWN_SETTLES_S)
            try:
                decision = _admit(guard, call, room, hold, first=retry is None and ticket is None)
            except StoreError:  # the hold may have landed before the link broke: never sent, give it back
                guard.land(Settle(hold.hold_id, "release"), None)
                raise
            asked_at = time.monotonic()
            room.seen(decision.counters)
            ticket = decision.ticket if decision.ticket is not None else ticket
            if decision.held:
                outcome = "admitted"
                return guard.admitted(call, plan, hold, decision, answer_bound)
            if decision.queued or decision.waiting:
                if wait is None:
                    wait = Wait(guard.events, call.model, guard.clock)
                    readahead.leave_all()  # streams left unread may hold the room it waits for
                head = decision.waiting
                if head:
                    yield backoff
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                else:
                    backoff = _BACKOFF_MIN_S
                    yield queued_poll(decision.queued)
                continue
            limits = room.limits_for(guard.snapshot(call.model))
            never = quota.never_fits(limits, decision.counters, hold.reserve, reserve_cost=hold.reserve_cost)
            # The plan was made from counters since outgrown: plan it from these and ask again.
            refits = never is not None and _refits_lower(guard, call, room, hold.reserve)
            # What is in the way may be this process's own finished calls, whose settles are still on their
            # way to the ledger (settled off the caller's path), or streams another thread of it left unread:
            # refusing for them would be a false block under --wait 0. Land the settles (a few ms), give the
            # read-aheads a moment (their end is usually already received), and ask once more.
            again = never is None and asked_again < _ASK_AGAIN
            left = again and readahead.leave_all()
            # after the read-aheads: looking at the streams may let the collector close one, which settles it
            in_transit = again and guard.settles_in_transit()
            if refits or in_transit or left:
                superseded += 1
                from ..settling.audit import retry_id  # rare: the report's module loads only then

                retry = retry_id(without_bound_mark(hold.hold_id))  # no view counts the refused attempt as blocked
                guard.audit_refusal(plan, hold, decision)
                if not refits:
                    asked_again += 1
                if left:
                    others_until = time.monotonic() + _OTHERS_READ_AHEAD_S
                if in_transit:
                    guard.flush(_LAND_OWN_SETTLES_S)
                continue
            outcome = "refused"
            return guard.refused(call, plan, hold, decision, wait)
    finally:
        if ticket is not None and hold is not None and outcome != "admitted":  # admission took it out of line
            try:
                guard.ledger.leave_line(hold)
            except Exception as exc:  # its lease runs out instead
                warn(f"could not leave the waiting line: {exc}; the others wait at most {LEASE_S:.0f}s more")
        if wait is not None:
            wait.done(outcome, superseded)
        elif superseded:
            guard.events.write({"ev": "superseded", "model": call.model, "n": superseded})
