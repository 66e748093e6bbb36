"""One call's admission, from its estimate to the decision: :class:`Admission` plans it, reserves, waits for room
in the ledger's line, and admits or refuses it.

Its steps yield the pause (seconds) before the next: ``Guard.begin`` sleeps it, ``Guard.abegin`` and the
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

An admission never sees the guard: what it needs of its process is one :class:`AdmissionServices`, built once.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from ..config.settings import Settings
from ..core import endpoints, quota
from ..core.endpoint_prices import CostRule
from ..core.errors import StoreError
from ..core.estimate import (
    Estimate,
    EstimateSettings,
    Kind,
    ReasoningReserve,
    estimate_request,
    unbounded_thinking,
    usage_bound,
)
from ..core.identity import UNMAPPED
from ..core.model_limits import reasoning_ceiling
from ..core.output_bound import bound_mark, without_bound_mark
from ..core.redact import key_fingerprint
from ..core.retry_mark import retry_id
from ..core.synthetic import SyntheticResponse, blocked_response
from ..core.tokens import TokenizerUnavailable, utf8_bound
from ..ledger import CallPath, HoldRequest
from ..ledger.base import Decision, Settle, new_hold_id
from ..ledger.lines import LEASE_S
from ..settling import readahead
from ..settling.books import Books
from ..settling.call import CallContext, GuardedCall
from ..settling.followups import FollowupServices, followup_for
from ..settling.sink import Landing
from ..support.events import EventLog, QueuedPause
from ..support.log import warn
from .advances import ENDPOINTS
from .allowance import AllowanceBook
from .room import Plan, Room, Wait, only_in_flight_in_the_way, plan_output

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..core.usage import UsageBound
    from .advances import Advances
    from .unmapped import EveryModel

__all__ = ["Admission", "AdmissionServices", "Estimator", "queued_poll", "unreadable"]

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
_CHEAP_SHARE = 0.01  # of the smallest token cap: inputs bounded below it never load a tokenizer


class Estimator:
    """The estimate a guard reserves for a request (whoever sizes calls to fit must use it); one per process."""

    __slots__ = ("_settings", "_token_cap", "_warned")

    def __init__(self, settings: EstimateSettings, token_cap: int) -> None:
        """``token_cap``: the smallest cap on tokens held at once the settings alone fix (run cap, daily cap)."""
        self._settings = settings
        self._token_cap = token_cap
        self._warned = False

    def __call__(
        self,
        kind: str,
        request: Mapping[str, Any],
        *,
        enforce: bool = True,
        count: Callable[[str, str], int] | None = None,
    ) -> Estimate:
        """``ValueError`` for a body it cannot judge. With ``enforce``, counting stops once the input passes the
        smallest cap (the call is refused anyway). ``count``: how to count text instead of the model's tokenizer."""
        if count is not None:
            return estimate_request(kind, request, self._settings, count=count)  # type: ignore[arg-type]
        cap = self._token_cap
        # Below this share of the cap the UTF-8 bound is used as is: its surplus over the exact count
        # (held only until the call settles) costs less than that share, and no tokenizer is loaded.
        exact_above = int(cap * _CHEAP_SHARE)
        stop_above = cap if enforce else None  # in --watch the call goes out: count it all
        try:
            return estimate_request(
                kind,  # type: ignore[arg-type]
                request,
                self._settings,
                exact_above=exact_above,
                stop_above=stop_above,
            )
        except TokenizerUnavailable as exc:
            # Still guarded, never less safe: a BPE token is at least one UTF-8 byte.
            if not self._warned:
                self._warned = True
                warn(f"{exc}; estimating inputs by their UTF-8 byte count instead (an upper bound)")
            return estimate_request(kind, request, self._settings, count=utf8_bytes)  # type: ignore[arg-type]


class AdmissionServices(NamedTuple):
    """What every admission of one process needs of it, built once by the guard (so a call costs no more)."""

    ledger: CallPath
    settings: Settings
    clock: Callable[[], float]
    events: EventLog
    advances: Advances | None
    allowances: AllowanceBook
    estimate: Estimator
    estimate_settings: EstimateSettings
    reasoning_reserve: ReasoningReserve
    books: Books
    sink: Landing
    followups: FollowupServices
    every_model: EveryModel  # what a call whose model is not known yet must fit


class Admission:
    """One call from its estimate to the decision: plan, reserve, wait, admit or refuse. One per call."""

    __slots__ = (
        "endpoint_id",
        "enforce",
        "estimate",
        "found",
        "headers",
        "kind",
        "model",
        "now",
        "raw",
        "refusal_status",
        "request",
        "room",
        "rule",
        "services",
        "url",
    )

    def __init__(
        self,
        services: AdmissionServices,
        found: endpoints.Route,
        url: str,
        headers: Mapping[str, str],
        raw: bytes | None,
        request: dict[str, Any],
        room: Room,
        now: float,
        endpoint_id: str | None = None,
    ) -> None:
        """``room``: the (model, day) the call is counted in, the guard's (one per model and day); ``raw``: the
        request's body as the caller sent it; ``endpoint_id``: the endpoint id it names (core.identity), if any."""
        self.services = services
        self.found = found
        self.kind: Kind = found.kind or "chat"
        self.url = url
        self.headers = headers
        self.raw = raw
        self.request = request
        self.room = room
        self.model = room.model
        self.now = now
        self.endpoint_id = endpoint_id
        self.enforce = not services.settings.watch
        # Ark's batch client retries every 429 until its timeout (x-should-retry ignored), but never a 403,
        # the status Ark itself gives when spending must stop (AccountOverdueError).
        self.refusal_status = 403 if found.endpoint.startswith("batch_") else 429

    def steps(self) -> Generator[float, None, GuardedCall]:
        """The call's answer, each yield a pause (seconds) while it waits for room."""
        room, model, request = self.room, self.model, self.request
        evicted = room.evicted(self.now) if self.enforce else None
        if evicted is not None:
            verdict, counters = evicted
            return GuardedCall.refused(blocked_response(model, verdict, counters, 0, status=self.refusal_status))
        estimate = self.services.estimate
        try:
            if model == UNMAPPED:  # its tokenizer is not known: a token is at least one UTF-8 byte of any
                self.estimate = estimate(self.kind, request, enforce=self.enforce, count=utf8_bytes)
            elif model != request.get("model"):  # counted by the tokenizer of the model it is, not of its name
                self.estimate = estimate(self.kind, {**request, "model": model}, enforce=self.enforce)
            else:
                self.estimate = estimate(self.kind, request, enforce=self.enforce)
            if self.found.endpoint == "context_chat":  # the cached context is read too (settling/followups.py)
                cached = self.services.followups.contexts.size(request.get("context_id"))
                self.estimate = replace(self.estimate, input_tokens=self.estimate.input_tokens + cached)
            self.rule = CostRule.for_request(self.found.endpoint, request, self.estimate)
        except (ValueError, RecursionError) as exc:
            return self.unreadable(exc)
        return (yield from self._reserve())

    def plan(self) -> Plan:
        """What a call that may think without a whole-output bound is sent as and reserves (bots, batch and
        context chat too: their API takes the chat body); see ``room.plan_output``."""
        kind, request, model, room = self.kind, self.request, self.model, self.room
        if kind not in ("chat", "responses") or not unbounded_thinking(kind, request):
            return Plan(self.estimate, request, None)
        services = self.services
        settings = services.settings
        # --watch observes the program as it is: it changes no request
        boundable = settings.bound and not settings.watch
        policy = services.reasoning_reserve
        learns = boundable and (policy == "learned" or kind != "chat" or not request.get("max_tokens"))
        reasoning = services.allowances.reasoning(model) if learns else None
        space = room.token_space
        if model == UNMAPPED:  # it must fit every model's room, not its own alone
            space = lambda: services.every_model.space(room.token_space())  # noqa: E731
            if learns and reasoning is None:
                # Not a whole day's bound for one call: the most any guarded model learned, else the thinking floor
                # alone (its first answer tells the model).
                learned = [services.allowances.reasoning(m) for m in services.every_model.models()]
                reasoning = max((r for r in learned if r is not None), default=0)
        return plan_output(
            kind,
            request,
            self.estimate,
            services.estimate_settings,
            boundable=boundable,
            policy=policy,
            ceiling=reasoning_ceiling(model),
            reasoning=reasoning,
            token_space=space,
            token_cap=room.token_cap,
        )

    def hold(
        self, plan: Plan, *, pid: int, waiter: str | None, ticket: int | None, can_wait: bool, hold_id: str | None
    ) -> HoldRequest:
        """The hold of one attempt; ``hold_id``: the id to number it by (a retry's), a new one if None. A call
        sent with the guard's bound carries it in its id (``output_bound.bound_mark``)."""
        hold_id = hold_id or new_hold_id()
        if plan.bound is not None:
            hold_id += bound_mark(plan.how, plan.bound)
        services = self.services
        books = services.books
        return HoldRequest(
            run_id=books.run_id,
            model=self.model,
            day=self.room.day,
            reserve=plan.estimate.total,
            endpoint=self.found.endpoint or self.kind,
            pid=pid,
            host=books.host,
            # a video task's hold is handed over to the task once created (see settling/followups.py)
            expires_at=self.now + services.settings.hold_ttl,
            enforce=self.enforce,
            key_fingerprint=key_fingerprint(self.headers),
            tags=books.tags,
            reserve_cost=books.reserve_cost(self._priced_as(), plan.estimate, self.rule),
            waiter=waiter,
            ticket=ticket,
            can_wait=can_wait,
            hold_id=hold_id,
        )

    def _priced_as(self) -> str:
        """What the call's hold is priced as: its model; while an endpoint's model is not known, the endpoint's own
        entry of the price table ([prices."ep-..."]) if it has one, else the table's default."""
        endpoint_id = self.endpoint_id
        if self.model == UNMAPPED and endpoint_id is not None and self.services.books.prices.price_for(endpoint_id):
            return endpoint_id
        return self.model

    def admitted(self, plan: Plan, hold: HoldRequest, decision: Decision, answer_bound: UsageBound) -> GuardedCall:
        """The call the adapter sends: its body as planned (with usage asked for in a stream, hidden again)."""
        kind, request, body = self.kind, self.request, plan.body
        hide = False
        new_body: bytes | None = None
        if (
            self.services.settings.inject_usage
            and kind in ("chat", "completions")
            and endpoints.stream_requested(body)
            and not endpoints.wants_usage(body)
            # stream_options that is not an object is the provider's to refuse, not ours to rewrite
            and isinstance(body.get("stream_options"), (Mapping, type(None)))
        ):
            new_body = endpoints.with_usage_requested(body)
            hide = True
        elif body is not request:  # the request with its bound added (Plan.body)
            new_body = endpoints.encode_added(self.raw, request, body)
        context = CallContext.of_hold(hold, decision, self.now, plan.bound, plan.how)
        guarded = GuardedCall(
            decision.hold_id,
            self.model,
            new_body=new_body,
            hide_usage_chunk=hide,
            sink=self.services.sink,
            context=context,
            bound=answer_bound,
        )
        guarded.cost_rule = self.rule
        guarded.endpoint_id = self.endpoint_id
        guarded.followup = followup_for(self.found, hold, self.services.followups)
        return guarded

    def audit_refusal(self, plan: Plan, hold: HoldRequest, decision: Decision) -> None:
        context = CallContext.of_hold(hold, decision, self.services.clock(), plan.bound)
        self.services.books.audit(context, "blocked", None, 0, 0.0)

    def refused(self, plan: Plan, hold: HoldRequest, decision: Decision, waited: Wait | None) -> GuardedCall:
        self.audit_refusal(plan, hold, decision)
        response = blocked_response(
            self.model, decision.verdict, decision.counters, hold.reserve, hold.reserve_cost, status=self.refusal_status
        )
        if waited is not None and waited.seconds() >= 0.001:
            response = response.with_note(f" (refused after waiting {waited.seconds():.1f}s for room; --wait)")
        return GuardedCall.refused(response)

    def unreadable(self, exc: BaseException) -> GuardedCall:
        return unreadable(f"quotawrap cannot estimate this request to {self.model}: {reason(exc)}")

    def _refits_lower(self, reserve: int) -> bool:
        """Whether the call, planned again from the counters just read, reserves less than ``reserve``: its bound
        fitted lower, or a reserve the cap can no longer hold sent with its max_tokens as the bound instead."""
        return self.plan().estimate.total < reserve

    def _admit(self, hold: HoldRequest, *, first: bool) -> Decision:
        """The ledger's answer to ``hold``; where room is plenty, a call's first ask draws from (or takes) an advance
        of its process instead (quotawrap.admission.advances), so most calls do not ask the ledger."""
        services, room = self.services, self.room
        advances = services.advances
        if (
            advances is not None
            and first
            and self.enforce
            and self.found.endpoint in ENDPOINTS
            and self.model != UNMAPPED  # its hold must be checked against every model's room (Guard.admission)
            and getattr(services.ledger, "takes_advances", False)  # a Ledger written before advances takes none
            and not advances.declined  # its store refuses every advance (Redis Cluster): no limits to read for one
        ):
            drawn = advances.draw(hold, self.now)
            if drawn is not None:
                return drawn
            seen = room.last_seen()
            if seen is not None:
                limits = room.limits_for(room.snapshot())
                taken = advances.take(hold, self.now, room.limits_for, limits, seen)
                if taken is not None:
                    return taken
        return services.ledger.reserve(hold, room.limits_for)

    def _reserve(self) -> Generator[float, None, GuardedCall]:
        """Reserve for the call, waiting in line for room up to ``--wait``; the call's answer."""
        services, room, model = self.services, self.room, self.model
        sink = services.sink
        settings = services.settings
        wait_s = settings.wait if self.enforce and 0 < settings.wait < _INF else 0.0
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
                    plan = self.plan()
                    answer_bound = usage_bound(self.kind, plan.body, plan.estimate)
                except (ValueError, RecursionError) as exc:
                    outcome = "refused"
                    return self.unreadable(exc)
                overdue = not waits or time.monotonic() >= deadline  # a call that cannot wait is past its deadline
                # a retry is numbered after the refused attempt: no view may count that one as blocked
                can_wait = waits and not overdue
                hold = self.hold(plan, pid=pid, waiter=waiter, ticket=ticket, can_wait=can_wait, hold_id=retry)
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
                    and sink.settles_in_transit()
                    and only_in_flight_in_the_way(room.read(), hold)
                ):
                    asked_again += 1
                    sink.flush(_LAND_OWN_SETTLES_S)
                try:
                    decision = self._admit(hold, first=retry is None and ticket is None)
                except StoreError:  # the hold may have landed before the link broke: never sent, give it back
                    sink.land(Settle(hold.hold_id, "release"), None)
                    raise
                asked_at = time.monotonic()
                room.seen(decision.counters)
                ticket = decision.ticket if decision.ticket is not None else ticket
                if decision.held:
                    outcome = "admitted"
                    return self.admitted(plan, hold, decision, answer_bound)
                if decision.queued or decision.waiting:
                    if wait is None:
                        wait = Wait(services.events, model, services.clock)
                        readahead.leave_all()  # streams left unread may hold the room it waits for
                    head = decision.waiting
                    if head:
                        yield backoff
                        backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    else:
                        backoff = _BACKOFF_MIN_S
                        yield queued_poll(decision.queued)
                    continue
                limits = room.limits_for(room.snapshot())
                blocking = decision.verdict.blocking
                if blocking is not None and blocking not in limits:  # a budget's: the ledger keeps those, not the room
                    limits = [*limits, blocking]
                never = quota.never_fits(limits, decision.counters, hold.reserve, reserve_cost=hold.reserve_cost)
                # The plan was made from counters since outgrown: plan it from these and ask again.
                refits = never is not None and self._refits_lower(hold.reserve)
                # What is in the way may be this process's own finished calls, whose settles are still on their
                # way to the ledger (settled off the caller's path), or streams another thread of it left unread:
                # refusing for them would be a false block under --wait 0. Land the settles (a few ms), give the
                # read-aheads a moment (their end is usually already received), and ask once more.
                again = never is None and asked_again < _ASK_AGAIN
                left = again and readahead.leave_all()
                # after the read-aheads: looking at the streams may let the collector close one, which settles it
                in_transit = again and sink.settles_in_transit()
                if refits or in_transit or left:
                    superseded += 1

                    retry = retry_id(without_bound_mark(hold.hold_id))  # no view counts the refused attempt as blocked
                    self.audit_refusal(plan, hold, decision)
                    if not refits:
                        asked_again += 1
                    if left:
                        others_until = time.monotonic() + _OTHERS_READ_AHEAD_S
                    if in_transit:
                        sink.flush(_LAND_OWN_SETTLES_S)
                    continue
                outcome = "refused"
                return self.refused(plan, hold, decision, wait)
        finally:
            if ticket is not None and hold is not None and outcome != "admitted":  # admission took it out of line
                try:
                    services.ledger.leave_line(hold)
                except Exception as exc:  # its lease runs out instead
                    warn(f"could not leave the waiting line: {exc}; the others wait at most {LEASE_S:.0f}s more")
            if wait is not None:
                wait.done(outcome, superseded)
            elif superseded:
                services.events.write({"ev": "superseded", "model": model, "n": superseded})


def queued_poll(ahead: int) -> QueuedPause:
    """How long a call with ``ahead`` waiters before it waits before it asks again."""
    return QueuedPause(min(_QUEUED_MAX_S, _QUEUED_PER_WAITER_S * max(1, ahead)))


def unreadable(message: str) -> GuardedCall:
    """Refuse a request quotawrap cannot read (the provider could not either): 400, never sent."""
    return GuardedCall.refused(SyntheticResponse.ark_error(400, "QuotawrapUnreadableRequest", "BadRequest", message))


def reason(exc: BaseException) -> str:
    """Why a body could not be read, in words."""
    if isinstance(exc, RecursionError):
        return "it is nested too deeply"
    if isinstance(exc, MemoryError):
        return "it is too large to read"
    return str(exc)


def utf8_bytes(_model: str, text: str) -> int:
    return utf8_bound(text)
