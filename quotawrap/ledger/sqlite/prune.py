"""SQLite retention: fold old calls into daily aggregates, then delete them.

One Beijing day per ``BEGIN IMMEDIATE`` transaction: the aggregation reads and the deletes happen
under the write lock, so two prunes at once (or a prune and guarded calls) never count a call twice
or lose one, and a large backlog never holds the lock for longer than one day's rows. Open holds (the
holds table) are never pruned: they still carry in-flight tokens and will be settled or reclaimed.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

from ..base import REPORT_SUMS, PruneResult

__all__ = ["SUMS", "aggregate_calls", "prune_sqlite"]

# the columns of call_aggregates after (day, model, tags)
SUMS = REPORT_SUMS

_CALL_COLUMNS = (
    "model, tags, state, overshoot, charged, charged_cost, usage_anomaly, handed_to, prompt_tokens,"
    " completion_tokens, reasoning_tokens, cached_tokens"
)


def _canonical(tags: str | None) -> str:
    """The same tag set always makes the same key, whatever order the call row stored it in."""
    return json.dumps(json.loads(tags), sort_keys=True, separators=(",", ":")) if tags else "{}"


def aggregate_calls(rows: Iterable[Sequence[Any]]) -> dict[tuple[str, str], list[int]]:
    """(model, canonical tags) -> sums in ``SUMS`` order, from rows of ``_CALL_COLUMNS``.

    The same counting as ``audit.aggregate`` so a report reads the same from calls or aggregates."""
    groups: dict[tuple[str, str], list[int]] = {}
    for model, tags, state, overshoot, charged, cost, anomaly, handed_to, *kinds in rows:
        sums = groups.setdefault((model, _canonical(tags)), [0] * len(SUMS))
        if handed_to is not None:  # a video task's create: the task's own row is the call
            continue
        if state == "blocked":
            sums[1] += 1
            continue
        sums[0] += 1
        sums[2] += charged
        sums[3] += cost
        sums[4] += state == "unresolved"
        sums[5] += state == "settled" and bool(overshoot)
        sums[6] += state == "released"
        for index, value in enumerate(kinds, start=7):
            sums[index] += value or 0
        sums[11] += anomaly is not None
    return groups


def _prune_day(conn: sqlite3.Connection, day: str, dry_run: bool) -> tuple[int, int, int, int]:
    """(calls, aggregate rows, series rows, sync rows) of one day, deleted unless ``dry_run``."""
    rows = conn.execute(f"SELECT {_CALL_COLUMNS} FROM calls WHERE day = ?", (day,)).fetchall()
    groups = aggregate_calls(rows)
    series = conn.execute("SELECT COUNT(*) FROM usage_series WHERE day = ?", (day,)).fetchone()[0]
    syncs = conn.execute("SELECT COUNT(*) FROM sync_history WHERE day = ?", (day,)).fetchone()[0]
    if not dry_run:
        marks = ", ".join("?" * len(SUMS))
        updates = ", ".join(f"{name} = {name} + excluded.{name}" for name in SUMS)
        for (model, tags), sums in groups.items():
            # adds, not replaces: a day may be pruned again once a call that was open then has finished
            conn.execute(
                f"INSERT INTO call_aggregates (day, model, tags, {', '.join(SUMS)}) VALUES (?, ?, ?, {marks})"
                f" ON CONFLICT (day, model, tags) DO UPDATE SET {updates}",
                (day, model, tags, *sums),
            )
        # the budget scopes of its finished calls go with them (a hold in flight keeps its own)
        conn.execute(
            "DELETE FROM hold_budgets WHERE hold_id IN (SELECT id FROM calls WHERE day = ?)"
            " AND hold_id NOT IN (SELECT id FROM holds)",
            (day,),
        )
        conn.execute("DELETE FROM calls WHERE day = ?", (day,))
        conn.execute("DELETE FROM usage_series WHERE day = ?", (day,))
        conn.execute("DELETE FROM sync_history WHERE day = ?", (day,))
    return len(rows), len(groups), series, syncs


def _prune_runs(conn: sqlite3.Connection, before_ts: float, dry_run: bool) -> int:
    """Runs that started before the cutoff and have no call left, with their run counters."""
    orphans = [
        run_id
        for (run_id,) in conn.execute(
            "SELECT run_id FROM runs WHERE started_at < ? AND ended_at IS NOT NULL"
            " AND NOT EXISTS (SELECT 1 FROM calls WHERE calls.run_id = runs.run_id)"
            " AND NOT EXISTS (SELECT 1 FROM holds WHERE holds.run_id = runs.run_id)",
            (before_ts,),
        )
    ]
    if orphans and not dry_run:
        from ..scopes import run_cost_key, run_key

        for run_id in orphans:
            conn.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            conn.execute("DELETE FROM counters WHERE key IN (?, ?)", (run_key(run_id), run_cost_key(run_id)))
    return len(orphans)


def prune_sqlite(ledger: Any, before_day: str, before_ts: float, *, dry_run: bool) -> PruneResult:
    """``SQLiteLedger.prune``: ``before_ts`` is the start of ``before_day`` (the runs' cutoff)."""
    with ledger._errors("prune"):
        days = [
            day
            for (day,) in ledger._conn().execute(
                "SELECT DISTINCT day FROM calls WHERE day < ?"
                " UNION SELECT DISTINCT day FROM usage_series WHERE day < ?"
                " UNION SELECT DISTINCT day FROM sync_history WHERE day < ? ORDER BY 1",
                (before_day, before_day, before_day),
            )
        ]
    calls = aggregate_rows = series = syncs = 0
    for day in days:
        with ledger._write("prune") as conn:
            counted = _prune_day(conn, day, dry_run)
        calls, aggregate_rows = calls + counted[0], aggregate_rows + counted[1]
        series, syncs = series + counted[2], syncs + counted[3]
    with ledger._write("prune") as conn:
        runs = _prune_runs(conn, before_ts, dry_run)
    return PruneResult(before_day, calls, tuple(days), aggregate_rows, runs, series, syncs, dry_run)
