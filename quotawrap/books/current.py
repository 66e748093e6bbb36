"""Stand-in for the read side's one data function (``status_snapshot`` and ``current_status`` of
:mod:`quotawrap.books.status`, coming with the dashboard): the keys ``/metrics`` and the alerts read, in its
shape. Once that lands, import those two from there and delete this module."""

from __future__ import annotations

from typing import Any

from ..config.settings import Settings
from ..ledger import Ledger

__all__ = ["current_status", "status_snapshot"]


def status_snapshot(ledger: Ledger, settings: Settings, now: float, *, events_dir: str | None = None) -> dict[str, Any]:
    from ..admission.allowance import HISTORY_S
    from ..core import quota
    from ..support.events import waiting_now
    from .report import aggregate
    from .status import model_status, unguarded_now

    day = quota.beijing_day(now)
    waiting = waiting_now(events_dir) if events_dir is not None else {}
    for model, count in ledger.waiting(now).items():
        waiting[model] = max(count, waiting.get(model, 0))
    rows = model_status(ledger, settings, now, waiting=waiting)
    today = [r for r in ledger.call_records(since=now - HISTORY_S) if r.day == day]
    refused = {row["key"]: row["blocked_calls"] for row in aggregate(today, "model")}
    for row in rows:
        row["refused"] = refused.get(row["model"], 0)
        stored = ledger.snapshot(row["model"])
        snapshot = stored if stored is not None and stored.day == day else None
        limits = quota.model_day_limits(snapshot, settings.quota, today=day)
        row["limits"] = {"walls": [{"name": w.name, "cap": w.cap} for w in limits if w.kind == "wall"]}
    return {
        "now": now,
        "day": day,
        "models": rows,
        "by_tag": {key: aggregate(today, f"tag:{key}")[:10] for key in ("user", "team")},
        "budgets": [],
        "unguarded_processes": unguarded_now(events_dir) if events_dir is not None else [],
    }


def current_status(ledger: Ledger, settings: Settings, *, events_dir: str | None = None) -> dict[str, Any]:
    from ..ledger.base import ledger_clock

    now = ledger_clock(ledger)()
    ledger.reclaim_orphans(now)
    return status_snapshot(ledger, settings, now, events_dir=events_dir)
