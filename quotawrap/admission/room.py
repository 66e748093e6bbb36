"""One call's admission, the parts its reserve loop leans on: the limits and the room they leave (per process,
per model and day), what it is sent as and reserved at (its output bound), and the record of its wait. I/O only
through what is passed in."""

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
    "Limits",
    "Plan",
    "Room",
    "Snapshots",
    "Wait",
    "only_in_flight_in_the_way",
    "plan_output",
]

# The least whole output a call that set no bound is sent with in a cap's last room (below the thinking
# floor): less would only buy a cut answer, so below it the call is refused as before.
TAIL_MIN_TOKENS = 256

Known = dict[tuple[str, str], dict[str, quota.Counters]]
Evicted = tuple[quota.Verdict, dict[str, quota.Counters]]
_SNAPSHOT_TTL_S = 1.0


class Limits:
    """The limits of one call: pure in (snapshot, day) for a process's settings, so computed once per sync and
    day. ``soft_walls=False`` (``quotawrap consume`` only): the soft-evict walls do not apply."""

    __slots__ = ("_cache", "_cap_tokens", "_cost_cap", "_quota", "_soft_walls")

    def __init__(
        self, cap_tokens: int | None, cost_cap: int | None, quota_settings: quota.QuotaSettings, *, soft_walls: bool
    ) -> None:
        self._cap_tokens = cap_tokens
        self._cost_cap = cost_cap
        self._quota = quota_settings
        self._soft_walls = soft_walls
        self._cache: dict[tuple[quota.Snapshot | None, str], list[quota.Limit]] = {}

    def __call__(self, snapshot: quota.Snapshot | None, day: str) -> list[quota.Limit]:
        key = (snapshot, day)
        limits = self._cache.get(key)
        if limits is None:
            limits = [
                *quota.run_limits(self._cap_tokens),
                *quota.cost_limits(self._cost_cap),
                *quota.model_day_limits(snapshot, self._quota, today=day),
            ]
            if not self._soft_walls:
                limits = [limit for limit in limits if limit.kind != "wall"]
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = limits
        return limits


class Snapshots:
    """Each model's stored balance snapshot, re-read at most once a second (for planning, not deciding)."""

    __slots__ = ("_clock", "_ledger", "_seen")

    def __init__(self, ledger: CallPath, clock: Callable[[], float]) -> None:
        self._ledger = ledger
        self._clock = clock  # the guard's: a simulated day stays deterministic
        self._seen: dict[str, tuple[float, quota.Snapshot | None]] = {}

    def __call__(self, model: str | None) -> quota.Snapshot | None:
        if model is None:
            return None
        now = self._clock()
        cached = self._seen.get(model)
        if cached is not None and now - cached[0] < _SNAPSHOT_TTL_S:
            return cached[1]
        snapshot = self._ledger.snapshot(model)
        self._seen[model] = (now, snapshot)
        return snapshot


class Fresh(Record, frozen=True):
    limits: list[quota.Limit]
    counters: dict[str, quota.Counters]


class Room:
    """What the calls of one (model, day) know of the room their limits leave: counters last seen (shared per
    process), re-read on demand. Keeps nothing of any one call: the guard makes one per (model, day)."""

    __slots__ = ("_evicted", "_keys", "_known", "_ledger", "_limits", "_snapshots", "_where", "day", "model")

    def __init__(
        self,
        ledger: CallPath,
        limits: Limits,
        snapshots: Snapshots,
        known: Known,
        where: tuple[str, str],
        keys: Mapping[str, str],
    ) -> None:
        self._ledger = ledger
        self._limits = limits
        self._snapshots = snapshots
        self._known = known
        self._where = where
        self.model, self.day = where
        self._keys = keys
        self._evicted: tuple[float, Evicted | None] | None = None

    def snapshot(self) -> quota.Snapshot | None:
        return self._snapshots(self.model)

    def limits_for(self, snapshot: quota.Snapshot | None) -> list[quota.Limit]:
        """The limits of a call of this model and day (the ledger's callback: it passes the snapshot it read)."""
        return self._limits(snapshot, self.day)

    def evicted(self, now: float) -> Evicted | None:
        """The seed's short-cut: an evicted model is answered before any token counting.

        Cached for a second: a model evicted within that second is still estimated, then
        refused by the reservation itself, which checks the same walls atomically.
        """
        cached = self._evicted
        if cached is not None and now - cached[0] < _SNAPSHOT_TTL_S:
            return cached[1]
        walls = [limit for limit in self._limits(self._snapshots(self.model), self.day) if limit.kind == "wall"]
        result: Evicted | None = None
        if walls:
            key = self._keys["model_day"]
            counters = {"model_day": self._ledger.counters([key])[key]}
            verdict = quota.verdict(walls, counters, 0)
            result = None if verdict.allowed else (verdict, counters)
        self._evicted = (now, result)
        return result

    def read(self) -> Fresh:
        raw = self._ledger.counters(list(self._keys.values()))
        counters = {scope: raw.get(key, quota.Counters()) for scope, key in self._keys.items()}
        self.seen(counters)
        return Fresh(self.limits_for(self.snapshot()), counters)

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
        return quota.token_room(self.limits_for(self.snapshot()), known)

    def token_cap(self) -> int | None:
        """The smallest token cap itself (what an empty cap would leave one call)."""
        return quota.token_room(self.limits_for(self.snapshot()), {})


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
