"""One call's admission, the parts the guard's reserve loop leans on: the room its limits leave, the
output bound it is planned with, and the record of its wait (issue 9). I/O only through what is passed in."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from . import quota
from ._records import Record
from .estimate import (
    MAX_OUTPUT_TOKENS,
    PREBLOCK_RESERVE_TOKENS,
    Estimate,
    EstimateSettings,
    Kind,
    bounded,
    bounded_output,
    output_allowance,
)
from .ledger import HoldRequest, Ledger
from .waiting import EventLog, wait_id

__all__ = ["TAIL_MIN_TOKENS", "Fresh", "Plan", "Room", "Wait", "only_in_flight_in_the_way", "plan_output"]

# The least whole output a call that set no max_tokens is sent with in a cap's last room (below the
# thinking floor): less would only buy a cut answer, so below it the call is refused as before.
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
        ledger: Ledger,
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


class Plan(NamedTuple):  # not a frozen record: one per guarded call, and a NamedTuple is made ~2x faster
    estimate: Estimate
    body: dict[str, Any]  # what goes out (the request itself when unchanged)
    bound: int | None  # the whole-output bound set on it, per choice


def plan_output(
    kind: Kind,
    request: dict[str, Any],
    estimate: Estimate,
    settings: EstimateSettings,
    boundable: bool,
    reasoning: int | None,
    token_space: Callable[[], int | None],
    token_cap: Callable[[], int | None] = lambda: None,
) -> Plan:
    """The plan of a request that may think with its whole output open.

    Not boundable: unchanged, reserving the seed's ``PREBLOCK_RESERVE_TOKENS`` for the open part.
    Boundable: bounded at ``max_tokens`` (or the default) + the model's learned ``reasoning`` (the
    seed's fallback without history), at least the thinking floor, fitted into what the cap's settled
    usage leaves but not below the floor: a bound no cap can hold would refuse the call for good,
    one below the floor starves thinking. At a cap's end, when what is left is below the floor but
    still holds the answer the caller asked for (its ``max_tokens``; ``TAIL_MIN_TOKENS`` when it set
    none), the call goes out bounded at all that is left instead of being refused: the provider
    bills at most the bound, so the hold stays sound, and a call whose real size fits completes as
    it would have unbounded (one that does not is cut at the cap). Only at a cap's end: a cap too
    small for one call at the floor (``token_cap``) refuses it, as before, and says so.
    """
    if not boundable:
        fallback = dataclasses.replace(settings, thinking_floor=PREBLOCK_RESERVE_TOKENS)
        return Plan(Estimate(estimate.input_tokens, output_allowance(kind, request, fallback)), request, None)
    answer = _answer(request) or settings.default_max_tokens
    if reasoning is None:
        wanted = max(PREBLOCK_RESERVE_TOKENS, answer)
    else:
        wanted = max(settings.thinking_floor, answer + reasoning)
    # Ark's range ends at MAX_OUTPUT_TOKENS, but never cut below the answer the caller asked for
    wanted = max(answer, min(MAX_OUTPUT_TOKENS, wanted))
    choices = bounded_output(kind, request, 1)
    space = token_space()
    floor = min(settings.thinking_floor, wanted)
    allowance = wanted
    if space is not None:
        fitted = (space - estimate.input_tokens) // choices
        if fitted >= floor:
            allowance = min(wanted, fitted)
        elif fitted >= (_answer(request) or TAIL_MIN_TOKENS) and _holds(token_cap(), estimate, floor * choices):
            allowance = fitted  # a cap's last room: all of it, rather than a refusal (see the docstring)
        else:
            allowance = floor
    sent = max(1, allowance)
    return Plan(
        Estimate(estimate.input_tokens, bounded_output(kind, request, sent)), bounded(kind, request, sent), allowance
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
