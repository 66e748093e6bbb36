"""One read of everything the read side shows: ``status --json``, the dashboard and ``/metrics`` all call
:func:`status_snapshot`, so no view computes a figure of its own."""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import quota
from ..ledger import Ledger
from ..settings import Settings
from ..status import model_status, session_rows, unguarded_now

__all__ = ["TAG_KEYS", "TOP_ROWS", "status_snapshot"]

#: The tags whose values the spend breakdown shows (automatic ``user``, and ``team`` when runs set it).
TAG_KEYS = ("user", "team")
#: Rows kept per breakdown: the largest spenders; the rest are summed into one ``(others)`` row.
TOP_ROWS = 10


def status_snapshot(ledger: Ledger, settings: Settings, now: float, *, events_dir: str | None = None) -> dict[str, Any]:
    """The state of the store at ``now`` (the ledger's clock), as plain JSON values.

    ``events_dir``: where this host's runs keep their events logs (waits for room, processes outside the
    guard); None reads the ledger's lines alone.

    Shape (every token figure an int; times are Unix seconds):

    - ``now``, ``day`` (Beijing), ``seconds_to_reset``;
    - ``models``: one row per model, exactly ``status --json``'s (``model_status``), plus ``refused`` (today's
      refused calls) and ``limits`` ({``v6``, ``lag_aware``, ``daily_cap``, ``walls``: [{name, cap, detail}]});
    - ``curves``: per model, ``usage`` [[minute, cumulative settled tokens]] of today and ``syncs``
      [[synced_at, balance]] of today;
    - ``waiting`` and ``refused``: per model, calls waiting for room now and calls refused today;
    - ``by_tag``: per key of :data:`TAG_KEYS`, today's rows {key, calls, blocked_calls, settled_tokens,
      cost_micro_cny} by the tag's value;
    - ``sessions``: today's runs (``session_rows``);
    - ``budgets``: [{name, used, in_flight, limit, unit, resets_at}] (empty until budgets are kept);
    - ``unguarded_processes``: processes of live runs outside the guard (``unguarded_now``).
    """
    from ..audit import aggregate
    from ..waiting import waiting_now

    day = quota.beijing_day(now)
    waiting = waiting_now(events_dir) if events_dir is not None else {}
    for model, count in ledger.waiting(now).items():  # the ledger's lines: every run and host
        waiting[model] = max(count, waiting.get(model, 0))
    rows = model_status(ledger, settings, now, waiting=waiting)
    start = quota.beijing_day_start(now)
    today = [record for record in ledger.call_records(since=start) if record.day == day]
    refused = {row["key"]: row["blocked_calls"] for row in aggregate(today, "model") if row["blocked_calls"]}
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for row in rows:
        row["refused"] = refused.get(row["model"], 0)
        row["limits"] = _limits(ledger, settings.quota, row["model"], day)
        curves[row["model"]] = {
            "usage": [[t, used] for t, used in ledger.usage_series(row["model"], day)],
            "syncs": [[t, balance] for t, balance in ledger.sync_history(row["model"], day)],
        }
    return {
        "now": now,
        "day": day,
        "seconds_to_reset": round(quota.seconds_to_beijing_midnight(now), 1),
        "models": rows,
        "curves": curves,
        "waiting": {model: count for model, count in sorted(waiting.items()) if count},
        "refused": refused,
        "by_tag": {key: _top(aggregate(today, f"tag:{key}")) for key in TAG_KEYS},
        "sessions": session_rows(ledger, start, None),
        "budgets": [],
        "unguarded_processes": unguarded_now(events_dir) if events_dir is not None else [],
    }


def _limits(ledger: Ledger, settings: quota.QuotaSettings, model: str, day: str) -> dict[str, Any]:
    """Today's limits of one model: v6's (the balance taken as settled at the sync), the lag-aware one the
    guard enforces, and the soft-evict walls."""
    stored = ledger.snapshot(model)
    snapshot = stored if stored is not None and stored.day == day else None
    v6, _ = quota.effective_limit(snapshot, dataclasses.replace(settings, balance_lag_s=0.0), today=day)
    limits = quota.model_day_limits(snapshot, settings, today=day)
    return {
        "v6": v6,
        "lag_aware": next(limit.cap for limit in limits if limit.kind == "hold"),
        "daily_cap": settings.daily_cap,
        "walls": [{"name": w.name, "cap": w.cap, "detail": w.detail} for w in limits if w.kind == "wall"],
    }


_SUMS = ("calls", "blocked_calls", "settled_tokens", "cost_micro_cny")


def _top(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The :data:`TOP_ROWS` largest rows (``aggregate`` sorts them), the rest summed as ``(others)``."""
    kept = [{"key": row["key"], **{name: row[name] for name in _SUMS}} for row in rows[:TOP_ROWS]]
    rest = rows[TOP_ROWS:]
    if rest:
        kept.append({"key": "(others)", **{name: sum(row[name] for row in rest) for name in _SUMS}})
    return kept
