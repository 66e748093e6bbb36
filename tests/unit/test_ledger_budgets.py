"""Budgets in both stores (issue 33): a hold is checked against its budgets in the reserve's one step, and every
later step of it (settle, release, resolve, reclaim, a late settle of an unresolved call) moves the budget's
counters exactly as it moves the run's. SQLite (a temp file), Redis (a private redis-server), Redis Cluster.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quotawrap.core.budgets import Budget, budget_scope, parse_budget, period_key
from quotawrap.core.quota import Counters, Limit, beijing_day
from quotawrap.core.usage import Usage
from quotawrap.ledger import Ledger, open_ledger
from quotawrap.ledger.base import ADVANCE, HoldRequest, run_cost_key, run_key
from quotawrap.ledger.redis import RedisLedger
from tests.redis_server import RedisCluster3, cluster_unavailable_reason, flushed, redis_binary, session_url

DAY = beijing_day(time.time())
MODEL = "doubao-seed-1-6"
TEAM = parse_budget("team=search:1000/day")
MONEY = parse_budget("team=search:cny0.01/month")  # 10,000 micro-CNY


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[str]:
    with session_url() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    else:
        url = flushed(request.getfixturevalue("shared_redis"))
    opened = open_ledger(url)
    try:
        yield opened
    finally:
        opened.close()


def hold(
    reserve: int, *, team: str = "search", run: str = "run-a", cost: int = 0, expires_in: float = 600
) -> HoldRequest:
    return HoldRequest(
        run_id=run,
        model=MODEL,
        day=DAY,
        reserve=reserve,
        endpoint="/api/v3/chat/completions",
        pid=os.getpid(),
        host=socket.gethostname(),
        expires_at=time.time() + expires_in,
        reserve_cost=cost,
        tags={"team": team},
    )


def no_limits(snapshot: object) -> list[Limit]:
    return []


def used(ledger: Ledger, budget: Budget = TEAM, run: str = "run-a") -> Counters:
    scope = budget_scope(budget, period_key(budget.period, time.time(), run))
    return ledger.counters([scope])[scope]


def usage(total: int) -> Usage:
    return Usage(prompt_tokens=total // 3, completion_tokens=total - total // 3, total_tokens=total)


def test_set_list_remove(ledger: Ledger) -> None:
    assert ledger.set_budget(TEAM) and not ledger.set_budget(TEAM)  # the same budget twice: nothing changes
    raised = parse_budget("team=search:2000/day")
    assert ledger.set_budget(raised) and ledger.budgets() == [raised]  # same id: the amount is replaced
    own = parse_budget("*:50/run", run_id="run-a")
    ledger.set_budget(own)
    assert ledger.budgets("run-a") == sorted([raised, own], key=lambda b: b.id)
    assert ledger.budgets("run-b") == [raised]
    assert ledger.remove_budget(raised.id) and not ledger.remove_budget(raised.id)
    assert ledger.budgets("run-b") == []


def test_refused_past_the_budget_named_with_its_numbers(ledger: Ledger) -> None:
    ledger.set_budget(TEAM)
    first = ledger.reserve(hold(600), no_limits)
    assert first.held and used(ledger) == Counters(0, 600)
    refused = ledger.reserve(hold(401), no_limits)
    assert not refused.held and refused.verdict.blocking is not None
    assert refused.verdict.blocking.name == f"budget {TEAM.id}"
    scope = refused.verdict.blocking.scope
    assert refused.counters[scope] == Counters(0, 600)  # what the refusal message reads
    assert ledger.reserve(hold(400), no_limits).held  # exactly the rest fits
    assert ledger.reserve(hold(5000, team="ads"), no_limits).held  # another team's calls are not its business


def test_a_call_waits_for_room_held_by_calls_in_flight(ledger: Ledger) -> None:
    """A call that does not fit a budget only because of holds in flight waits at the head of its lines (it is not
    refused, nothing is held), and is admitted once they settle: as for every other limit (ledger/lines.py)."""
    ledger.set_budget(TEAM)
    first = ledger.reserve(hold(600), no_limits)
    waiter = dataclasses.replace(hold(500), waiter="w-1", can_wait=True)
    waiting = ledger.reserve(waiter, no_limits)
    assert waiting.waiting and not waiting.held and used(ledger) == Counters(0, 600)
    never = ledger.reserve(dataclasses.replace(hold(1001, run="run-b"), waiter="w-2", can_wait=True), no_limits)
    assert (never.waiting, never.queued, never.held) == (False, 0, False)  # no room could ever be made for it
    assert never.verdict.blocking is not None and never.verdict.blocking.name == f"budget {TEAM.id}"
    ledger.settle(first.hold_id, usage(300))
    admitted = ledger.reserve(dataclasses.replace(waiter, ticket=waiting.ticket), no_limits)
    assert admitted.held and used(ledger) == Counters(300, 500)


def test_every_step_charges_the_budget_as_the_run(ledger: Ledger) -> None:
    ledger.set_budget(TEAM)
    ledger.set_budget(MONEY)
    settled = ledger.reserve(hold(300, cost=3000), no_limits)
    released = ledger.reserve(hold(200, cost=2000), no_limits)
    resolved = ledger.reserve(hold(100, cost=1000), no_limits)
    assert used(ledger) == Counters(0, 600) and used(ledger, MONEY) == Counters(0, 6000)
    ledger.settle(settled.hold_id, usage(250), cost=2500)
    ledger.settle(settled.hold_id, usage(250), cost=2500)  # idempotent
    ledger.release(released.hold_id)
    assert used(ledger) == Counters(250, 100) and used(ledger, MONEY) == Counters(2500, 1000)
    assert ledger.resolve_run("run-a") == 1  # charged whole: unresolved
    assert used(ledger) == Counters(350, 0) and used(ledger, MONEY) == Counters(3500, 0)
    ledger.settle(resolved.hold_id, usage(40), cost=400)  # its real usage came late: corrected
    assert used(ledger) == Counters(290, 0) and used(ledger, MONEY) == Counters(2900, 0)
    run, cost = ledger.counters([run_key("run-a")])[run_key("run-a")], ledger.counters([run_cost_key("run-a")])
    assert run.settled == used(ledger).settled and cost[run_cost_key("run-a")].settled == used(ledger, MONEY).settled


def test_a_video_tasks_hold_is_charged_never_refused(ledger: Ledger) -> None:
    """A video task takes over its create's hold (settling/followups.py): its room was checked when the create was
    reserved, so the budget never refuses the handover (that would let the task run unbudgeted), and counts it."""
    ledger.set_budget(TEAM)
    create = ledger.reserve(hold(800), no_limits)
    task = dataclasses.replace(hold(800), hold_id="task-1", taken_over=True)
    assert create.held and ledger.reserve(task, no_limits).held
    ledger.release(create.hold_id, handed_to="task-1")
    ledger.settle("task-1", usage(700))
    assert used(ledger) == Counters(700, 0)


def test_reclaimed_holds_are_charged_to_the_budget(ledger: Ledger) -> None:
    ledger.set_budget(TEAM)
    ledger.reserve(hold(300, expires_in=-1), no_limits)
    assert ledger.reclaim_orphans(time.time()) == 1
    assert used(ledger) == Counters(300, 0)


def test_a_soft_budget_counts_and_never_refuses(ledger: Ledger) -> None:
    soft = parse_budget("team=search:100/day,soft")
    ledger.set_budget(soft)
    decision = ledger.reserve(hold(500), no_limits)
    assert decision.held
    ledger.settle(decision.hold_id, usage(450))
    assert used(ledger, soft) == Counters(450, 0)


def test_a_runs_own_budget_counts_its_run_alone(ledger: Ledger) -> None:
    own = parse_budget("*:500/day", run_id="run-a")
    ledger.set_budget(own)
    assert ledger.reserve(hold(400), no_limits).held
    assert not ledger.reserve(hold(200), no_limits).held
    assert ledger.reserve(hold(5000, run="run-b"), no_limits).held
    assert used(ledger, own) == Counters(0, 400)


def test_no_advance_past_a_budget(ledger: Ledger) -> None:
    """An advance is refused with every limit fitting (its process reserves each call alone) when a budget matches
    its calls, and leaves nothing behind; without a matching budget it is taken."""
    ledger.set_budget(TEAM)
    advance = dataclasses.replace(hold(100), endpoint=ADVANCE, advance=True)
    declined = ledger.reserve(advance, no_limits)
    assert not declined.held and declined.verdict.allowed and used(ledger) == Counters(0, 0)
    other = dataclasses.replace(hold(100, team="ads"), endpoint=ADVANCE, advance=True)
    assert ledger.reserve(other, no_limits).held
    # a budget on an API key bars advances whatever key asked: the calls drawn from one may use another key
    ledger.set_budget(parse_budget("team=infra,key=sk-other*:100/day"))
    keyed = dataclasses.replace(hold(100, team="infra"), endpoint=ADVANCE, advance=True, key_fingerprint="sk-mine")
    assert not ledger.reserve(keyed, no_limits).held


def test_threads_never_overrun_a_budget(ledger: Ledger) -> None:
    """Sixteen threads reserve and settle against one budget: what settles never passes it."""
    ledger.set_budget(TEAM)
    taken: list[int] = []

    def worker() -> None:
        for _ in range(20):
            decision = ledger.reserve(hold(37), no_limits)
            if decision.held:
                taken.append(37)
                ledger.settle(decision.hold_id, usage(37))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert used(ledger) == Counters(sum(taken), 0)
    assert 1000 - 37 < sum(taken) <= 1000


@pytest.mark.redis
def test_budgets_on_cluster() -> None:
    """On a three-master Cluster the budgets' slot is checked by a gate of its own and moved beside the run's."""
    reason = cluster_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    binary = redis_binary()
    assert binary is not None
    cluster = RedisCluster3(binary).start()
    try:
        ledger: Any = RedisLedger(cluster.url)
        ledger.set_budget(TEAM)
        first = ledger.reserve(hold(600), no_limits)
        refused = ledger.reserve(hold(401), no_limits)
        assert (
            ledger.cluster and first.held and not refused.held and refused.verdict.blocking.name == f"budget {TEAM.id}"
        )
        assert used(ledger) == Counters(0, 600)  # the refused call's budget share was given back
        ledger.settle(first.hold_id, usage(500))
        ledger.reserve(hold(100, expires_in=-1), no_limits)
        assert ledger.reclaim_orphans(time.time()) == 1
        assert used(ledger) == Counters(600, 0)
        ledger.close()
    finally:
        cluster.cleanup()


def test_prune_takes_a_calls_budget_scopes_with_it(tmp_path: Path) -> None:
    """SQLite: a pruned call's rows of hold_budgets go with it; what the budget counted stays counted."""
    import sqlite3
    from datetime import date, timedelta

    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    try:
        ledger.set_budget(TEAM)
        settled, open_ = ledger.reserve(hold(300), no_limits), ledger.reserve(hold(200), no_limits)
        ledger.settle(settled.hold_id, usage(250))
        ledger.prune((date.fromisoformat(DAY) + timedelta(days=1)).isoformat())
        with sqlite3.connect(tmp_path / "ledger.sqlite3") as conn:
            kept = [hold_id for (hold_id,) in conn.execute("SELECT hold_id FROM hold_budgets")]
        assert kept == [open_.hold_id]  # the hold in flight keeps its scopes
        assert used(ledger) == Counters(250, 200)
    finally:
        ledger.close()
