"""The SQLite ledger's read side, as functions over a connection: the usage series, the sync history,
packages, known models, a run's totals, its calls as CallRecords (the rows of holds, in flight, and calls,
final, read as one), runs and daily aggregates. :class:`~quotawrap.ledger.sqlite.ledger.SQLiteLedger`
delegates to it.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from ...core.quota import Package
from ..base import REPORT_SUMS, CallRecord, DayAggregate, ModelTotals, RunRecord, RunTotals
from .file import EVERY_CALL
from .runs import KNOWN_MODELS, RUN_TOTALS, RUNS_BETWEEN

__all__ = [
    "aggregates",
    "call_records",
    "known_models",
    "packages",
    "run_totals",
    "runs",
    "sync_history",
    "usage_series",
]


def usage_series(conn: sqlite3.Connection, model: str, day: str) -> list[tuple[float, int]]:
    rows = conn.execute(
        "SELECT minute, cumulative FROM usage_series WHERE model = ? AND day = ? ORDER BY minute", (model, day)
    ).fetchall()
    # A minute whose settles netted to nothing (charged whole, then its late usage came back) repeats
    # the total before it: one by one it leaves such a point, batched it leaves none, and it says nothing.
    series: list[tuple[float, int]] = []
    previous = 0
    for minute, cumulative in rows:
        if cumulative != previous:
            series.append((minute * 60.0, cumulative))
        previous = cumulative
    return series


def sync_history(conn: sqlite3.Connection, model: str, day: str) -> list[tuple[float, int]]:
    rows = conn.execute(
        "SELECT synced_at, balance FROM sync_history WHERE model = ? AND day = ? ORDER BY synced_at", (model, day)
    ).fetchall()
    return [(t, balance) for t, balance in rows]


def packages(conn: sqlite3.Connection, model: str) -> list[Package]:
    row = conn.execute("SELECT packages FROM packages WHERE model = ?", (model,)).fetchone()
    return [Package(model, int(available), float(expires)) for available, expires in json.loads(row[0])] if row else []


def known_models(conn: sqlite3.Connection) -> list[str]:
    """Every model the ledger has seen a call or a balance for."""
    return [model for (model,) in conn.execute(KNOWN_MODELS).fetchall()]


def run_totals(conn: sqlite3.Connection, run_id: str) -> RunTotals:
    rows = conn.execute(RUN_TOTALS, (run_id,)).fetchall()
    return RunTotals(run_id, {row[0]: ModelTotals(*(int(v or 0) for v in row[1:])) for row in rows})


# The calls table's columns named as CallRecord's fields.
_RECORD_FIELDS = (
    *("id", "run_id", "model", "day", "endpoint", "state", "reserved", "charged", "reserved_cost", "charged_cost"),
    *("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "overshoot", "would_block"),
    *("blocked_by", "key_fingerprint", "tags", "started_at", "ended_at", "latency_s", "pid", "host"),
    *("usage_anomaly", "handed_to"),
)
_RECORDS = ", ".join(_RECORD_FIELDS)


def _record(row: Sequence[Any]) -> CallRecord:
    values = dict(zip(_RECORD_FIELDS, row, strict=True))
    values["overshoot"], values["would_block"] = bool(values["overshoot"]), bool(values["would_block"])
    values["tags"] = json.loads(values["tags"]) if values["tags"] else {}
    return CallRecord(**values)


def call_records(
    conn: sqlite3.Connection, *, since: float | None, until: float | None, run_id: str | None
) -> list[CallRecord]:
    """Every call started in [since, until) of ``run_id`` (None: no bound), in the order they started."""
    where, params = ["1 = 1"], []
    for clause, value in (("started_at >= ?", since), ("started_at < ?", until), ("run_id = ?", run_id)):
        if value is not None:
            where.append(clause)
            params.append(value)
    sql = f"SELECT {_RECORDS} FROM {EVERY_CALL} WHERE {' AND '.join(where)} ORDER BY started_at"
    return [_record(row) for row in conn.execute(sql, params).fetchall()]


def runs(conn: sqlite3.Connection, *, since: float | None, until: float | None) -> list[RunRecord]:
    bounds = (since if since is not None else float("-inf"), until if until is not None else float("inf"))
    rows = conn.execute(RUNS_BETWEEN, bounds).fetchall()
    return [RunRecord(r[0], r[1], r[2], r[3] or "", json.loads(r[4]) if r[4] else {}, r[5]) for r in rows]


def aggregates(conn: sqlite3.Connection, *, since_day: str | None, until_day: str | None) -> list[DayAggregate]:
    """The daily aggregates prune folded calls into, of the days in [since_day, until_day) (None: no bound)."""
    rows = conn.execute(
        f"SELECT day, model, tags, {', '.join(REPORT_SUMS)} FROM call_aggregates WHERE day >= ? AND day < ?"
        " ORDER BY day, model, tags",
        (since_day or "", until_day or "\uffff"),
    ).fetchall()
    return [DayAggregate(day, model, json.loads(tags), *sums) for day, model, tags, *sums in rows]
