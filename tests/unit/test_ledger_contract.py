"""One contract for every ledger: SQLite (a temp file) and Redis (a private redis-server).

The Redis-only classes at the end cover what SQLite has no equivalent for: script reload,
a server restart, data loss, the LiteLLM limiter's keys, bounded memory and Redis Cluster.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotawrap.admission.advances import Advances
from quotawrap.books.report import aggregate
from quotawrap.books.sync import record_balance
from quotawrap.core.errors import StoreError
from quotawrap.core.identity import UNMAPPED
from quotawrap.core.member_keys import MemberKey, key_hash, new_member_key
from quotawrap.core.quota import (
    Counters,
    Limit,
    Package,
    QuotaSettings,
    Snapshot,
    beijing_day,
    beijing_day_start,
    verdict,
)
from quotawrap.core.usage import Usage
from quotawrap.ledger import Books, CallPath, Ledger, Reader, open_ledger
from quotawrap.ledger.base import ADVANCE, HoldRequest, RunRecord, Settle, model_day_key, run_cost_key, run_key
from quotawrap.ledger.holds import MAX_CHARGE
from quotawrap.ledger.redis import RedisLedger
from tests.redis_server import (
    RedisCluster3,
    RedisServer,
    cluster_unavailable_reason,
    flushed,
    free_port,
    private_server,
    redis_binary,
    session_url,
)

DAY = beijing_day(time.time())
MODEL = "doubao-seed-1-6"
HOST = socket.gethostname()


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[str]:
    with session_url() as url:
        yield url


@pytest.fixture
def redis_url(shared_redis: str) -> str:
    """An empty database on the session's private server (or on REDIS_URL)."""
    return flushed(shared_redis)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with private_server(appendonly=True) as server:
        yield server


def request(
    reserve: int,
    *,
    run: str = "run-a",
    model: str = MODEL,
    day: str = DAY,
    enforce: bool = True,
    expires_in: float = 600.0,
    pid: int | None = None,
    host: str = HOST,
    cost: int = 0,
) -> HoldRequest:
    return HoldRequest(
        run_id=run,
        model=model,
        day=day,
        reserve=reserve,
        endpoint="/api/v3/chat/completions",
        pid=os.getpid() if pid is None else pid,
        host=host,
        expires_at=time.time() + expires_in,
        enforce=enforce,
        reserve_cost=cost,
        key_fingerprint="sk-…abcd",
        tags={"team": "qa"},
    )


def limits(
    run_cap: int | None = None, daily: int | None = None, wall: int | None = None, cost_cap: int | None = None
) -> Any:
    chosen = []
    if cost_cap is not None:
        chosen.append(Limit("cost_cap", "run_cost", cost_cap))
    if run_cap is not None:
        chosen.append(Limit("run_cap", "run", run_cap))
    if daily is not None:
        chosen.append(Limit("daily_cap", "model_day", daily))
    if wall is not None:
        chosen.append(Limit("usage_wall", "model_day", wall, "wall"))
    return lambda snapshot: chosen


def usage(total: int, prompt: int | None = None) -> Usage:
    prompt = total // 3 if prompt is None else prompt
    return Usage(prompt_tokens=prompt, completion_tokens=total - prompt, total_tokens=total)


def md(ledger: Ledger, model: str = MODEL, day: str = DAY) -> Counters:
    return ledger.counters([model_day_key(model, day)])[model_day_key(model, day)]


def rc(ledger: Ledger, run: str = "run-a") -> Counters:
    return ledger.counters([run_key(run)])[run_key(run)]


def cc(ledger: Ledger, run: str = "run-a") -> Counters:
    return ledger.counters([run_cost_key(run)])[run_cost_key(run)]


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    opened = open_ledger(ledger_url)
    try:
        yield opened
    finally:
        opened.close()


# -- the interface: three parts by who asks ------------------------------------------------------


def own_members(protocol: type) -> set[str]:
    """The members ``protocol`` declares itself (methods and attributes), not those it inherits."""
    declared = vars(protocol)
    return {name for name in declared if not name.startswith("_")} | set(declared.get("__annotations__", {}))


def test_every_ledger_member_is_in_exactly_one_part() -> None:
    """``Ledger`` is the call path, the books and the read side, and declares nothing of its own: a member added
    to it, or to two parts, would leave the narrow types callers use wrong."""
    parts = [own_members(part) for part in (CallPath, Books, Reader)]
    assert own_members(Ledger) == set()
    assert all(parts) and sum(map(len, parts)) == len(set().union(*parts))
    assert {"reserve", "settle", "settle_many", "leave_line"} <= parts[0]  # what a guarded call cannot do without


def test_each_backend_implements_every_part(ledger: Ledger) -> None:
    for part in (CallPath, Books, Reader, Ledger):
        assert isinstance(ledger, part), part.__name__
    declared = set().union(*(own_members(part) for part in (CallPath, Books, Reader)))
    assert {name for name in declared if not hasattr(ledger, name)} == set()


# -- reserve --------------------------------------------------------------------------------------


class TestReserve:
    def test_fits_and_holds(self, ledger: Ledger) -> None:
        """A call that fits is held: in flight grows on both scopes, the counters seen are pre-hold."""
        decision = ledger.reserve(request(300), limits(run_cap=1000, daily=1000))
        assert decision.verdict.allowed and decision.held
        assert decision.counters["run"] == Counters(0, 0)
        assert rc(ledger) == Counters(0, 300) and md(ledger) == Counters(0, 300)

    def test_hold_ids_are_random_hex_of_a_uuid4s_length(self, ledger: Ledger) -> None:
        """Each request draws its own id, 32 hex digits as ``uuid4().hex`` had them; each is held apart."""
        ids = {request(1).hold_id for _ in range(1000)}
        assert len(ids) == 1000 and all(len(i) == 32 and i == i.lower() and int(i, 16) >= 0 for i in ids)
        first, second = request(10), request(20)
        assert ledger.reserve(first, limits(daily=1000)).held and ledger.reserve(second, limits(daily=1000)).held
        assert md(ledger) == Counters(0, 30)

    def test_exact_fit_then_one_over(self, ledger: Ledger) -> None:
        """settled + in flight + reserve == cap fits; one token more is refused."""
        assert ledger.reserve(request(600), limits(daily=1000)).held
        assert ledger.reserve(request(400), limits(daily=1000)).held
        refused = ledger.reserve(request(1), limits(daily=1000))
        assert not refused.held and refused.verdict.blocking is not None
        assert refused.verdict.blocking.name == "daily_cap"

    def test_run_scope_blocks(self, ledger: Ledger) -> None:
        """The run cap blocks one run and not another on the same model-day."""
        ledger.reserve(request(800), limits(run_cap=1000, daily=10_000))
        blocked = ledger.reserve(request(300), limits(run_cap=1000, daily=10_000))
        other = ledger.reserve(request(300, run="run-b"), limits(run_cap=1000, daily=10_000))
        assert not blocked.held and blocked.verdict.blocking is not None
        assert blocked.verdict.blocking.scope == "run"
        assert other.held

    def test_blocked_takes_nothing(self, ledger: Ledger) -> None:
        """A refused call leaves every counter as it was and is counted as blocked."""
        ledger.reserve(request(900), limits(daily=1000))
        before = (rc(ledger), md(ledger))
        ledger.reserve(request(200), limits(daily=1000))
        assert (rc(ledger), md(ledger)) == before
        totals = ledger.run_totals("run-a").models[MODEL]
        assert (totals.calls, totals.blocked_calls, totals.would_block_calls) == (1, 1, 1)

    def test_wall_blocks_on_settled_only(self, ledger: Ledger) -> None:
        """A wall refuses once settled >= cap, whatever the reserve; in flight alone does not trip it."""
        held = ledger.reserve(request(500), limits(wall=500, daily=10_000))
        assert ledger.reserve(request(1), limits(wall=500, daily=10_000)).held  # only in flight so far
        ledger.settle(held.hold_id, usage(500))
        evicted = ledger.reserve(request(0), limits(wall=500, daily=10_000))
        assert not evicted.held and evicted.verdict.reason == "evicted"

    def test_walls_are_checked_first(self, ledger: Ledger) -> None:
        """When a hold and a wall both refuse, the wall is named (quota.verdict's order)."""
        first = ledger.reserve(request(100), limits(daily=10_000))
        ledger.settle(first.hold_id, usage(100))
        refused = ledger.reserve(request(500), limits(run_cap=50, wall=100))
        assert refused.verdict.blocking is not None and refused.verdict.blocking.name == "usage_wall"

    def test_watch_mode_holds_anyway(self, ledger: Ledger) -> None:
        """enforce=False takes the hold and records that the call would have been blocked."""
        ledger.reserve(request(900), limits(daily=1000))
        watched = ledger.reserve(request(500, enforce=False), limits(daily=1000))
        assert watched.held and not watched.verdict.allowed
        assert md(ledger).in_flight == 1400
        totals = ledger.run_totals("run-a").models[MODEL]
        assert (totals.calls, totals.blocked_calls, totals.would_block_calls) == (2, 0, 1)

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        steps=st.lists(
            st.tuples(
                st.integers(0, 400),
                st.sampled_from(["settle", "release", "keep", "none"]),
                st.integers(0, 500),
                st.integers(0, 300),
            ),
            min_size=1,
            max_size=12,
        ),
        run_cap=st.one_of(st.none(), st.integers(0, 2000)),
        daily=st.integers(0, 2000),
        wall=st.one_of(st.none(), st.integers(0, 1500)),
        cost_cap=st.one_of(st.none(), st.integers(0, 1000)),
    )
    def test_decision_is_quota_verdict(
        self,
        ledger: Ledger,
        steps: list[tuple[int, str, int, int]],
        run_cap: int | None,
        daily: int,
        wall: int | None,
        cost_cap: int | None,
    ) -> None:
        """Every decision equals quota.verdict on the counters the ledger held just before it."""
        # hypothesis seeds `random`: take fresh names from the OS so examples never share counters
        run = f"prop-{os.urandom(8).hex()}"
        model = f"m-{os.urandom(8).hex()}"
        chosen = limits(run_cap=run_cap, daily=daily, wall=wall, cost_cap=cost_cap)
        for reserve, then, actual, cost in steps:
            before = {"run": rc(ledger, run), "model_day": md(ledger, model), "run_cost": cc(ledger, run)}
            decision = ledger.reserve(request(reserve, run=run, model=model, cost=cost), chosen)
            assert dict(decision.counters) == before
            assert decision.verdict == verdict(chosen(None), before, reserve, reserve_cost=cost)
            if decision.held and then == "settle":
                ledger.settle(decision.hold_id, usage(actual), cost=actual % (cost + 1))
            elif decision.held and then == "release":
                ledger.release(decision.hold_id)
            elif decision.held and then == "none":
                ledger.settle(decision.hold_id, None)


class TestCost:
    def test_cost_cap_blocks_on_cost(self, ledger: Ledger) -> None:
        """The run_cost scope is checked with the call's cost (micro-CNY), not its tokens."""
        first = ledger.reserve(request(10, cost=700), limits(cost_cap=1000))
        refused = ledger.reserve(request(10, cost=400), limits(cost_cap=1000))
        assert first.held and not refused.held
        assert refused.verdict.blocking is not None and refused.verdict.blocking.scope == "run_cost"
        assert cc(ledger) == Counters(0, 700)

    def test_settle_charges_cost(self, ledger: Ledger) -> None:
        """Settle charges the given cost; unknown usage or cost charges the reserved cost."""
        a = ledger.reserve(request(100, cost=500), limits(daily=10_000))
        b = ledger.reserve(request(100, cost=300), limits(daily=10_000))
        c = ledger.reserve(request(100, cost=200), limits(daily=10_000))
        ledger.settle(a.hold_id, usage(50), cost=120)
        ledger.settle(b.hold_id, None, cost=1)
        ledger.settle(c.hold_id, usage(50))
        ledger.settle(a.hold_id, usage(50), cost=999)
        assert cc(ledger) == Counters(120 + 300 + 200, 0)
        assert ledger.run_totals("run-a").models[MODEL].settled_cost == 620

    def test_late_settle_corrects_cost(self, ledger: Ledger) -> None:
        """An unresolved call charged its reserved cost is corrected to the actual cost."""
        held = ledger.reserve(request(100, cost=500), limits(daily=10_000))
        assert ledger.resolve_run("run-a") == 1
        assert cc(ledger) == Counters(500, 0)
        ledger.settle(held.hold_id, usage(40), cost=90)
        assert cc(ledger) == Counters(90, 0) and rc(ledger) == Counters(40, 0)


class TestRecords:
    def test_call_records(self, ledger: Ledger) -> None:
        """Each call is kept with its outcome, amounts, tokens, key fingerprint and tags."""
        a = ledger.reserve(request(100, cost=50), limits(daily=1000))
        ledger.settle(a.hold_id, Usage(30, 90, 120, reasoning_tokens=40, cached_tokens=10), latency_s=0.5, cost=60)
        ledger.reserve(request(5000), limits(daily=1000))
        b = ledger.reserve(request(200, run="run-b"), limits(daily=1000))
        records = {r.id: r for r in ledger.call_records()}
        assert len(records) == 3
        settled = records[a.hold_id]
        assert (settled.outcome, settled.charged, settled.charged_cost, settled.prompt_tokens) == (
            "overshoot",
            120,
            60,
            30,
        )
        assert (settled.key_fingerprint, dict(settled.tags), settled.latency_s) == ("sk-…abcd", {"team": "qa"}, 0.5)
        blocked = next(r for r in records.values() if r.state == "blocked")
        assert blocked.would_block and blocked.blocked_by == "daily_cap"
        assert records[b.hold_id].state == "held" and records[b.hold_id].ended_at is None
        assert [r.id for r in ledger.call_records(run_id="run-b")] == [b.hold_id]
        assert ledger.call_records(since=time.time() + 60) == []

    def test_runs(self, ledger: Ledger) -> None:
        """A run is recorded at its start and completed with its exit code."""
        now = time.time()
        ledger.start_run(RunRecord("run-a", now, command="python agent.py", tags={"team": "qa"}))
        ledger.start_run(RunRecord("run-b", now + 1))
        ledger.end_run("run-a", 3, now + 10)
        runs = ledger.runs()
        assert [r.run_id for r in runs] == ["run-a", "run-b"]
        assert (runs[0].exit_code, runs[0].ended_at, runs[0].command) == (3, now + 10, "python agent.py")
        assert [r.run_id for r in ledger.runs(since=now + 0.5)] == ["run-b"]

    def test_packages_and_known_models(self, ledger: Ledger) -> None:
        """Packages round-trip; models seen in calls or syncs are known."""
        now = time.time()
        ledger.put_packages("pkg-model", [Package("pkg-model", 1000, now + 86_400)], now)
        ledger.reserve(request(1), limits(daily=10))
        ledger.put_snapshot("synced-model", Snapshot(1, 0, 0, now, DAY))
        assert ledger.packages("pkg-model") == [Package("pkg-model", 1000, now + 86_400)]
        assert ledger.packages("nothing") == []
        assert ledger.known_models() == sorted({"synced-model", MODEL})

    def test_leases(self, ledger: Ledger) -> None:
        """One holder at a time until the lease runs out or is released."""
        assert ledger.try_lease("billing", "a", 60.0, 1000.0)
        assert not ledger.try_lease("billing", "b", 60.0, 1010.0)
        assert ledger.try_lease("billing", "a", 60.0, 1020.0)
        assert ledger.try_lease("billing", "b", 60.0, 1081.0)
        ledger.release_lease("billing", "a")
        assert not ledger.try_lease("billing", "a", 60.0, 1082.0)
        ledger.release_lease("billing", "b")
        assert ledger.try_lease("billing", "a", 60.0, 1083.0)


# -- settle, release, resolve ---------------------------------------------------------------------


class TestSettle:
    def test_charges_actual_and_frees(self, ledger: Ledger) -> None:
        """Settle moves the hold out of flight and charges the actual usage on both scopes."""
        held = ledger.reserve(request(500), limits(daily=1000))
        ledger.settle(held.hold_id, usage(320), latency_s=0.25)
        assert md(ledger) == Counters(320, 0) and rc(ledger) == Counters(320, 0)
        totals = ledger.run_totals("run-a").models[MODEL]
        assert (totals.settled_tokens, totals.prompt_tokens, totals.completion_tokens) == (320, 106, 214)

    def test_idempotent(self, ledger: Ledger) -> None:
        """A retried settle never counts twice."""
        held = ledger.reserve(request(500), limits(daily=1000))
        for _ in range(3):
            ledger.settle(held.hold_id, usage(320))
        assert md(ledger) == Counters(320, 0)
        assert ledger.run_totals("run-a").models[MODEL].settled_tokens == 320

    def test_unknown_usage_charges_hold(self, ledger: Ledger) -> None:
        """No usage: the whole hold is charged and the call is unresolved."""
        held = ledger.reserve(request(500), limits(daily=1000))
        ledger.settle(held.hold_id, None)
        assert md(ledger) == Counters(500, 0)
        assert ledger.run_totals("run-a").models[MODEL].unresolved_calls == 1

    def test_late_settle_corrects_unresolved(self, ledger: Ledger) -> None:
        """Real usage arriving after an unresolved charge corrects it to the actual, once."""
        held = ledger.reserve(request(500), limits(daily=1000))
        ledger.settle(held.hold_id, None)
        ledger.settle(held.hold_id, usage(120))
        ledger.settle(held.hold_id, usage(999))
        assert md(ledger) == Counters(120, 0) and rc(ledger) == Counters(120, 0)
        totals = ledger.run_totals("run-a").models[MODEL]
        assert (totals.unresolved_calls, totals.settled_tokens) == (0, 120)

    def test_overshoot_flag(self, ledger: Ledger) -> None:
        """Usage above the hold is charged in full and flagged as an overshoot."""
        held = ledger.reserve(request(100), limits(daily=1000))
        ledger.settle(held.hold_id, usage(180))
        assert md(ledger).settled == 180
        assert ledger.run_totals("run-a").models[MODEL].overshoot_calls == 1

    def test_absurd_usage_is_clamped_and_limits_stay(self, ledger: Ledger) -> None:
        """A usage of 2^63 tokens is charged as holds.MAX_CHARGE: no counter wraps negative (Lua) or
        overflows (SQLite), and the model-day's cap refuses the next call."""
        held = ledger.reserve(request(100), limits(daily=10_000))
        ledger.settle(held.hold_id, Usage(prompt_tokens=2**63, completion_tokens=0, total_tokens=2**63), cost=2**64)
        assert md(ledger) == Counters(MAX_CHARGE, 0) and rc(ledger) == Counters(MAX_CHARGE, 0)
        assert cc(ledger) == Counters(MAX_CHARGE, 0)
        refused = ledger.reserve(request(1), limits(daily=10_000))
        assert not refused.held and refused.verdict.blocking is not None
        record = next(r for r in ledger.call_records() if r.id == held.hold_id)
        assert (record.charged, record.prompt_tokens, record.overshoot) == (MAX_CHARGE, MAX_CHARGE, True)

    def test_implausible_usage_is_recorded_as_such(self, ledger: Ledger) -> None:
        """A settle flagged with an anomaly charges the hold, and the record and totals say why."""
        flagged = ledger.reserve(request(500), limits(daily=10_000))
        plain = ledger.reserve(request(300), limits(daily=10_000))
        why = "total_tokens 9223372036854775808 is not a plausible token count"
        ledger.settle_many([Settle(flagged.hold_id, "settle", None, 0.1, None, why), Settle(plain.hold_id, "settle")])
        assert md(ledger) == Counters(800, 0)
        totals = ledger.run_totals("run-a").models[MODEL]
        assert (totals.unresolved_calls, totals.anomalous_calls) == (2, 1)
        records = {r.id: r for r in ledger.call_records()}
        assert records[flagged.hold_id].usage_anomaly == why
        assert records[plain.hold_id].usage_anomaly is None
        assert [row["anomalous_calls"] for row in aggregate(records.values())] == [1]

    def test_a_late_real_usage_clears_the_anomaly(self, ledger: Ledger) -> None:
        """Believable usage arriving later corrects the charge, and the call is no longer anomalous."""
        held = ledger.reserve(request(500), limits(daily=10_000))
        ledger.settle(held.hold_id, None, anomaly="completion_tokens -1 is not a plausible token count")
        ledger.settle(held.hold_id, usage(120))
        totals = ledger.run_totals("run-a").models[MODEL]
        assert (totals.unresolved_calls, totals.anomalous_calls, totals.settled_tokens) == (0, 0, 120)
        [record] = ledger.call_records()
        assert (record.state, record.usage_anomaly) == ("settled", None)

    def test_unknown_and_blocked_ids_are_ignored(self, ledger: Ledger) -> None:
        """Settling an id the ledger never held changes nothing."""
        refused = ledger.reserve(request(2000), limits(daily=1000))
        ledger.settle(refused.hold_id, usage(50))
        ledger.settle("no-such-hold", usage(50))
        assert md(ledger) == Counters(0, 0)


class TestRelease:
    def test_frees_without_charge(self, ledger: Ledger) -> None:
        """Release frees the hold, charges nothing, and a second release does nothing."""
        held = ledger.reserve(request(500), limits(daily=1000))
        ledger.release(held.hold_id)
        ledger.release(held.hold_id)
        assert md(ledger) == Counters(0, 0) and rc(ledger) == Counters(0, 0)
        assert ledger.run_totals("run-a").models[MODEL].released_calls == 1

    def test_a_hold_handed_over_is_no_call_of_its_own(self, ledger: Ledger) -> None:
        """A video task's create released ``handed_to`` the task's hold: totals and reports count one call."""
        create = ledger.reserve(request(500), limits(daily=10_000))
        task = ledger.reserve(dataclasses.replace(request(500), hold_id="task-cgt-1"), limits())
        ledger.release(create.hold_id, handed_to=task.hold_id)
        ledger.settle(task.hold_id, usage(400))
        assert md(ledger) == Counters(400, 0) and rc(ledger) == Counters(400, 0)
        totals = ledger.run_totals("run-a").models[MODEL]
        assert (totals.calls, totals.released_calls, totals.settled_tokens) == (1, 0, 400)
        records = ledger.call_records()
        assert {r.id: r.handed_to for r in records} == {create.hold_id: "task-cgt-1", "task-cgt-1": None}
        [row] = aggregate(records)
        assert (row["calls"], row["released_calls"], row["settled_tokens"]) == (1, 0, 400)

    def test_release_after_settle_is_ignored(self, ledger: Ledger) -> None:
        """A settled call stays charged."""
        held = ledger.reserve(request(500), limits(daily=1000))
        ledger.settle(held.hold_id, usage(200))
        ledger.release(held.hold_id)
        assert md(ledger) == Counters(200, 0)


class TestResolveRun:
    def test_charges_open_holds_of_the_run(self, ledger: Ledger) -> None:
        """Open holds of the run are charged as unresolved; other runs' holds stay open."""
        for _ in range(3):
            ledger.reserve(request(100), limits(daily=10_000))
        settled = ledger.reserve(request(100), limits(daily=10_000))
        ledger.settle(settled.hold_id, usage(40))
        ledger.reserve(request(100, run="run-b"), limits(daily=10_000))
        assert ledger.resolve_run("run-a") == 3
        assert ledger.resolve_run("run-a") == 0
        assert rc(ledger) == Counters(340, 0)
        assert md(ledger) == Counters(340, 100)
        assert ledger.run_totals("run-a").models[MODEL].unresolved_calls == 3


class TestReclaimOrphans:
    def test_expired_hold_is_charged(self, ledger: Ledger) -> None:
        """A hold past its validity is charged at its reserved amount, never dropped."""
        ledger.reserve(request(300, expires_in=-1), limits(daily=10_000))
        ledger.reserve(request(200), limits(daily=10_000))
        assert ledger.reclaim_orphans(time.time()) == 1
        assert md(ledger) == Counters(300, 200)
        assert ledger.reclaim_orphans(time.time()) == 0

    def test_dead_pid_on_this_host(self, ledger: Ledger) -> None:
        """A hold of a dead process on this host is charged; a foreign host's pid is not judged."""
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        ledger.reserve(request(300, pid=child.pid), limits(daily=10_000))
        ledger.reserve(request(200, pid=child.pid, host="some-other-host"), limits(daily=10_000))
        ledger.reserve(request(100), limits(daily=10_000))
        assert ledger.reclaim_orphans(time.time()) == 1
        assert md(ledger) == Counters(300, 300)
        assert ledger.run_totals("run-a").models[MODEL].unresolved_calls == 1


class TestCountersAndTotals:
    def test_numbers(self, ledger: Ledger) -> None:
        """Counters and run totals add up over a mix of outcomes."""
        a = ledger.reserve(request(100), limits(daily=10_000))
        b = ledger.reserve(request(200), limits(daily=10_000))
        c = ledger.reserve(request(300), limits(daily=10_000))
        ledger.reserve(request(400, model="other-model"), limits(daily=10_000))
        ledger.settle(a.hold_id, Usage(10, 20, 50, reasoning_tokens=20, cached_tokens=5))
        ledger.release(b.hold_id)
        assert c.held
        assert rc(ledger) == Counters(50, 700)
        totals = ledger.run_totals("run-a")
        assert set(totals.models) == {MODEL, "other-model"}
        mine = totals.models[MODEL]
        assert (mine.calls, mine.settled_tokens, mine.reserved_open_tokens, mine.released_calls) == (
            3,
            50,
            300,
            1,
        )
        assert (mine.reasoning_tokens, mine.cached_tokens) == (20, 5)
        assert totals.totals.reserved_open_tokens == 700

    def test_unknown_keys_are_zero(self, ledger: Ledger) -> None:
        """Counters of keys never written are zero."""
        assert ledger.counters([run_key("nobody"), "md:2000-01-01:x"]) == {
            run_key("nobody"): Counters(),
            "md:2000-01-01:x": Counters(),
        }


class TestEndpointModels:
    EP_A, EP_B = "ep-20250101123456-abcde", "ep-20250202123456-fghij"

    def test_every_process_reads_the_pairs_kept(self, ledger: Ledger, ledger_url: str) -> None:
        """Pairs kept by one process are read by another; an endpoint's newer pair replaces its older one."""
        assert ledger.endpoint_models() == {}
        ledger.put_endpoint_models({self.EP_A: "deepseek-v4-flash-260425", self.EP_B: "doubao-seed-1-6-250615"})
        ledger.put_endpoint_models({})
        other = open_ledger(ledger_url)
        try:
            assert other.endpoint_models() == {
                self.EP_A: "deepseek-v4-flash-260425",
                self.EP_B: "doubao-seed-1-6-250615",
            }
            other.put_endpoint_models({self.EP_A: "deepseek-v4-flash-260731"})
        finally:
            other.close()
        assert ledger.endpoint_models()[self.EP_A] == "deepseek-v4-flash-260731"


class TestMemberKeys:
    """The gateway's member keys: kept by their hash and tags, found by the hash, names unique, revocable."""

    @staticmethod
    def make(name: str, **tags: str) -> tuple[str, MemberKey]:
        secret = new_member_key()
        return secret, MemberKey(name, key_hash(secret), tags, time.time())

    def test_a_key_is_found_by_its_hash_from_another_process(self, ledger: Ledger, ledger_url: str) -> None:
        secret, ana = self.make("ana", team="search", note="équipe 検索")
        assert ledger.member_keys() == [] and ledger.member_key(key_hash(secret)) is None
        assert ledger.add_member_key(ana)
        _, bob = self.make("bob")
        assert ledger.add_member_key(bob)
        other = open_ledger(ledger_url)
        try:
            assert other.member_key(key_hash(secret)) == ana
            assert other.member_keys() == [ana, bob]
        finally:
            other.close()
        assert ledger.member_key(key_hash(new_member_key())) is None

    def test_a_name_is_never_taken_twice(self, ledger: Ledger) -> None:
        """Not even once revoked: the second key is not kept, and its hash finds nothing."""
        _, first = self.make("ana", team="search")
        second_secret, second = self.make("ana", team="infra")
        assert ledger.add_member_key(first)
        assert ledger.revoke_member_key("ana", time.time()) is not None
        assert not ledger.add_member_key(second)
        assert ledger.member_key(key_hash(second_secret)) is None
        assert [key.tags for key in ledger.member_keys()] == [{"team": "search"}]

    def test_revoking_keeps_the_record_and_its_first_time(self, ledger: Ledger) -> None:
        secret, ana = self.make("ana", team="search")
        ledger.add_member_key(ana)
        revoked = ledger.revoke_member_key("ana", 1_800_000_000.5)
        assert revoked == dataclasses.replace(ana, revoked_at=1_800_000_000.5)
        again = ledger.revoke_member_key("ana", 1_800_000_999.0)
        assert again is not None and again.revoked_at == 1_800_000_000.5
        assert ledger.member_key(key_hash(secret)) == revoked
        assert ledger.member_keys() == [revoked]
        assert ledger.revoke_member_key("nobody", 1_800_000_000.0) is None

    def test_one_name_added_at_once_by_threads_and_processes_is_kept_once(self, ledger_url: str) -> None:
        """4 processes of 4 threads each add a key named "shared": exactly one is kept, and only its hash finds it."""
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        processes = [context.Process(target=_add_shared_keys, args=(ledger_url, queue)) for _ in range(4)]
        for process in processes:
            process.start()
        tried = [attempt for _ in processes for attempt in queue.get(timeout=120)]
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0
        assert len(tried) == 16
        kept = [secret for secret, added in tried if added]
        assert len(kept) == 1
        ledger = open_ledger(ledger_url)
        try:
            assert [key.key_hash for key in ledger.member_keys()] == [key_hash(kept[0])]
            assert sum(ledger.member_key(key_hash(secret)) is not None for secret, _ in tried) == 1
        finally:
            ledger.close()


def _add_shared_keys(url: str, out: Any) -> None:
    """One process: 4 threads, started together, each adding its own key under the one name "shared"."""
    ledger = open_ledger(url)
    start = threading.Barrier(4)
    tried: list[tuple[str, bool]] = []
    lock = threading.Lock()

    def add() -> None:
        secret, key = TestMemberKeys.make("shared")
        start.wait()
        added = ledger.add_member_key(key)
        with lock:
            tried.append((secret, added))

    threads = [threading.Thread(target=add) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.close()
    out.put(tried)


class TestUnmappedEndpoints:
    """Calls to an endpoint whose model is not known yet are held on UNMAPPED's model-day, and what they
    hold and were charged counts against every model's day limits (any of them may be that model)."""

    def test_their_holds_count_against_every_model(self, ledger: Ledger) -> None:
        """A model's cap leaves room for the unmapped holds in flight, for every model, until they end."""
        unmapped = ledger.reserve(request(400, model=UNMAPPED), limits(daily=1000))
        assert unmapped.held
        for model in (MODEL, "other-model"):
            refused = ledger.reserve(request(601, model=model), limits(daily=1000))
            assert not refused.held and refused.counters["model_day"] == Counters(0, 400)
        held = ledger.reserve(request(600, model=MODEL), limits(daily=1000))
        assert held.held and held.counters["model_day"] == Counters(0, 400)
        assert md(ledger) == Counters(0, 600)  # the model's own counters are its own
        ledger.release(unmapped.hold_id)
        assert ledger.reserve(request(400, model=MODEL), limits(daily=1000)).held

    def test_what_they_were_charged_counts_against_every_model(self, ledger: Ledger) -> None:
        """An unmapped call charged whole (its model never told) stays against every model's day."""
        unmapped = ledger.reserve(request(300, model=UNMAPPED), limits(daily=1000))
        ledger.settle(unmapped.hold_id, None)
        assert md(ledger, UNMAPPED) == Counters(300, 0)
        assert not ledger.reserve(request(701, model="other-model"), limits(daily=1000)).held
        assert ledger.reserve(request(700, model="other-model"), limits(daily=1000)).held

    def test_their_own_model_day_is_counted_once(self, ledger: Ledger) -> None:
        """The unmapped calls' own check counts their holds once."""
        assert ledger.reserve(request(600, model=UNMAPPED), limits(daily=1000)).held
        assert not ledger.reserve(request(401, model=UNMAPPED), limits(daily=1000)).held
        assert ledger.reserve(request(400, model=UNMAPPED), limits(daily=1000)).held

    def test_other_days_are_not_counted(self, ledger: Ledger, ledger_url: str) -> None:
        """Yesterday's unmapped holds do not count against today's caps."""
        if isinstance(ledger, RedisLedger):  # on its own clock a Redis ledger takes the days it is given
            ledger = RedisLedger(ledger_url, clock=time.time)
        yesterday = beijing_day(time.time() - 86_400)
        assert ledger.reserve(request(900, model=UNMAPPED, day=yesterday), limits(daily=1000)).held
        assert ledger.reserve(request(1000), limits(daily=1000)).held


class TestSnapshots:
    def test_round_trip_and_history(self, ledger: Ledger) -> None:
        """A stored snapshot reads back equal; each sync joins the day's history."""
        assert ledger.snapshot(MODEL) is None
        now = time.time()
        first = Snapshot(1_500_000, 200_000, 150_000, now - 60, DAY, "billing-api")
        second = Snapshot(1_400_000, 300_000, 250_000, now, DAY, "billing-api")
        ledger.put_snapshot(MODEL, first)
        ledger.put_snapshot(MODEL, second)
        assert ledger.snapshot(MODEL) == second
        assert [balance for _, balance in ledger.sync_history(MODEL, DAY)] == [1_500_000, 1_400_000]

    def test_limits_see_the_snapshot(self, ledger: Ledger) -> None:
        """limits_for receives the snapshot stored just before the reserve."""
        seen: list[Snapshot | None] = []
        snap = Snapshot(1_000, 10, 10, time.time(), DAY)
        ledger.put_snapshot(MODEL, snap)
        ledger.reserve(request(1), lambda s: seen.append(s) or [])
        newer = Snapshot(2_000, 20, 20, time.time() + 1, DAY)
        ledger.put_snapshot(MODEL, newer)
        ledger.reserve(request(1), lambda s: seen.append(s) or [])
        assert seen[0] == snap and seen[-1] == newer


class TestUsageSeries:
    def test_grows_with_settles(self, ledger: Ledger) -> None:
        """Each charge stamps the cumulative model-day usage at its minute."""
        for actual in (100, 250):
            held = ledger.reserve(request(500), limits(daily=10_000))
            ledger.settle(held.hold_id, usage(actual))
        series = ledger.usage_series(MODEL, DAY)
        assert series and series[-1][1] == 350
        assert abs(series[-1][0] - time.time()) < 120


# -- concurrency ----------------------------------------------------------------------------------

WORKERS, THREADS, CALLS, CAP = 8, 4, 30, 40_000


def _hammer(url: str, worker: int, seed: int, out: Any) -> None:
    """One process: THREADS threads, each reserving and settling CALLS random calls."""
    ledger = open_ledger(url)
    records: list[tuple[int, int, int, int, int]] = []
    lock = threading.Lock()

    def thread(index: int) -> None:
        rng = random.Random(seed * 1000 + worker * 10 + index)
        # two runs, as two hosts would be, against one model-day cap
        run, host = ("host-a-run", "host-a") if worker % 2 else ("host-b-run", "host-b")
        for _ in range(CALLS):
            reserve = rng.randint(1, 2_000)
            hold = request(reserve, run=run, host=host)
            decision = ledger.reserve(hold, limits(daily=CAP))
            seen = decision.counters["model_day"]
            actual = 0
            if decision.held:
                if rng.random() < 0.1:
                    ledger.release(decision.hold_id)
                else:
                    actual = rng.randint(0, reserve)
                    ledger.settle(decision.hold_id, usage(actual))
            with lock:
                records.append((int(decision.held), reserve, actual, seen.settled, seen.in_flight))

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger.close()
    out.put(records)


def hammer(url: str) -> list[tuple[int, int, int, int, int]]:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_hammer, args=(url, w, 7, queue)) for w in range(WORKERS)]
    for p in processes:
        p.start()
    records = [record for _ in processes for record in queue.get(timeout=300)]
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0
    return records


class TestConcurrency:
    def test_no_overspend_and_exact_counters(self, ledger_url: str) -> None:
        """8 processes x 4 threads, two runs, one cap: holds never pass the cap and counters add up."""
        records = hammer(ledger_url)
        ledger = open_ledger(ledger_url)
        assert len(records) == WORKERS * THREADS * CALLS
        held = [r for r in records if r[0]]
        assert held and len(held) < len(records)  # the cap was reached, so the test tested something
        assert all(settled + in_flight + reserve <= CAP for _, reserve, _, settled, in_flight in held)
        charged = sum(actual for _, _, actual, _, _ in records)
        assert charged <= CAP
        assert md(ledger) == Counters(charged, 0)
        runs = ledger.counters([run_key("host-a-run"), run_key("host-b-run")])
        assert sum(c.settled for c in runs.values()) == charged
        totals = [ledger.run_totals(r).totals for r in ("host-a-run", "host-b-run")]
        assert sum(t.settled_tokens for t in totals) == charged
        assert sum(t.calls + t.blocked_calls for t in totals) == len(records)


# -- waiting lines (ledger/lines.py) ------------------------------------------------------------------


def waiter(hold: HoldRequest, name: str, ticket: int | None = None, *, can_wait: bool = True) -> HoldRequest:
    """``hold`` as the reserve of a call that waits in line as ``name``."""
    return dataclasses.replace(hold, waiter=name, ticket=ticket, can_wait=can_wait)


@pytest.fixture
def short_lease(monkeypatch: pytest.MonkeyPatch) -> float:
    """Leases of 0.3 s, so a test can let one run out."""
    monkeypatch.setattr("quotawrap.ledger.sqlite.reserve.LEASE_S", 0.3)
    monkeypatch.setattr("quotawrap.ledger.redis.reserve_args.LEASE_S", 0.3)
    return 0.3


class TestWaitingLines:
    def test_first_come_first_served(self, ledger: Ledger) -> None:
        """A big call waiting for holds in flight is not overtaken by a small call that fits the gap,
        nor by a call that cannot wait; once room frees, they are admitted in ticket order."""
        cap = limits(daily=1000)
        first = ledger.reserve(request(800), cap)
        big = ledger.reserve(waiter(request(500), "big"), cap)
        assert not big.held and big.waiting and not big.queued and big.ticket is not None
        small = ledger.reserve(waiter(request(100), "small"), cap)  # 800 + 100 fits, but "big" came first
        assert not small.held and small.queued == 1 and small.ticket is not None and small.ticket > big.ticket
        hasty = ledger.reserve(request(100), cap)  # --wait 0: refused by the line, not let past it
        assert not hasty.held and hasty.verdict.blocking is not None
        assert hasty.verdict.blocking.name == "waiting_line"
        assert md(ledger) == Counters(0, 800)
        totals = ledger.run_totals("run-a").totals
        assert (totals.calls, totals.blocked_calls) == (1, 1)  # waiting and queued attempts leave no row
        small_again = ledger.reserve(waiter(request(100), "small", small.ticket), cap)
        assert small_again.queued == 1  # still behind "big", as long as "big" does not fit
        ledger.release(first.hold_id)
        admitted = ledger.reserve(waiter(request(500), "big", big.ticket), cap)
        assert admitted.held
        after = ledger.reserve(waiter(request(100), "small", small.ticket), cap)
        assert after.held  # "big" left the line when admitted
        assert md(ledger) == Counters(0, 600)

    def test_lines_are_per_model_day_and_run(self, ledger: Ledger) -> None:
        """A wait for one model's daily cap holds up no other model; a wait for the run cap, the whole run."""
        daily = limits(daily=1000)
        ledger.reserve(request(800), daily)
        assert ledger.reserve(waiter(request(500), "big"), daily).waiting
        assert ledger.reserve(request(100, model="other-model"), daily).held
        assert ledger.reserve(request(100, run="run-b"), daily).verdict.blocking.name == "waiting_line"  # type: ignore[union-attr]
        run_cap = limits(run_cap=1000)
        ledger.reserve(request(900, run="run-c", model="m2"), run_cap)
        assert ledger.reserve(waiter(request(500, run="run-c", model="m2"), "run-waiter"), run_cap).waiting
        assert not ledger.reserve(request(50, run="run-c", model="m3"), run_cap).held  # same run, any model
        assert ledger.reserve(request(50, run="run-d", model="m2"), run_cap).held  # another run

    def test_never_fits_is_refused_at_once_and_not_queued(self, ledger: Ledger) -> None:
        cap = limits(daily=1000)
        ledger.reserve(request(300), cap)
        never = ledger.reserve(waiter(request(1200), "huge"), cap)
        assert not never.held and not never.waiting and not never.queued
        assert never.verdict.blocking is not None and never.verdict.blocking.name == "daily_cap"
        assert ledger.run_totals("run-a").totals.blocked_calls == 1
        assert ledger.reserve(request(100), cap).held  # "huge" holds no place in line

    def test_leave_on_give_up(self, ledger: Ledger) -> None:
        cap = limits(daily=1000)
        ledger.reserve(request(800), cap)
        gave_up = waiter(request(500), "big")
        assert ledger.reserve(gave_up, cap).waiting
        assert ledger.waiting(time.time()) == {MODEL: 1}
        assert not ledger.reserve(request(100), cap).held
        ledger.leave_line(gave_up)
        ledger.leave_line(gave_up)  # idempotent
        assert ledger.waiting(time.time()) == {}
        assert ledger.reserve(request(100), cap).held

    def test_overdue_waiter_is_refused_not_queued(self, ledger: Ledger) -> None:
        """A waiter past its deadline (can_wait False) gets a final refusal, with a row, never a place."""
        cap = limits(daily=1000)
        ledger.reserve(request(800), cap)
        big = ledger.reserve(waiter(request(500), "big"), cap)
        late = ledger.reserve(waiter(request(100), "late"), cap)
        final = ledger.reserve(waiter(request(100), "late", late.ticket, can_wait=False), cap)
        assert not final.held and not final.queued and final.verdict.blocking is not None
        assert final.verdict.blocking.name == "waiting_line"
        mine = ledger.reserve(waiter(request(500), "big", big.ticket, can_wait=False), cap)
        assert not mine.held and mine.verdict.blocking is not None and mine.verdict.blocking.name == "daily_cap"

    def test_a_dead_waiter_blocks_no_longer_than_its_lease(self, ledger: Ledger, short_lease: float) -> None:
        cap = limits(daily=1000)
        ledger.reserve(request(800), cap)
        assert ledger.reserve(waiter(request(500), "dead"), cap).waiting  # then it never polls again
        assert not ledger.reserve(request(100), cap).held
        time.sleep(short_lease * 2)
        assert ledger.waiting(time.time()) == {}
        assert ledger.reserve(request(100), cap).held

    def test_polling_keeps_the_place(self, ledger: Ledger, short_lease: float) -> None:
        cap = limits(daily=1000)
        ledger.reserve(request(800), cap)
        ticket = ledger.reserve(waiter(request(500), "alive"), cap).ticket
        for _ in range(4):
            time.sleep(short_lease / 2)
            assert ledger.reserve(waiter(request(500), "alive", ticket), cap).waiting
        assert not ledger.reserve(request(100), cap).held

    def test_watch_mode_ignores_the_lines(self, ledger: Ledger) -> None:
        cap = limits(daily=1000)
        ledger.reserve(request(800), cap)
        assert ledger.reserve(waiter(request(500), "big"), cap).waiting
        watched = ledger.reserve(request(100, enforce=False), cap)
        assert watched.held and watched.verdict.allowed and not watched.queued


# -- Redis only -----------------------------------------------------------------------------------


@pytest.fixture
def redis_ledger(redis_url: str) -> Iterator[RedisLedger]:
    opened = RedisLedger(redis_url)
    try:
        yield opened
    finally:
        opened.close()


def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, decode_responses=True)


class _Asked:
    """A ledger, its reserves listed as they are asked."""

    def __init__(self, ledger: Ledger, asked: list[HoldRequest]) -> None:
        self._ledger, self._asked = ledger, asked

    def reserve(self, hold: HoldRequest, limits_for: Any) -> Any:
        self._asked.append(hold)
        return self._ledger.reserve(hold, limits_for)


@pytest.mark.redis
def test_a_process_keeps_a_bounded_number_of_locations(
    redis_ledger: RedisLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child whose settles its wrapper lands never ends its holds itself: the oldest locations are forgotten,
    and a hold whose location was forgotten is found in the store when it settles."""
    monkeypatch.setattr("quotawrap.ledger.redis.ledger.LOCATIONS_KEPT", 3)
    holds = [redis_ledger.reserve(request(100), limits(daily=10_000)).hold_id for _ in range(5)]
    assert list(redis_ledger._locations) == holds[2:]
    redis_ledger.settle_many([Settle(hold_id, "settle", usage(10)) for hold_id in holds])
    assert md(redis_ledger) == Counters(50, 0)


@pytest.mark.redis
class TestScriptReload:
    def test_works_after_script_flush(self, redis_ledger: RedisLedger, redis_url: str) -> None:
        """After SCRIPT FLUSH the scripts are loaded again and the call goes through."""
        first = redis_ledger.reserve(request(100), limits(daily=1000))
        client = _client(redis_url)
        client.script_flush()
        script = redis_ledger._client._scripts["reserve_one"]
        assert client.script_exists(script.sha) == [False]
        second = redis_ledger.reserve(request(100), limits(daily=1000))
        redis_ledger.settle(first.hold_id, usage(60))
        assert second.held and client.script_exists(script.sha) == [True]
        assert md(redis_ledger) == Counters(60, 100)


@pytest.mark.redis
class TestScriptWire:
    """The scripts' own connection (client._Wire): an error reply leaves it in step, a store that does not
    answer in time is a retried timeout, and a connection the server closed is opened again."""

    def test_an_error_reply_keeps_the_connection(self, redis_ledger: RedisLedger) -> None:
        import redis

        assert redis_ledger.reserve(request(100), limits(daily=1000)).held
        client = redis_ledger._client
        sock = client._wire().conn._sock
        with pytest.raises(redis.exceptions.ResponseError):
            client._send("GET")  # wrong number of arguments: an error reply
        assert redis_ledger.reserve(request(100), limits(daily=1000)).held
        assert client._wire().conn._sock is sock  # the same connection, still in step

    def test_a_store_that_does_not_answer_in_time_is_a_retried_timeout(self, redis_url: str) -> None:
        import redis

        ledger = RedisLedger(redis_url, socket_timeout_s=0.2, retries=1)
        try:
            assert ledger.reserve(request(100), limits(daily=1000)).held
            client = ledger._client
            sock = client._wire().conn._sock
            _client(redis_url).execute_command("CLIENT", "PAUSE", "300", "ALL")  # the next reply waits 0.3 s
            with pytest.raises(redis.exceptions.TimeoutError):
                client._send("PING")
            assert client._wire().conn._sock is None  # closed: its reply may come later
            assert ledger.reserve(request(100), limits(daily=1000)).held  # connects again
            assert client._wire().conn._sock is not sock
            _client(redis_url).execute_command("CLIENT", "PAUSE", "300", "ALL")
            started = time.monotonic()
            assert ledger.reserve(request(100), limits(daily=1000)).held  # timed out once, then retried
            assert time.monotonic() - started >= 0.2
        finally:
            ledger.close()

    def test_a_connection_the_server_closed_is_opened_again(self, redis_ledger: RedisLedger, redis_url: str) -> None:
        assert redis_ledger.reserve(request(100), limits(daily=1000)).held
        _client(redis_url).execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert redis_ledger.reserve(request(100), limits(daily=1000)).held  # retried on a new connection
        assert md(redis_ledger).in_flight == 200


@pytest.mark.redis
def test_single_node_reserve_indexes_in_its_script(
    redis_ledger: RedisLedger, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a single node the reserve script indexes the model-day and the model: no round trip of their own."""

    def no_own_command(*args: object) -> None:
        raise AssertionError("indexed in a command of its own")

    monkeypatch.setattr(redis_ledger._client, "zadd", no_own_command)
    monkeypatch.setattr(redis_ledger._client, "sadd", no_own_command)
    assert redis_ledger.reserve(request(100, model="indexed-model"), limits(daily=1000)).held
    assert redis_ledger.known_models() == ["indexed-model"]
    assert _client(redis_url).zrange("qw:active", 0, -1) == [f"{DAY}\tindexed-model"]


class TestFailClosed:
    def test_unreachable_store_raises_store_error(self) -> None:
        """A dead Redis gives a StoreError naming the store, never a bare redis exception."""
        url = f"redis://127.0.0.1:{free_port()}/0"
        ledger = RedisLedger(url, connect_timeout_s=0.5, retries=0)
        with pytest.raises(StoreError) as caught:
            ledger.reserve(request(100), limits(daily=1000))
        assert caught.value.store == url and url in str(caught.value)

    def test_password_is_not_shown(self) -> None:
        """The store named in errors hides the password of the URL."""
        url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
        with pytest.raises(StoreError) as caught:
            RedisLedger(url, connect_timeout_s=0.5, retries=0).snapshot(MODEL)
        assert "s3cret" not in str(caught.value) and "***" in caught.value.store


@pytest.mark.redis
class TestRestart:
    def test_restart_mid_run(self, redis_server: RedisServer) -> None:
        """Threads keep calling through a restart: refused while down, nothing counted twice or lost."""
        ledger = RedisLedger(redis_server.url, retries=0)
        stop = threading.Event()
        outcomes: list[tuple[str, int]] = []
        errors: list[StoreError] = []
        lock = threading.Lock()

        def worker() -> None:
            while not stop.is_set():
                try:
                    decision = ledger.reserve(request(100), limits(daily=10_000_000))
                except StoreError as exc:
                    with lock:
                        errors.append(exc)
                    time.sleep(0.01)
                    continue
                while True:  # settle is idempotent: retry until the store confirms it
                    try:
                        ledger.settle(decision.hold_id, usage(60))
                        break
                    except StoreError as exc:
                        with lock:
                            errors.append(exc)
                        time.sleep(0.02)
                with lock:
                    outcomes.append(("settled", 60))

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        redis_server.stop()
        time.sleep(0.5)
        down = RedisLedger(redis_server.url, retries=0)
        with pytest.raises(StoreError) as caught:
            down.reserve(request(1), limits(daily=10))
        redis_server.start()
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert str(redis_server.port) in str(caught.value)
        assert errors and len(outcomes) > 20
        # a reserve whose reply was lost in the restart left a hold the thread never knew: charge it
        orphans = ledger.resolve_run("run-a")
        assert md(ledger) == Counters(60 * len(outcomes) + 100 * orphans, 0)
        assert ledger.run_totals("run-a").models[MODEL].settled_tokens == md(ledger).settled
        assert rc(ledger) == md(ledger)

    def test_restart_without_persistence_is_detected(self) -> None:
        """An empty store after a restart is not taken for a quiet day: the day is refused, for everyone."""
        binary = redis_binary()
        if binary is None:
            pytest.fail("redis-server is not installed")
        server = RedisServer(binary, appendonly=False).start()
        try:
            ledger = RedisLedger(server.url)
            held = ledger.reserve(request(100), limits(daily=1000))
            ledger.settle(held.hold_id, usage(100))
            server.restart()
            with pytest.raises(StoreError, match="lost"):
                ledger.reserve(request(100), limits(daily=1000))
            with pytest.raises(StoreError, match="lost"):
                RedisLedger(server.url).reserve(request(100), limits(daily=1000))
            with pytest.raises(StoreError, match="lost"):  # another day than the server's is moved to the server's
                RedisLedger(server.url).reserve(request(100, day="2030-01-02"), limits(daily=1000))
            # the mark is the day's: a ledger on a clock of its own (whose days are taken as given) opens another
            other_day = RedisLedger(server.url, clock=lambda: 1_893_542_400.0).reserve(
                request(100, day="2030-01-02"), limits(daily=1000)
            )
            assert other_day.held
        finally:
            server.cleanup()


def _litellm_incr(url: str, key: str, times: int, amount: int) -> None:
    """What the LiteLLM success callback does: INCR the day's key for its own hash, TTL 48h."""
    import redis

    client = redis.Redis.from_url(url)
    for _ in range(times):
        client.incrby(key, amount)
        client.expire(key, 48 * 3600)
    client.close()


@pytest.mark.redis
class TestLiteLLMInterop:
    def test_foreign_daily_usage_counts(self, redis_ledger: RedisLedger, redis_url: str) -> None:
        """Usage the LiteLLM limiter INCRs under its own hash is part of the model-day's settled."""
        key = f"daily_usage:{DAY}:{MODEL}:abcd1234"
        other = multiprocessing.get_context("fork").Process(target=_litellm_incr, args=(redis_url, key, 10, 70))
        other.start()
        other.join(timeout=30)
        assert md(redis_ledger).settled == 700
        refused = redis_ledger.reserve(request(400), limits(daily=1000))
        assert not refused.held and refused.counters["model_day"].settled == 700
        assert redis_ledger.reserve(request(300), limits(daily=1000)).held

    def test_own_usage_written_under_own_hash(self, redis_ledger: RedisLedger, redis_url: str) -> None:
        """Our settled usage goes to daily_usage:{date}:{model}:quotawrap (TTL 48h), counted once."""
        client = _client(redis_url)
        client.set(f"daily_usage:{DAY}:{MODEL}:abcd1234", 500)
        held = redis_ledger.reserve(request(300), limits(daily=10_000))
        redis_ledger.settle(held.hold_id, usage(250))
        own = f"daily_usage:{DAY}:{MODEL}:quotawrap"
        assert client.get(own) == "250"
        assert 47 * 3600 < client.ttl(own) <= 48 * 3600
        assert md(redis_ledger).settled == 750

    def test_custom_prefixes_and_date_format(self, redis_url: str) -> None:
        """Prefixes, date format and hash come from the URL's query string."""
        url = f"{redis_url}?daily_usage_prefix=du&snapshot_prefix=lim:v&date_format=%25Y%25m%25d&hash=qwx"
        ledger = RedisLedger(url)
        client = _client(redis_url)
        compact = DAY.replace("-", "")
        client.set(f"du:{compact}:{MODEL}:abcd1234", 900)
        refused = ledger.reserve(request(200), limits(daily=1000))
        assert not refused.held
        held = ledger.reserve(request(100), limits(daily=1000))
        ledger.settle(held.hold_id, usage(80))
        assert client.get(f"du:{compact}:{MODEL}:qwx") == "80"
        ledger.put_snapshot(MODEL, Snapshot(5_000, 980, 980, time.time(), DAY))
        assert client.get(f"lim:v:balance_at_sync:{MODEL}") == "5000"

    def test_snapshot_keys_both_ways(self, redis_ledger: RedisLedger, redis_url: str) -> None:
        """We write the limiter's two snapshot keys (TTL 24h) and read theirs when we have none."""
        client = _client(redis_url)
        client.set(f"limit:dynamic:volcengine:balance_at_sync:{MODEL}", 1_234_567, ex=24 * 3600)
        client.set(f"limit:dynamic:volcengine:usage_at_sync:{MODEL}", 345_678, ex=24 * 3600)
        theirs = redis_ledger.snapshot(MODEL)
        assert theirs is not None and theirs.source == "litellm"
        assert (theirs.balance, theirs.usage_at_sync, theirs.day) == (1_234_567, 345_678, DAY)
        redis_ledger.put_snapshot(MODEL, Snapshot(999_000, 1_000, 900, time.time(), DAY, "billing-api"))
        assert client.get(f"limit:dynamic:volcengine:balance_at_sync:{MODEL}") == "999000"
        assert client.get(f"limit:dynamic:volcengine:usage_at_sync:{MODEL}") == "1000"
        assert 23 * 3600 < client.ttl(f"limit:dynamic:volcengine:usage_at_sync:{MODEL}") <= 24 * 3600
        ours = redis_ledger.snapshot(MODEL)
        assert ours is not None and (ours.source, ours.lagged_usage) == ("billing-api", 900)

    def test_their_newer_snapshot_gets_our_lag(self, redis_url: str) -> None:
        """Both snapshots exist and the limiter's is newer: its lagged usage is read from our usage
        series at its sync time minus our lag, not taken at face value (which lifted the limit)."""
        now = time.time()
        synced = now - 600
        if beijing_day(synced - 2000) != beijing_day(synced):  # keep the whole story in one Beijing day
            synced = beijing_day_start(now) - 600
        day, lag = beijing_day(synced), 1800.0
        clock = [synced - 1900.0]
        ledger = RedisLedger(redis_url, clock=lambda: clock[0])
        first = ledger.reserve(request(1_000, day=day), limits(daily=10**9))
        ledger.settle(first.hold_id, usage(1_000))  # usage 1,000 before synced - lag
        clock[0] = synced - 100.0
        second = ledger.reserve(request(9_000, day=day), limits(daily=10**9))
        ledger.settle(second.hold_id, usage(9_000))  # 10,000 at the limiter's sync, 9,000 of it not yet billed
        # our sync, five minutes before theirs, with the lag configured (it records the lag it used)
        record_balance(ledger, MODEL, 2_000_000, synced - 300, QuotaSettings(balance_lag_s=lag), source="billing-api")
        client = _client(redis_url)
        ttl = int((24 * 3600 - (now - synced)) * 1000)  # the limiter's sync time is told by its 24 h TTL
        client.set(f"limit:dynamic:volcengine:balance_at_sync:{MODEL}", 1_990_000, px=ttl)
        client.set(f"limit:dynamic:volcengine:usage_at_sync:{MODEL}", 10_000, px=ttl)
        theirs = ledger.snapshot(MODEL)
        assert theirs is not None and theirs.source == "litellm" and theirs.usage_at_sync == 10_000
        assert (theirs.lagged_usage, theirs.lag_s) == (1_000, lag)
        ledger.close()

    def test_shared_with_a_limiter_process(self, redis_url: str) -> None:
        """Our processes beside a limiter INCRing daily_usage: every hold counts its usage seen so far."""
        key = f"daily_usage:{DAY}:{MODEL}:abcd1234"
        _client(redis_url).set(key, 1)  # the limiter's key exists before the run (names are re-scanned each second)
        context = multiprocessing.get_context("fork")
        other = context.Process(target=_litellm_incr, args=(redis_url, key, 400, 25))
        other.start()
        records = hammer(redis_url)
        other.join(timeout=60)
        ledger = RedisLedger(redis_url)
        foreign = int(_client(redis_url).get(key) or 0)
        charged = sum(actual for _, _, actual, _, _ in records)
        assert foreign == 1 + 400 * 25
        assert md(ledger) == Counters(charged + foreign, 0)
        assert all(s + f + r <= CAP for held, r, _, s, f in records if held)
        # the limiter's usage pushed ours down: we only spent what its usage left
        assert charged <= CAP - 1


@pytest.mark.redis
class TestMemoryBounded:
    def test_keys_do_not_grow_with_calls(self, redis_url: str) -> None:
        """5,000 settled calls leave O(1) keys, each with a TTL, and a capped audit stream."""
        ledger = RedisLedger(f"{redis_url}?audit_max=500")
        client = _client(redis_url)

        def calls(n: int) -> None:
            for i in range(n):
                held = ledger.reserve(request(50), limits(daily=10**9))
                ledger.settle(held.hold_id, usage(i % 50))

        calls(500)
        after_500 = client.dbsize()
        calls(4500)
        assert client.dbsize() == after_500 <= 15
        persistent = [k for k in client.keys("*") if client.ttl(k) == -1]
        assert sorted(persistent) == ["qw:active", "qw:meta", "qw:models"]  # O(models), not O(calls)
        assert client.xlen(f"{{qw:md:{DAY}:{MODEL}}}:audit") <= 700
        assert md(ledger).settled == sum(i % 50 for i in range(500)) + sum(i % 50 for i in range(4500))


@pytest.mark.redis
class TestCluster:
    @pytest.fixture
    def cluster_url(self) -> Iterator[str]:
        reason = cluster_unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        binary = redis_binary()
        assert binary is not None
        cluster = RedisCluster3(binary).start()
        try:
            yield cluster.url
        finally:
            cluster.cleanup()

    def test_contract_on_cluster(self, cluster_url: str) -> None:
        """On a three-master Cluster the same calls give the same answers, in two-slot mode."""
        ledger = RedisLedger(cluster_url)
        a = ledger.reserve(request(600), limits(run_cap=1000, daily=5000))
        blocked = ledger.reserve(request(500), limits(run_cap=1000, daily=5000))
        assert ledger.cluster and a.held and not blocked.held
        assert blocked.verdict.blocking is not None and blocked.verdict.blocking.name == "run_cap"
        assert rc(ledger) == Counters(0, 600)  # the refused call's run hold was given back
        ledger.settle(a.hold_id, usage(400))
        ledger.settle(a.hold_id, usage(400))
        ledger.reserve(request(100, expires_in=-1), limits(daily=5000))
        assert ledger.reclaim_orphans(time.time()) == 1
        ledger.reserve(request(50), limits(daily=5000))
        assert ledger.resolve_run("run-a") == 1
        assert md(ledger) == rc(ledger) == Counters(550, 0)
        assert ledger.run_totals("run-a").models[MODEL].settled_tokens == 550
        flagged = ledger.reserve(request(20), limits(daily=5000))
        handed = ledger.reserve(request(30), limits(daily=5000))
        ledger.settle_many([Settle(flagged.hold_id, "settle", anomaly="total_tokens -1 is implausible")])
        ledger.release(handed.hold_id, handed_to="task-1")
        totals = ledger.run_totals("run-a").models[MODEL]
        assert (totals.calls, totals.anomalous_calls, totals.released_calls) == (4, 1, 0)
        # an advance would span two slots when split: refused at once, nothing written, the call reserves alone,
        # and its process asks for none again
        before = md(ledger), rc(ledger)
        advance = ledger.reserve(dataclasses.replace(request(100), endpoint=ADVANCE, advance=True), limits(daily=5000))
        assert not advance.held and ledger.run_totals("run-a").models[MODEL] == totals
        assert (md(ledger), rc(ledger)) == before
        asked: list[HoldRequest] = []
        advances = Advances(lambda: _Asked(ledger, asked), lambda _settle: None, lambda _settle: True)
        seen = {"model_day": Counters(0, 0)}
        assert advances.take(request(100), 0.0, limits(daily=5000), [], seen) is None and advances.declined
        assert advances.take(request(100), 0.0, limits(daily=5000), [], seen) is None
        assert len(asked) == 1 and (md(ledger), rc(ledger)) == before

    def test_unmapped_holds_count_on_cluster(self, cluster_url: str) -> None:
        """On Cluster the unmapped endpoints' counters (another slot) are read before the model-day script."""
        ledger = RedisLedger(cluster_url)
        unmapped = ledger.reserve(request(400, model=UNMAPPED), limits(daily=1000))
        assert unmapped.held and not ledger.reserve(request(601), limits(daily=1000)).held
        ledger.settle(unmapped.hold_id, usage(100))
        assert ledger.reserve(request(900), limits(daily=1000)).held
        assert md(ledger) == Counters(0, 900)

    def test_waiting_lines_on_cluster(self, cluster_url: str) -> None:
        """The lines on Cluster: the run slot's line in the gate, the model-day's in its own script."""
        ledger = RedisLedger(cluster_url)
        daily, run_cap = limits(daily=1000), limits(run_cap=1000)
        first = ledger.reserve(request(800), daily)
        big = ledger.reserve(waiter(request(500), "big"), daily)
        assert big.waiting and big.ticket is not None
        small = ledger.reserve(waiter(request(100), "small"), daily)
        assert small.queued and small.ticket is not None and small.ticket > big.ticket
        assert ledger.reserve(request(100), daily).verdict.blocking.name == "waiting_line"  # type: ignore[union-attr]
        assert rc(ledger) == Counters(0, 800)  # the queued calls' run holds were given back
        ledger.release(first.hold_id)
        assert ledger.reserve(waiter(request(500), "big", big.ticket), daily).held
        assert ledger.reserve(waiter(request(100), "small", small.ticket), daily).held
        ledger.reserve(request(900, run="run-c"), run_cap)
        run_waiter = ledger.reserve(waiter(request(500, run="run-c", model="m2"), "rw"), run_cap)
        assert run_waiter.waiting
        assert not ledger.reserve(request(50, run="run-c", model="m3"), run_cap).held
        ledger.leave_line(waiter(request(500, run="run-c", model="m2"), "rw"))
        assert ledger.reserve(request(50, run="run-c", model="m3"), run_cap).held

    def test_concurrency_on_cluster(self, cluster_url: str) -> None:
        """The 8-process hammer against one cap on Cluster: no overspend, counters add up."""
        records = hammer(cluster_url)
        ledger = RedisLedger(cluster_url)
        charged = sum(actual for _, _, actual, _, _ in records)
        assert charged <= CAP
        assert all(s + f + r <= CAP for held, r, _, s, f in records if held)
        assert md(ledger) == Counters(charged, 0)
        runs = ledger.counters([run_key("host-a-run"), run_key("host-b-run")])
        assert sum(c.settled for c in runs.values()) == charged


@pytest.mark.redis
class TestLandingAnotherProcesssHolds:
    def test_a_batch_of_holds_it_did_not_reserve_is_located_in_one_round_trip(self, redis_url: str) -> None:
        """The wrapper lands its child's settles on its own ledger, which reserved none of those holds: where each
        lives is read for the whole batch in one MGET, not one GET round trip per settle, and each lands exactly."""
        reserving, landing = RedisLedger(redis_url), RedisLedger(redis_url)
        holds = [reserving.reserve(request(100), limits(daily=10**9)).hold_id for _ in range(6)]
        raw = _client(redis_url)
        raw.config_resetstat()
        landing.settle_many(
            [Settle(hold, "settle", usage(40), 0.1, 0) for hold in holds[:5]] + [Settle(holds[5], "release")]
        )
        stats = raw.info("commandstats")
        assert "cmdstat_get" not in stats
        assert stats["cmdstat_mget"]["calls"] == 1
        assert md(landing) == Counters(200, 0)
        reserving.close()
        landing.close()
