"""The per-process settler and the stores' batched settle: exact once landed, never under while queued."""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from quotawrap.core.quota import Counters
from quotawrap.ledger import Ledger, open_ledger
from quotawrap.ledger.base import Settle
from quotawrap.ledger.redis.ledger import RedisLedger
from quotawrap.ledger.scopes import model_day_key, run_cost_key, run_key
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from quotawrap.settling.settler import Settler
from tests.redis_server import flushed, private_server, session_url
from tests.unit.test_ledger_contract import MODEL, limits, rc, request, usage
from tests.unit.test_ledger_contract import request as request_for


@pytest.fixture(scope="module")
def module_redis() -> Iterator[str]:
    with session_url() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    else:
        url = flushed(request.getfixturevalue("module_redis"))
    opened = open_ledger(url)
    try:
        yield opened
    finally:
        opened.close()


def test_settle_many_lands_a_mixed_batch_once(ledger: Ledger) -> None:
    """One batch: settled, released, unresolved holds counted as settle and release would; a replay: no change."""
    holds = [ledger.reserve(request(400), limits(run_cap=10_000)).hold_id for _ in range(4)]
    batch = [
        Settle(holds[0], "settle", usage(100), 0.1, 0),
        Settle(holds[1], "settle", usage(450), 0.1, 0),  # beyond its hold: charged as billed
        Settle(holds[2], "release"),
        Settle(holds[3], "settle", None, 0.1, 0),  # no usage: the whole hold
        Settle("no-such-hold", "settle", usage(5)),
    ]
    ledger.settle_many(batch)
    assert rc(ledger) == Counters(100 + 450 + 400, 0)
    ledger.settle_many(batch)
    assert rc(ledger) == Counters(950, 0)
    states = {r.id: r.state for r in ledger.call_records(run_id="run-a")}
    assert [states[h] for h in holds] == ["settled", "settled", "released", "unresolved"]


def test_a_queued_settle_keeps_its_hold_in_flight(ledger: Ledger) -> None:
    """While settles wait, their holds count whole: a reserve that fits the truth but not the holds is refused."""
    settler = Settler(lambda: ledger)
    cap = limits(run_cap=1200)
    held = [ledger.reserve(request(400), cap) for _ in range(3)]
    with settler._lock:  # test-only: the thread cannot land anything while this is held
        for decision in held:
            settler.submit(Settle(decision.hold_id, "settle", usage(100), 0.1, 0))
        assert settler.pending == 3
        assert rc(ledger) == Counters(0, 1200)
        refused = ledger.reserve(request(400), cap)
        assert not refused.held and refused.verdict.blocking is not None
    assert settler.flush(timeout=10)
    assert rc(ledger) == Counters(300, 0)
    assert ledger.reserve(request(400), cap).held


def test_concurrent_settles_never_undercount(ledger: Ledger) -> None:
    """4 threads reserve and queue settles while a reader checks: settled + in flight >= what completed calls used."""
    settler = Settler(lambda: ledger)
    threads, pairs, reserve, used = 4, 40, 400, 100
    done = [0]
    done_lock = threading.Lock()
    stop = threading.Event()
    violations: list[tuple[int, Counters]] = []

    def caller() -> None:
        for _ in range(pairs):
            decision = ledger.reserve(request(reserve), limits(run_cap=10**9))
            settler.submit(Settle(decision.hold_id, "settle", usage(used), 0.01, 0))
            with done_lock:
                done[0] += used  # the caller is done with this call: the truth includes it

    def reader() -> None:
        while not stop.is_set():
            with done_lock:
                truth = done[0]
            seen = rc(ledger)
            if seen.settled + seen.in_flight < truth:
                violations.append((truth, seen))

    watcher = threading.Thread(target=reader)
    watcher.start()
    workers = [threading.Thread(target=caller) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stop.set()
    watcher.join()
    assert violations == []
    assert settler.flush(timeout=30)
    assert rc(ledger) == Counters(threads * pairs * used, 0)


def test_fork_lands_the_parents_queue_and_starts_the_child_empty(tmp_path: Path) -> None:
    """Before fork the parent's queue lands; the child starts with an empty settler that works."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    ledger = open_ledger(url)
    settler = Settler(lambda: ledger)
    holds = [ledger.reserve(request(400), limits(run_cap=10**9)).hold_id for _ in range(50)]
    # Test-only: queued without waking the thread, so only the fork hook can land them.
    settler._queue.extend((Settle(hold_id, "settle", usage(100), 0.01, 0), None) for hold_id in holds)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            mine = open_ledger(url)
            child = Settler(lambda: mine)
            decision = mine.reserve(request(400), limits(run_cap=10**9))
            child.submit(Settle(decision.hold_id, "settle", usage(7), 0.01, 0))
            if settler.pending == 0 and settler.flush(timeout=5) and child.flush(timeout=5):
                code = 0
        finally:
            os._exit(code)
    assert rc(ledger) == Counters(50 * 100, 0)  # before the parent flushed anything itself
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rc(ledger) == Counters(50 * 100 + 7, 0)
    ledger.close()


_KEEP: list[Settler] = []


def _queue_and_return(url: str) -> None:
    """A multiprocessing target: three settles queued, none landed, then the child ends (os._exit)."""
    ledger = open_ledger(url)
    settler = Settler(lambda: ledger)
    _KEEP.append(settler)  # as a guard keeps its settler for the process's life
    holds = [ledger.reserve(request(400), limits(run_cap=10**9)).hold_id for _ in range(3)]
    # Test-only: queued without waking the thread, so only the exit flush can land them.
    settler._queue.extend((Settle(hold_id, "settle", usage(100), 0.01, 0), None) for hold_id in holds)


def test_a_multiprocessing_fork_child_lands_its_queue_at_exit(tmp_path: Path) -> None:
    """A fork-started multiprocessing child ends with os._exit (no atexit): its queued settles still land."""
    import multiprocessing

    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    process = multiprocessing.get_context("fork").Process(target=_queue_and_return, args=(url,))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    ledger = open_ledger(url)
    assert rc(ledger) == Counters(300, 0)
    ledger.close()


@pytest.mark.redis
def test_a_batch_the_store_refuses_stays_queued_and_lands_exactly_later() -> None:
    """Redis is down while a settle lands: it stays queued (the hold counts whole) and lands once Redis is back."""
    with private_server(appendonly=True) as server:
        ledger = open_ledger(server.url)
        try:
            hold = ledger.reserve(request(400), limits(run_cap=10_000)).hold_id
            settler = Settler(lambda: ledger)
            server.stop()
            settler.submit(Settle(hold, "settle", usage(120), 0.1, 0))
            assert settler.flush() is False and settler.pending == 1
            server.start()
            assert rc(ledger) == Counters(0, 400)  # still held whole, never under
            assert settler.flush() is True and settler.pending == 0
            assert rc(ledger) == Counters(120, 0)
        finally:
            ledger.close()


_BATCH_RUNS, _BATCH_MODELS = ("run-a", "run-b"), (MODEL, "doubao-seed-1-6-250615")
_SIDES = {"batched": "2026-05-01", "one by one": "2026-05-02"}  # one ledger, a model-day and runs for each side


@pytest.mark.parametrize("store", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_batch_charges_each_counter_as_its_settles_one_by_one_would(
    store: str, request: pytest.FixtureRequest
) -> None:
    """settle_many writes each counter once for the batch (SQLite per (run, model, day), Redis's script per key
    and field): the counters, the usage series and every call's row come out as the same settles and releases
    landed one at a time, replays, releases after settles and late usage for an unresolved hold included."""

    def opened() -> Ledger:
        if store == "sqlite":  # its batch writes the series once, at the batch's time: a clock that stands
            return SQLiteLedger(Path(tempfile.mkdtemp(dir=tmp)) / "ledger.sqlite3", clock=lambda: 1_777_777_777.0)
        # Redis times each settle as it encodes it: a clock a minute on per reading gives each settle its own
        # point in the series, also inside a batch (as one that spans a minute)
        ticks = itertools.count()
        url = flushed(request.getfixturevalue("module_redis"))
        return RedisLedger(url, clock=lambda: 1_777_777_777.0 + 61 * next(ticks))

    @settings(max_examples=40, deadline=None)
    # charged whole, then late usage of 0: the minute nets to nothing (one by one once left a point there)
    @example(holds=[(_BATCH_RUNS[0], MODEL, 1)], events=[(0, "settle", None, None), (0, "settle", 0, None)])
    @given(
        holds=st.lists(
            st.tuples(st.sampled_from(_BATCH_RUNS), st.sampled_from(_BATCH_MODELS), st.integers(1, 5_000)),
            min_size=1,
            max_size=8,
        ),
        events=st.lists(
            st.tuples(
                st.integers(0, 7),
                st.sampled_from(["settle", "release"]),
                st.one_of(st.none(), st.integers(0, 9_000)),  # usage total (None: unknown, the whole hold)
                st.one_of(st.none(), st.integers(0, 50_000)),  # cost in micro-CNY (None: the reserved cost)
            ),
            max_size=14,
        ),
    )
    def check(holds: list[tuple[str, str, int]], events: list[tuple[int, str, int | None, int | None]]) -> None:
        ledger = opened()
        try:
            ids: dict[str, list[str]] = {side: [] for side in _SIDES}
            for run, model, reserve in holds:
                for side, day in _SIDES.items():
                    hold = request_for(reserve, run=f"{side}/{run}", model=model, day=day, cost=reserve * 3)
                    ids[side].append(ledger.reserve(hold, limits()).hold_id)
            batches = {
                side: [
                    Settle(ids[side][i % len(holds)], event, None if total is None else usage(total), 0.1, cost)
                    for i, event, total, cost in events
                ]
                for side in _SIDES
            }
            ledger.settle_many(batches["batched"])
            for settle in batches["one by one"]:  # each through the single transition (Redis: transition_one)
                if settle.event == "release":
                    ledger.release(settle.hold_id)
                else:
                    ledger.settle(settle.hold_id, settle.usage, latency_s=settle.latency_s, cost=settle.cost)
            seen = {}
            for side, day in _SIDES.items():
                keys = [key(f"{side}/{run}") for run in _BATCH_RUNS for key in (run_key, run_cost_key)]
                keys += [model_day_key(model, day) for model in _BATCH_MODELS]
                counters = ledger.counters(keys)
                series = [[total for _at, total in ledger.usage_series(model, day)] for model in _BATCH_MODELS]
                by_id = {r.id: (r.state, r.charged, r.charged_cost) for r in ledger.call_records()}
                owners = []  # Redis: each model-day's holds per process, a field gone at zero
                if isinstance(ledger, RedisLedger):
                    owners = [ledger._client.hgetall(ledger._keys.md_pids(day, m)) for m in _BATCH_MODELS]
                seen[side] = ([counters[k] for k in keys], series, [by_id[h] for h in ids[side]], owners)
            assert seen["batched"] == seen["one by one"]
        finally:
            ledger.close()

    with tempfile.TemporaryDirectory() as tmp:
        check()
