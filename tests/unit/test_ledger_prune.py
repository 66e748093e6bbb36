"""Ledger retention (issue 10 item 5): `prune` folds old calls into daily aggregates and deletes them,
reports over pruned days give the same totals, old ledgers migrate, and concurrent prunes count once."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from quotawrap.books.report import day_range, ledger_rows
from quotawrap.books.retention import AUTO_LEASE, auto_prune, cutoff_day
from quotawrap.core.quota import BEIJING, Counters, Limit
from quotawrap.core.usage import Usage
from quotawrap.ledger import HoldRequest
from quotawrap.ledger.sqlite.file import CALL_COLUMNS
from quotawrap.ledger.sqlite.ledger import SCHEMA_VERSION, SQLiteLedger
from tests.unit.conftest import FakeClock

MODELS = ("doubao-seed-1-6-250615", "deepseek-v4-flash")
GROUPINGS = ("day", "model", "tag:user", "session")


def _at(day: str, hour: int = 12) -> float:
    return datetime.fromisoformat(f"{day}T{hour:02d}:00").replace(tzinfo=BEIJING).timestamp()


def _refuse(_snapshot: object) -> list[Limit]:
    return [Limit("daily_cap", "model_day", 0)]


def _no_limits(_snapshot: object) -> list[Limit]:
    return []


def _seed(ledger: SQLiteLedger, clock: FakeClock, days: list[str], *, calls_per_day: int = 6) -> list[str]:
    """Calls of every outcome on each day, two models, two users; returns the ids of holds left open."""
    open_holds = []
    for d, day in enumerate(days):
        for n in range(calls_per_day):
            clock.now = _at(day, 1 + n)
            model = MODELS[n % 2]
            request = HoldRequest(
                run_id=f"run-{d}-{n % 3}",
                model=model,
                day=day,
                reserve=1000 + n,
                endpoint="chat",
                pid=os.getpid(),
                host="test-host",
                expires_at=clock.now + 10**9,
                tags={"user": f"u{n % 2}", "team": "a"} if n % 2 else {"team": "a", "user": "u0"},
            )
            kind = n % 6
            decision = ledger.reserve(request, _refuse if kind == 5 else _no_limits)
            if kind == 0:
                ledger.settle(
                    decision.hold_id, Usage(300 + d, 50, 350 + d, reasoning_tokens=7, cached_tokens=5), cost=900
                )
            elif kind == 1:
                ledger.settle(decision.hold_id, Usage(5000, 100, 5100), cost=1234)  # overshoot
            elif kind == 2 and d % 2:  # a video task's create: handed to the task's own row
                task = ledger.reserve(dataclasses.replace(request, hold_id=f"task-{d}-{n}"), _no_limits)
                ledger.release(decision.hold_id, handed_to=task.hold_id)
                ledger.settle(task.hold_id, Usage(0, 800, 800), cost=4000)
            elif kind == 2:
                ledger.release(decision.hold_id)
            elif kind == 3:  # unresolved, charged at the hold: its usage was implausible
                ledger.settle(decision.hold_id, None, anomaly="total_tokens -5 is not a plausible token count")
            elif kind == 4:
                open_holds.append(decision.hold_id)
        for run in range(3):
            ledger.start_run(_run(f"run-{d}-{run}", _at(day, 0)))
            ledger.end_run(f"run-{d}-{run}", 0, _at(day, 23))
    return open_holds


def _run(run_id: str, started_at: float) -> object:
    from quotawrap.ledger.base import RunRecord

    return RunRecord(run_id, started_at)


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[SQLiteLedger, FakeClock, list[str]]:
    clock = FakeClock(0.0)
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite3", clock=clock)
    days = ["2026-01-01", "2026-01-02", "2026-02-10", "2026-05-01"]
    return ledger, clock, _seed(ledger, clock, days)


def test_reports_are_the_same_before_and_after_pruning(seeded: tuple[SQLiteLedger, FakeClock, list[str]]) -> None:
    """Every grouping but session gives identical rows after pruning; session totals move to `(pruned)`."""
    ledger, _, _ = seeded
    before = {by: ledger_rows(ledger, by) for by in GROUPINGS}
    pruned_tokens = sum(r.charged for r in ledger.call_records() if r.day < "2026-03-01" and r.state != "held")
    result = ledger.prune("2026-03-01")
    assert result.days == ("2026-01-01", "2026-01-02", "2026-02-10")
    assert result.calls == 16  # 3 days x 6 rows, less the one open hold a day, plus 01-02's video task row
    after = {by: ledger_rows(ledger, by) for by in GROUPINGS}
    for by in ("day", "model", "tag:user"):
        assert after[by] == before[by], by
    sessions = {row["key"]: row for row in after["session"]}
    assert sessions["(pruned)"]["settled_tokens"] == pruned_tokens > 0
    assert sum(row["settled_tokens"] for row in after["session"]) == sum(
        row["settled_tokens"] for row in before["session"]
    )
    assert {r.day for r in ledger.call_records()} == {"2026-01-01", "2026-01-02", "2026-02-10", "2026-05-01"}
    assert all(r.state == "held" for r in ledger.call_records() if r.day < "2026-03-01")


def test_report_ranges_over_pruned_days(seeded: tuple[SQLiteLedger, FakeClock, list[str]]) -> None:
    """A --since/--until report over pruned days counts each whole day in exactly one of two adjacent ranges."""
    ledger, _, _ = seeded
    cut = _at("2026-01-02", 0)
    before = [ledger_rows(ledger, "day", since=None, until=cut), ledger_rows(ledger, "day", since=cut)]
    ledger.prune("2026-03-01")
    after = [ledger_rows(ledger, "day", since=None, until=cut), ledger_rows(ledger, "day", since=cut)]
    assert after == before
    assert [row["key"] for row in after[0]] == ["2026-01-01"]


def test_prune_again_adds_calls_that_finished_since(seeded: tuple[SQLiteLedger, FakeClock, list[str]]) -> None:
    """An open hold is never pruned; settled later and pruned again, it adds to its day's aggregate."""
    ledger, _, open_holds = seeded
    ledger.prune("2026-03-01")
    for hold_id in open_holds:
        ledger.settle(hold_id, Usage(10, 10, 20))
    before = ledger_rows(ledger, "model")
    assert ledger.prune("2026-03-01").calls == 3
    assert ledger_rows(ledger, "model") == before
    assert not [r for r in ledger.call_records() if r.day < "2026-03-01"]


def test_dry_run_changes_nothing(seeded: tuple[SQLiteLedger, FakeClock, list[str]]) -> None:
    """--dry-run counts what would go and leaves calls, runs and aggregates as they were."""
    ledger, _, _ = seeded
    records = ledger.call_records()
    dry = ledger.prune("2026-03-01", dry_run=True)
    assert (dry.calls, dry.dry_run, len(dry.days)) == (16, True, 3)
    assert ledger.call_records() == records
    assert ledger.aggregates() == []
    real = ledger.prune("2026-03-01")
    assert (real.calls, real.aggregate_rows, real.series_rows) == (dry.calls, dry.aggregate_rows, dry.series_rows)


def test_runs_without_calls_are_pruned_with_their_counters(seeded: tuple[SQLiteLedger, FakeClock, list[str]]) -> None:
    """A finished run of a pruned day goes with its run counters, a run that still owns an open hold stays."""
    ledger, _, _ = seeded
    result = ledger.prune("2026-03-01")
    kept = {run.run_id for run in ledger.runs()}
    assert "run-0-1" in kept  # owns the day's open hold (call 4)
    assert "run-0-0" not in kept and "run-3-0" in kept
    assert result.runs == 6
    assert ledger.counters(["run:run-0-0"])["run:run-0-0"].settled == 0
    assert ledger.usage_series(MODELS[0], "2026-01-01") == []
    assert ledger.usage_series(MODELS[0], "2026-05-01") != []


def test_concurrent_prunes_count_every_call_once(seeded: tuple[SQLiteLedger, FakeClock, list[str]]) -> None:
    """Four threads (each its own connection) prune at once: the aggregates hold each call exactly once."""
    ledger, _, _ = seeded
    before = ledger_rows(ledger, "day")
    results = []
    barrier = threading.Barrier(4)

    def prune() -> None:
        barrier.wait()
        results.append(ledger.prune("2026-03-01"))

    threads = [threading.Thread(target=prune) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(result.calls for result in results) == 16
    assert ledger_rows(ledger, "day") == before


def test_version_2_ledger_is_migrated(tmp_path: Path) -> None:
    """A ledger of schema 2 (before aggregates) opens as the current schema with its calls intact and prunes."""
    path = tmp_path / "old.sqlite3"
    clock = FakeClock(0.0)
    ledger = SQLiteLedger(path, clock=clock)
    _seed(ledger, clock, ["2026-01-01"])
    ledger.close()
    conn = sqlite3.connect(path)
    _back_to_version_3(conn)
    conn.execute("DROP TABLE call_aggregates")
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema'")
    conn.commit()
    conn.close()
    reopened = SQLiteLedger(path)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0] == SCHEMA_VERSION == "7"
    conn.close()
    before = ledger_rows(reopened, "model")
    assert reopened.prune("2026-02-01").calls == 5
    assert ledger_rows(reopened, "model") == before


# What schema 6 counted in flight beside the settled: the reserves a scope's holds took (what is in holds).
_IN_FLIGHT_V6 = {
    "'run:' || run_id": "reserved",
    "'cost:' || run_id": "reserved_cost",
    "'md:' || day || ':' || model": "reserved",
}


def _back_to_version_6(conn: sqlite3.Connection) -> None:
    """Make a current ledger the schema 6 one it grew from: the counters kept what was in flight, which each
    reserve added (making the row) and each transition out of 'held' took off."""
    conn.execute("ALTER TABLE counters ADD COLUMN in_flight INTEGER NOT NULL DEFAULT 0")
    for key, column in _IN_FLIGHT_V6.items():
        conn.execute(
            f"INSERT INTO counters (key, settled, in_flight) SELECT {key}, 0, SUM({column}) FROM holds GROUP BY 1"
            " ON CONFLICT (key) DO UPDATE SET in_flight = excluded.in_flight"
        )
    conn.execute("UPDATE meta SET value = '6' WHERE key = 'schema'")


def _back_to_version_5(conn: sqlite3.Connection) -> None:
    """Make a current ledger the schema 5 one it grew from: the calls in flight kept in calls, indexed."""
    _back_to_version_6(conn)
    columns = ", ".join(CALL_COLUMNS)
    conn.execute(f"INSERT INTO calls ({columns}) SELECT {columns} FROM holds")
    conn.execute("DROP TABLE holds")
    conn.execute("CREATE INDEX calls_open ON calls (state, expires_at) WHERE state = 'held'")
    conn.execute("UPDATE meta SET value = '5' WHERE key = 'schema'")


def _back_to_version_3(conn: sqlite3.Connection) -> None:
    """Make a current ledger the schema 3 one (before usage_anomaly and handed_to) it grew from."""
    _back_to_version_5(conn)
    for table, column in (("calls", "usage_anomaly"), ("calls", "handed_to"), ("call_aggregates", "anomalous_calls")):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema'")


def test_version_3_ledger_is_migrated(tmp_path: Path) -> None:
    """A schema 3 ledger (aggregates without anomalies) opens as the current schema, its pruned days intact,
    and records an implausible usage and a hand-over in the new columns."""
    path = tmp_path / "old.sqlite3"
    clock = FakeClock(0.0)
    ledger = SQLiteLedger(path, clock=clock)
    _seed(ledger, clock, ["2026-01-01", "2026-03-01"])
    ledger.prune("2026-02-01")
    ledger.close()
    conn = sqlite3.connect(path)
    _back_to_version_3(conn)
    conn.commit()
    conn.close()
    reopened = SQLiteLedger(path, clock=clock)
    before = ledger_rows(reopened, "model")
    assert before and all(row["anomalous_calls"] == 0 for row in before)
    [call] = [r for r in reopened.call_records() if r.day == "2026-03-01"][:1]
    assert call.usage_anomaly is None and call.handed_to is None
    held = reopened.reserve(
        HoldRequest("run-x", "m", "2026-03-01", 10, "/chat", os.getpid(), "h", time.time() + 60), lambda s: ()
    )
    reopened.settle(held.hold_id, None, anomaly="prompt_tokens -1 is not a plausible token count")
    assert reopened.run_totals("run-x").models["m"].anomalous_calls == 1


def test_version_5_ledger_is_migrated(tmp_path: Path) -> None:
    """A schema 5 ledger (calls in flight kept in calls) opens with them moved to holds, every record as it
    was; they settle, reclaim and prune as before, and no row of calls is left 'held'."""
    path = tmp_path / "old.sqlite3"
    clock = FakeClock(0.0)
    ledger = SQLiteLedger(path, clock=clock)
    open_holds = _seed(ledger, clock, ["2026-01-01", "2026-03-01"])
    records, counters = ledger.call_records(), ledger.counters(["md:2026-03-01:" + MODELS[0]])
    ledger.close()
    conn = sqlite3.connect(path)
    _back_to_version_5(conn)
    conn.commit()
    assert conn.execute("SELECT COUNT(*) FROM calls WHERE state = 'held'").fetchone() == (len(open_holds),) != (0,)
    conn.close()
    reopened = SQLiteLedger(path, clock=clock)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (SCHEMA_VERSION,)
    assert sorted(id_ for (id_,) in conn.execute("SELECT id FROM holds")) == sorted(open_holds)
    assert conn.execute("SELECT COUNT(*) FROM calls WHERE state = 'held'").fetchone() == (0,)
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'calls_open'").fetchall() == []
    conn.close()
    assert reopened.call_records() == records
    assert reopened.counters(["md:2026-03-01:" + MODELS[0]]) == counters
    assert reopened.prune("2026-02-01").calls > 0
    assert {r.id for r in reopened.call_records() if r.state == "held"} == set(open_holds)
    settled, *others = open_holds
    reopened.settle(settled, Usage(1, 1, 2))
    assert reopened.reclaim_orphans(now=clock.now + 2 * 10**9) == len(others)
    states = {r.id: r.state for r in reopened.call_records()}
    assert states[settled] == "settled" and {states[hold] for hold in others} == {"unresolved"}


def test_version_6_ledger_is_migrated(tmp_path: Path) -> None:
    """A schema 6 ledger (what is in flight counted beside the settled) opens without that column: every scope
    reads as before, the in flight summed from holds; a hold then settles, and another is reclaimed, exactly."""
    path = tmp_path / "old.sqlite3"
    clock = FakeClock(0.0)
    ledger = SQLiteLedger(path, clock=clock)
    open_holds = _seed(ledger, clock, ["2026-01-01", "2026-03-01"])
    keys = [
        *(f"md:{day}:{model}" for day in ("2026-01-01", "2026-03-01") for model in MODELS),
        *(f"{kind}:run-{d}-{n}" for kind in ("run", "cost") for d in (0, 1) for n in range(3)),
    ]
    counters, records = ledger.counters(keys), ledger.call_records()
    assert any(c.in_flight for c in counters.values()) and any(c.settled for c in counters.values())
    ledger.close()
    conn = sqlite3.connect(path)
    _back_to_version_6(conn)
    conn.commit()
    assert (
        conn.execute("SELECT SUM(in_flight) FROM counters").fetchone()[0]
        == sum(c.in_flight for c in counters.values())
        > 0
    )
    conn.close()
    reopened = SQLiteLedger(path, clock=clock)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (SCHEMA_VERSION,)
    assert [row[1] for row in conn.execute("PRAGMA table_info(counters)")] == ["key", "settled"]
    conn.close()
    assert reopened.counters(keys) == counters
    assert reopened.call_records() == records
    settled, *others = open_holds
    [held] = [r for r in records if r.id == settled]
    key = f"md:{held.day}:{held.model}"
    before = reopened.counters([key])[key]
    reopened.settle(settled, Usage(1, 1, 2))
    assert reopened.counters([key])[key] == Counters(before.settled + 2, before.in_flight - held.reserved)
    assert reopened.reclaim_orphans(now=clock.now + 2 * 10**9) == len(others)
    assert all(c.in_flight == 0 for c in reopened.counters(keys).values())


def test_auto_prune_runs_at_most_once_a_day(seeded: tuple[SQLiteLedger, FakeClock, list[str]]) -> None:
    """The automatic bound prunes by the retention setting, then not again within 24 hours, on any process."""
    ledger, _, _ = seeded
    now = _at("2026-05-01", 12)
    assert auto_prune(ledger, "off", now) is None
    first = auto_prune(ledger, "30d", now)
    assert first is not None and first.days == ("2026-01-01", "2026-01-02", "2026-02-10")
    assert auto_prune(ledger, "30d", now + 3600) is None
    assert not ledger.try_lease(AUTO_LEASE, "someone", 60, now + 3600)
    later = auto_prune(ledger, "30d", now + 25 * 3600)
    assert later is not None and later.days == ()


def test_the_cutoff_is_the_beijing_day_of_now_less_the_duration() -> None:
    assert cutoff_day(_at("2026-05-01", 10), 12 * 3600) == "2026-04-30"
    assert cutoff_day(_at("2026-05-01", 13), 12 * 3600) == "2026-05-01"


def test_day_range_counts_days_that_start_in_the_range() -> None:
    """A bound at midnight starts its day; a bound inside a day starts from the next one."""
    assert day_range(_at("2026-01-02", 0), _at("2026-01-05", 0)) == ("2026-01-02", "2026-01-05")
    assert day_range(_at("2026-01-02", 5), None) == ("2026-01-03", None)
    assert day_range(None, None) == (None, None)


@pytest.mark.redis
def test_redis_prune_explains_why_nothing_is_needed() -> None:
    """On Redis, prune deletes nothing and says in one line what already bounds the store (key TTLs,
    the capped audit stream); a held call is untouched and there are no aggregates to read."""
    from quotawrap.ledger import open_ledger
    from tests.redis_server import flushed, session_url

    with session_url() as url:
        ledger = open_ledger(flushed(url))
        try:
            request = HoldRequest("run-r", MODELS[0], "2026-01-01", 10, "chat", os.getpid(), "h", time.time() + 60)
            decision = ledger.reserve(request, _no_limits)
            result = ledger.prune("2026-03-01")
            assert result.note is not None and "\n" not in result.note
            assert "expire" in result.note and "audit_max" in result.note
            assert (result.calls, result.days) == (0, ())
            assert [r.id for r in ledger.call_records(run_id="run-r")] == [decision.hold_id]
            assert ledger.aggregates() == []
        finally:
            ledger.close()
