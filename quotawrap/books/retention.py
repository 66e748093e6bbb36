"""Ledger retention: the cutoff day of a duration, and the automatic daily prune.

Days are pruned whole: a day goes once it has entirely ended more than the duration ago (Beijing
days, like the caps), so a report's day is either all calls or all aggregate, never half of each.
"""

from __future__ import annotations

import os

from ..core import quota
from ..core.durations import parse_retention
from ..core.errors import QuotawrapError
from ..ledger.base import PruneResult
from ..ledger.interface import Ledger
from ..ledger.sqlite.runs import AUTO_PRUNE_LEASE

__all__ = ["AUTO_LEASE", "auto_prune", "cutoff_day", "describe"]

AUTO_LEASE = AUTO_PRUNE_LEASE  # taken for a day and never released: the automatic prune runs at most daily


def cutoff_day(now: float, older_than_s: float) -> str:
    """The first day kept: every day before it ended at least ``older_than_s`` ago."""
    return quota.beijing_day(now - older_than_s)


def describe(result: PruneResult) -> str:
    """One line for the CLI."""
    if result.note:
        return result.note
    verb = "would prune" if result.dry_run else "pruned"
    if not result.days and not result.runs:
        return f"nothing to prune before {result.before_day}"
    span = f"{result.days[0]} .. {result.days[-1]}" if result.days else "no day"
    return (
        f"{verb} {result.calls:,} call(s) on {len(result.days)} day(s) ({span}) into {result.aggregate_rows:,}"
        f" daily aggregate row(s), {result.runs:,} finished run(s), {result.series_rows:,} usage-series and"
        f" {result.sync_rows:,} sync-history row(s); kept everything from {result.before_day}"
    )


def auto_prune(ledger: Ledger, retention: str, now: float) -> PruneResult | None:
    """Prune by the ``retention`` setting unless some process did so in the last 24 h (any host of
    the store: the lease lives in the ledger). None when off or already done."""
    older_than = parse_retention(retention)  # checked with the settings, before the run started
    if older_than is None:
        return None
    try:
        # a random holder, as uuid4().hex was: importing uuid (and its platform) slowed every run's end
        if not ledger.try_lease(AUTO_LEASE, os.urandom(16).hex(), quota.DAY_S, now):
            return None
    except QuotawrapError:
        return None  # a bound that can wait a day must never fail the run it follows
    return ledger.prune(cutoff_day(now, older_than))
