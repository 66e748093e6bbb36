"""One call's admission, the parts the guard's reserve loop leans on: the room its limits leave, what it is
sent as and reserved at (its output bound), and the record of its wait. I/O only through what is passed in."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..core import quota
from ..core.estimate import (
    MAX_OUTPUT_TOKENS,
    Estimate,
    EstimateSettings,
    Kind,
    ReasoningReserve,
    bounded,
    bounded_output,
)
from ..core.output_bound import ADDED, REPLACED
from ..core.records import Record
from ..ledger import CallPath, HoldRequest
from ..support.events import EventLog, wait_id

__all__ = [
    "TAIL_MIN_TOKENS",
    "Fresh",
    "Plan",
    "Room",
    "Wait",
    "only_in_flight_in_the_way",
    "plan_output",
]

# The least whole output a call that set no bound is sent with in a cap's last room (below the thinking
# floor): less would only buy a cut answer, so below it the call is refused as before.
TAIL_MIN_TOKENS = 256

Known = dict[tuple[str, str], dict[str, quota.Counters]]


class Fresh(Record, frozen=True):
    limits: list[quota.Limit]
    counters: dict[str, quota.Counters]


class Room:
    """What the calls of one (model, day) know of the room their limits leave: counters last seen (shared per
    process), re-read on demand. Keeps nothing of any one call: the guard makes one per (model, day)."""

    def __init__(
        self,
        ledger: CallPath,
        limits_for: Callable[[quota.Snapshot | None], list[quota.Limit]],
        snapshot: Callable[[], quota.Snapshot | None],
        known: Known,
        where: tuple[str, str],
        keys: Mapping[str, str],
    ) -> None:
        self._ledger = ledger
        self.limits_for = limits_for
        self._snapshot = snapshot
        self._known = known
        self._where = where
        self._keys = keys

    def read(self) -> Fresh:
        raw = self._ledger.counters(list(self._keys.values()))
        counters = {scope: raw.get(key, quota.Counters()) for scope, key in self._keys.items()}
        self.seen(counters)
        return Fresh(self.limits_for(self._snapshot()), counters)

    def seen(self, counters: Mapping[str, quota.Counters]) -> None:
        self._known[self._where] = dict(counters)

    def last_seen(self) -> Mapping[str, quota.Counters] | None:
        """The counters this process last read, None before its first (no ledger read)."""
        return self._known.get(self._where)

    def token_space(self) -> int | None:
        """Tokens one call may reserve at most once everything in flight settled (from counters last seen)."""
        known = self._known.get(self._where)
        if known is None:
            fresh = self.read()
            return quota.token_room(fresh.limits, fresh.counters)
        return quota.token_room(self.limits_for(self._snapshot()), known)

    def token_cap(self) -> int | None:
        """The smallest token cap itself (what an empty cap would leave one call)."""
        return quota.token_room(self.limits_for(self._snapshot()), {})


class Plan(NamedTuple):  # not a frozen record: one per guarded call, and a NamedTuple is made faster
    estimate: Estimate
    body: dict[str, Any]  # what goes out (the request itself when unchanged)
    bound: int | None  # the whole-output bound the guard set on it, per choice
    # what the guard did: ADDED a bound to a request that set none, or REPLACED its max_tokens by one
    how: str | None = None


def plan_output(
    kind: Kind,
    request: dict[str, Any],
    estimate: Estimate,
    settings: EstimateSettings,
    *,
    boundable: bool,
    policy: ReasoningReserve,
    ceiling: int,
    reasoning: int | None,
    token_space: Callable[[], int | None],
    token_cap: Callable[[], int | None] = lambda: None,
) -> Plan:
    """What a request that may think, with no whole-output bound of its own, is sent as and reserved at.

    A request the guard changes stays valid for Ark (never ``max_tokens`` beside ``max_completion_tokens``)
    and never asks for more than the caller did; the caller's answer bound is never lengthened.
    ``ceiling``: the model's longest chain of thought (``model_limits``), which with ``max_tokens`` alone
    is the reasoning's own quota; ``reasoning``: the p99 of the model's settled reasoning, None without
    history; ``boundable``: False under ``--no-bound`` and ``--watch``, which change no request.

    * ``max_tokens`` M set (chat): never sent beside a whole-output bound. ``policy`` ``ceiling`` reserves
      M + ``ceiling`` (exact: Ark stops reasoning there); ``learned`` M + the p99 (at least the thinking
      floor, at most ``ceiling``: a call that reasons longer overshoots its hold); ``cut`` sends M as
      ``max_completion_tokens`` instead, reserving M (exact, but reasoning now shares M with the answer).
      Under ``ceiling`` or ``learned``, a reserve the cap can never hold (its settled usage leaves less
      even with nothing in flight) is sent as under ``cut`` rather than refused for good.
    * nothing set: bounded at the default answer + the p99 (+ the thinking floor without history), at
      least the floor, at most 65,536 and the request's own worst case (default answer + ``ceiling``),
      fitted into what the cap's settled usage leaves but not below the floor: a bound no cap can hold
      would refuse the call for good, one below the floor starves thinking. At a cap's end, when what is
      left is below the floor but holds ``TAIL_MIN_TOKENS``, the call goes out bounded at all that is
      left instead of being refused (a call whose real size fits completes as it would have, one that
      does not is cut at the cap), unless the cap is too small for one call at the floor (``token_cap``).
    * not boundable: unchanged, reserving the request's worst case, (M or the default answer) + ``ceiling``.
    """
    answer = _answer(request) if kind == "chat" else 0
    choices = bounded_output(kind, request, 1)
    worst = (answer or settings.default_max_tokens) + ceiling
    if not boundable:
        return Plan(Estimate(estimate.input_tokens, worst * choices), request, None)
    if answer:
        if policy == "cut":
            return _replaced(kind, request, estimate, answer)
        reserve = answer + min(ceiling, max(settings.thinking_floor, reasoning or 0)) if policy == "learned" else worst
        space = token_space()
        if space is not None and estimate.input_tokens + reserve * choices > space:
            return _replaced(kind, request, estimate, answer)  # it can never fit: cut rather than refused
        return Plan(Estimate(estimate.input_tokens, reserve * choices), request, None)
    default = settings.default_max_tokens
    if reasoning is None:
        wanted = default + settings.thinking_floor
    else:
        wanted = max(settings.thinking_floor, default + reasoning)
    wanted = min(wanted, MAX_OUTPUT_TOKENS, worst)
    space = token_space()
    floor = min(settings.thinking_floor, wanted)
    allowance = wanted
    if space is not None:
        fitted = (space - estimate.input_tokens) // choices
        if fitted >= floor:
            allowance = min(wanted, fitted)
        elif fitted >= TAIL_MIN_TOKENS and _holds(token_cap(), estimate, floor * choices):
            allowance = fitted  # a cap's last room: all of it, rather than a refusal (see the docstring)
        else:
            allowance = floor
    sent = max(1, allowance)
    return Plan(
        Estimate(estimate.input_tokens, bounded_output(kind, request, sent)),
        bounded(kind, request, sent),
        sent,
        ADDED,
    )


def _replaced(kind: Kind, request: dict[str, Any], estimate: Estimate, answer: int) -> Plan:
    """The request with its ``max_tokens`` sent as the whole-output bound (never longer, within Ark's range)."""
    sent = min(answer, MAX_OUTPUT_TOKENS)
    return Plan(
        Estimate(estimate.input_tokens, bounded_output(kind, request, sent)),
        bounded(kind, request, sent),
        sent,
        REPLACED,
    )


class Wait:
    """One call's wait for room, recorded in the run's events log when it starts and when it ends."""

    def __init__(self, events: EventLog, model: str, clock: Callable[[], float] = time.time) -> None:
        self._events = events
        self.id = wait_id()
        self.model = model
        self._started = time.monotonic()
        self._done = False
        events.write({"ev": "wait", "id": self.id, "model": model, "pid": os.getpid(), "t": clock()})

    def seconds(self) -> float:
        return time.monotonic() - self._started

    def done(self, outcome: str, superseded: int) -> None:
        """``superseded``: refused attempts the call left in the ledger before its final answer."""
        if self._done:
            return
        self._done = True
        self._events.write(
            {
                "ev": "waited",
                "id": self.id,
                "model": self.model,
                "outcome": outcome,
                "waited_s": round(self.seconds(), 4),
                "superseded": superseded,
            }
        )


def only_in_flight_in_the_way(fresh: Fresh, hold: HoldRequest) -> bool:
    """The call does not fit now, but will once enough of what is in flight settles."""
    verdict = quota.verdict(fresh.limits, fresh.counters, hold.reserve, reserve_cost=hold.reserve_cost)
    if verdict.allowed:
        return False
    return quota.never_fits(fresh.limits, fresh.counters, hold.reserve, reserve_cost=hold.reserve_cost) is None


def _holds(cap: int | None, estimate: Estimate, output: int) -> bool:
    """Whether an empty cap (None: unknown) holds the call's input and ``output``."""
    return cap is None or estimate.input_tokens + output <= cap


def _answer(request: Mapping[str, Any]) -> int:
    value = request.get("max_tokens")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
