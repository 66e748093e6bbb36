"""The records every store (SQLite, Redis) keeps; what each must do is :mod:`quotawrap.ledger.interface`.

A hold moves through one small state machine, written once in :mod:`quotawrap.ledger.holds`.
``unresolved`` is the crash-safe default: a hold whose owner died or whose usage never came
is charged at its reserved amount, never silently dropped. A late ``settle`` with real usage
may still correct it (settle is idempotent per hold id and always adjusts the counters of
the model-day the hold was taken on).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Literal, NamedTuple

from ..core.quota import Counters, Limit, Snapshot, Verdict
from ..core.records import Record
from ..core.usage import Usage
from .advance_endpoints import ADVANCE, ADVANCE_CLOSED
from .holds import HoldState
from .scopes import model_day_key, run_cost_key, run_key

__all__ = [
    "ADVANCE",
    "ADVANCE_CLOSED",
    "REPORT_SUMS",
    "CallRecord",
    "CallState",
    "DayAggregate",
    "Decision",
    "Drawn",
    "HoldRequest",
    "LimitsFor",
    "ModelTotals",
    "PruneResult",
    "RunRecord",
    "RunTotals",
    "Settle",
    "ledger_clock",
    "model_day_key",
    "new_hold_id",
    "run_cost_key",
    "run_key",
]

CallState = HoldState
LimitsFor = Callable[[Snapshot | None], Sequence[Limit]]


def ledger_clock(ledger: object) -> Callable[[], float]:
    """The clock of ``ledger``, which every process and host sharing it agrees on: a Redis ledger's is its
    server's (:meth:`RedisLedger.now`), SQLite's is this host's (one machine: every process reads the same clock).
    Every time handed to a ledger (a day, an expiry, ``reclaim_orphans``' now) is read from it.

    Looked up on the class: a run's lean books (``ledger.runs.RunBooks``) would open the full ledger for it."""
    now = getattr(type(ledger), "now", None)
    return time.time if now is None else getattr(ledger, "now")  # noqa: B009 - the bound method, once known


def new_hold_id() -> str:
    """32 hex digits, the shape of ``uuid4().hex``: the time in microseconds (13 digits, enough until 2112), then
    76 random bits, which keep ids unique across threads, processes and hosts.

    Led by the time, the ids of calls made one after another sort next to each other: a batch of settles adds its
    rows at the end of the ``calls`` id index instead of on a page of its own each, anywhere in it, so landing a
    batch dirties fewer pages (bench/bench_landing.py measures it). Not uuid4: it builds an object to print, and
    importing uuid (platform) slows a command's start."""
    return f"{time.time_ns() // 1000:013x}{os.urandom(10).hex()[:19]}"


class HoldRequest(Record, frozen=True):
    run_id: str
    model: str
    day: str
    reserve: int
    endpoint: str
    pid: int
    host: str
    expires_at: float
    enforce: bool = True  # False in --watch: record the verdict, hold anyway
    reserve_cost: int = 0  # micro-CNY, the pessimistic price of ``reserve``
    key_fingerprint: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    hold_id: str = field(default_factory=new_hold_id)
    # The waiting lines (ledger/lines.py): the call's place (None: it never waits), its ticket once
    # it has one, and whether it may still wait (False once its deadline passed).
    waiter: str | None = None
    ticket: int | None = None
    can_wait: bool = False
    # An advance (quotawrap.admission.advances): room a process reserves ahead for its next calls. Refused, it leaves
    # no row (it is no call); taken, its row is a hold of endpoint ADVANCE that its calls are drawn from.
    advance: bool = False
    # A hold that takes over another's room (a video task's, from its create): checked when that one was reserved,
    # so no budget refuses it; it counts against them as any hold does.
    taken_over: bool = False


class Drawn(NamedTuple):
    """A call admitted from an advance, as its settle carries it: its row is split from the advance's (the
    advance gives up ``reserved`` and ``reserved_cost``) right before the settle lands on it."""

    advance_id: str
    reserved: int
    reserved_cost: int
    endpoint: str
    key_fingerprint: str | None
    started_at: float
    expires_at: float

    @classmethod
    def of(cls, advance_id: str, hold: HoldRequest, started_at: float) -> Drawn:
        """The call ``hold`` asked for, drawn from the advance ``advance_id``."""
        return cls(
            advance_id,
            hold.reserve,
            hold.reserve_cost,
            hold.endpoint,
            hold.key_fingerprint,
            started_at,
            hold.expires_at,
        )


class Settle(NamedTuple):
    """One queued end of a hold, as :meth:`Ledger.settle_many` lands it, or a step of an advance's:

    * ``draw``: the call ``hold_id`` was drawn from the advance ``drawn.advance_id`` (its row is split from it,
      nothing settles: its wrapper learns of every call in flight before the call is sent);
    * ``close``: ``hold_id`` is an advance its process closed, having drawn all of it but ``drawn.reserved`` and
      ``drawn.reserved_cost``, which it gives back (once: the advance's row then reads ADVANCE_CLOSED).
    """

    hold_id: str
    event: Literal["settle", "release", "draw", "close"]
    usage: Usage | None = None
    latency_s: float | None = None
    cost: int | None = None
    anomaly: str | None = None  # usage.check_usage's reason the answer's usage was not believed
    drawn: Drawn | None = None  # the call was drawn from an advance (or, for a close, what is given back)


class Decision(Record, frozen=True):
    hold_id: str
    verdict: Verdict
    held: bool  # True when a hold was taken (allowed, or --watch)
    counters: Mapping[str, Counters]  # the counters the verdict was computed on
    queued: int = 0  # waiters ahead of it in its lines (it joined them): nothing held, no row written
    waiting: bool = False  # at the head of its lines, waiting for holds in flight: nothing held, no row
    ticket: int | None = None  # its place in every line, once it joined one
    advance_id: str | None = None  # drawn from this advance of its process (quotawrap.admission.advances): no row yet


class ModelTotals(Record):
    calls: int = 0
    blocked_calls: int = 0
    would_block_calls: int = 0
    settled_tokens: int = 0
    reserved_open_tokens: int = 0
    overshoot_calls: int = 0
    unresolved_calls: int = 0
    released_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    settled_cost: int = 0  # micro-CNY
    anomalous_calls: int = 0  # charged their hold: the answer's usage was implausible

    def add(self, other: ModelTotals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class RunTotals(Record):
    run_id: str
    models: dict[str, ModelTotals]

    @property
    def totals(self) -> ModelTotals:
        total = ModelTotals()
        for model in self.models.values():
            total.add(model)
        return total


class CallRecord(Record, frozen=True):
    """One guarded call as the audit trail keeps it (never the API key: only its fingerprint)."""

    id: str
    run_id: str
    model: str
    day: str
    endpoint: str
    state: CallState
    reserved: int
    charged: int
    reserved_cost: int
    charged_cost: int
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    cached_tokens: int | None
    overshoot: bool
    would_block: bool
    blocked_by: str | None
    key_fingerprint: str | None
    tags: Mapping[str, str]
    started_at: float
    ended_at: float | None
    latency_s: float | None
    pid: int
    host: str
    usage_anomaly: str | None = None  # why the answer's usage was not believed (charged the hold instead)
    handed_to: str | None = None  # a video task's create: its hold went to this task's row, not a call of its own

    @property
    def outcome(self) -> str:
        """settled, overshoot, unresolved, released, blocked, or held (still open)."""
        if self.state == "settled" and self.overshoot:
            return "overshoot"
        return self.state


class DayAggregate(Record, frozen=True):
    """What ``prune`` keeps of one (day, model, tags) group of calls it deleted: the sums a report shows."""

    day: str
    model: str
    tags: Mapping[str, str]
    calls: int = 0
    blocked_calls: int = 0
    settled_tokens: int = 0
    cost_micro_cny: int = 0
    unresolved_calls: int = 0
    overshoot_calls: int = 0
    released_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    anomalous_calls: int = 0

    @property
    def run_id(self) -> str:
        return "(pruned)"  # sessions are not kept per day: `report --by session` groups pruned days here


# The sums a report shows per group, in one order for reports, CSV columns and call_aggregates' columns
# (its declared names, in order: reading its fields would build the record at import).
REPORT_SUMS: tuple[str, ...] = tuple(
    name for name in DayAggregate.__annotations__ if name not in ("day", "model", "tags")
)


class PruneResult(Record, frozen=True):
    """What ``prune`` deleted (or, dry, would delete); ``note`` says why a store had nothing to do."""

    before_day: str
    calls: int = 0
    days: tuple[str, ...] = ()
    aggregate_rows: int = 0
    runs: int = 0
    series_rows: int = 0
    sync_rows: int = 0
    dry_run: bool = False
    note: str | None = None


class RunRecord(Record, frozen=True):
    run_id: str
    started_at: float
    ended_at: float | None = None
    command: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)
    exit_code: int | None = None
