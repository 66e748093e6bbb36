"""What every store (SQLite, Redis) must do, in three parts by who asks.

- :class:`CallPath`: what a guarded call and the child process around it need (reserve, wait in line,
  settle, the counters and snapshot its limits read, the endpoint pairs and their probe lease). The
  child side, the gateway and the settle relay are typed with it alone, so mypy rejects a call from
  them into the books or the read side.
- :class:`Books`: the records the wrapper and the commands keep (runs, what a dead run left open,
  balances and packages synced, retention, the gateway's member keys).
- :class:`Reader`: what reports, status, the live view and the sync read back.

A member sits in the part of its narrowest caller: one the child side calls is on the call path even
when the commands call it too. :class:`Ledger` is all three, the type ``open_ledger`` returns; each
backend implements it whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from ..core.budgets import Budget, BudgetUse
from ..core.quota import Counters, Package, Snapshot
from ..core.usage import Usage
from .base import CallRecord, DayAggregate, Decision, HoldRequest, LimitsFor, PruneResult, RunRecord, RunTotals, Settle

if TYPE_CHECKING:  # what the member keys' records are made of (hashlib, secrets) stays off a guarded start
    from ..core.member_keys import MemberKey

__all__ = ["Books", "CallPath", "Ledger", "Reader"]


@runtime_checkable
class CallPath(Protocol):
    """A shared, atomic store of holds and counters. Every method is safe across threads and processes."""

    url: str
    # Whether it lands settles of calls drawn from an advance (Settle.drawn) and closes advances.
    takes_advances: ClassVar[bool]

    def reserve(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        """Check every limit and take the hold in one atomic step."""
        ...

    def settle(
        self,
        hold_id: str,
        usage: Usage | None,
        *,
        latency_s: float | None = None,
        cost: int | None = None,
        anomaly: str | None = None,
    ) -> None:
        """Charge actual usage and cost (None: outcome unknown, charge the whole hold). Idempotent.

        ``anomaly``: the answer's usage was implausible (``usage.check_usage``); the record keeps why."""
        ...

    def release(self, hold_id: str, *, handed_to: str | None = None) -> None:
        """The call never reached generation: free the hold, charge nothing. Idempotent.

        ``handed_to``: the hold went on under another id (a video task's): the record is no call of its own."""
        ...

    def settle_many(self, settles: Sequence[Settle]) -> None:
        """``settle`` or ``release`` each, in one store round trip where the store allows. Idempotent."""
        ...

    def leave_line(self, request: HoldRequest) -> None:
        """Take ``request.waiter`` out of the lines of its run and model-day (it gave up). Idempotent."""
        ...

    def counters(self, keys: Sequence[str]) -> dict[str, Counters]: ...

    def snapshot(self, model: str) -> Snapshot | None: ...

    def reasoning_history(self, model: str, *, since: float, limit: int) -> list[int]:
        """``reasoning.reasoning_samples`` of the calls started since ``since``, for one model, without
        reading the calls whole."""
        ...

    def known_models(self) -> list[str]:
        """Every model the ledger has a call or a balance of (a call to an unmapped endpoint must fit each)."""
        ...

    # -- endpoint ids: which model each inference endpoint serves, shared by every process and host

    def endpoint_models(self) -> dict[str, str]:
        """Every endpoint id -> model id pair kept (canonical; see quotawrap.core.identity)."""
        ...

    def put_endpoint_models(self, models: Mapping[str, str]) -> None:
        """Keep these pairs; an endpoint's pair replaces the one it had (an endpoint may move to another
        version)."""
        ...

    # A lease names one holder across every process and host: an unmapped endpoint's first call, the sync,
    # consume's day, the daily prune.
    def try_lease(self, name: str, holder: str, ttl_s: float, now: float) -> bool: ...

    def release_lease(self, name: str, holder: str) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Books(Protocol):
    """The records kept around the calls: runs, what a dead run left open, balances synced, retention."""

    def start_run(self, run: RunRecord) -> None: ...

    def end_run(self, run_id: str, exit_code: int, ended_at: float) -> None: ...

    def resolve_run(self, run_id: str, *, release_advances: bool = False) -> int:
        """Charge every hold the run left open (as unresolved). Returns how many.

        ``release_advances``: the caller landed every draw of the run's processes (a wrapper whose relay landed
        all it received): what is left of the advances of its dead processes is released, not charged (their
        calls in flight have rows of their own). Otherwise an advance left open is charged whole."""
        ...

    def reclaim_orphans(self, now: float) -> int:
        """Charge holds whose owner died or whose validity expired. Returns how many."""
        ...

    def put_snapshot(self, model: str, snapshot: Snapshot) -> None: ...

    def put_packages(self, model: str, packages: Sequence[Package], synced_at: float) -> None: ...

    def set_budget(self, budget: Budget) -> bool:
        """Keep ``budget`` (ledger/budgets.py) under its id, replacing the amount it had; whether it changed."""
        ...

    def remove_budget(self, budget_id: str) -> bool:
        """Remove the budget of this id (what it counted stays in its counters); whether there was one."""
        ...

    # -- retention: fold old days into aggregates so the ledger stops growing

    def prune(self, before_day: str, *, dry_run: bool = False) -> PruneResult:
        """Fold the finished calls of every day before ``before_day`` into daily aggregates and delete
        them (with those days' usage series, sync history, and the runs left without calls)."""
        ...

    # -- member keys: who may call through a gateway that holds the provider's key (by hash, never the key)

    def add_member_key(self, key: MemberKey) -> bool:
        """Keep ``key`` unless a key of its name exists (names are never reused, revoked or not); whether kept."""
        ...

    def member_key(self, key_hash: str) -> MemberKey | None:
        """The key whose SHA-256 is ``key_hash``, revoked or not; None for no such key."""
        ...

    def member_keys(self) -> list[MemberKey]:
        """Every member key, revoked ones too, oldest first."""
        ...

    def revoke_member_key(self, name: str, at: float) -> MemberKey | None:
        """Mark the key ``name`` revoked at ``at`` (a second revoke keeps the first time); None for no such key."""
        ...


@runtime_checkable
class Reader(Protocol):
    """What reports, status, the live view and the balance sync read back."""

    def waiting(self, now: float) -> dict[str, int]:
        """Per model, the calls waiting for room in the ledger's lines right now (every run and host)."""
        ...

    def run_totals(self, run_id: str) -> RunTotals: ...

    def budgets(self, run_id: str | None = None) -> list[Budget]:
        """The ledger's budgets and the run ``run_id``'s own (None: every run's too), in id order."""
        ...

    def budget_uses(self, now: float, run_id: str | None = None) -> list[BudgetUse]:
        """``budgets(run_id)``, each in the period ``now`` falls in: used, in flight, left, when it resets."""
        ...

    def call_records(
        self, *, since: float | None = None, until: float | None = None, run_id: str | None = None
    ) -> list[CallRecord]: ...

    def runs(self, *, since: float | None = None, until: float | None = None) -> list[RunRecord]: ...

    # -- balance sync: the per-minute usage series, sync history, packages

    def usage_series(self, model: str, day: str) -> list[tuple[float, int]]:
        """(minute timestamp, cumulative settled tokens) of one model-day, ascending."""
        ...

    def sync_history(self, model: str, day: str) -> list[tuple[float, int]]:
        """(synced_at, balance) of every sync of one model-day, ascending."""
        ...

    def packages(self, model: str) -> list[Package]: ...

    def aggregates(self, *, since_day: str | None = None, until_day: str | None = None) -> list[DayAggregate]:
        """The aggregates of pruned days in [since_day, until_day)."""
        ...


@runtime_checkable
class Ledger(CallPath, Books, Reader, Protocol):
    """The whole store: what ``open_ledger`` returns and each backend implements. Has no member of its own:
    each belongs to one of the three parts."""
