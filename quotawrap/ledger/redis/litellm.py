"""Sharing Redis with the LiteLLM limiter: its ``daily_usage`` keys and its balance snapshot.

Usage the limiter records under ``daily_usage:{date}:{model}:{hash}`` counts towards the
model-day's settled usage (ours is written there under our own hash by the transition scripts),
and its ``balance_at_sync`` / ``usage_at_sync`` keys are a snapshot like ours (docs/redis.md).
"""

from __future__ import annotations

import dataclasses
import time

from ...core import quota
from ...core.quota import Snapshot, beijing_day
from ...core.records import Record
from . import records
from .client import Client
from .keys import Keys
from .options import DAY_S

__all__ = ["THEIR_SNAPSHOT_TTL_S", "ForeignUsage", "pick_snapshot", "with_our_lag"]

THEIR_SNAPSHOT_TTL_S = 24 * 3600  # the LiteLLM sync thread writes its snapshot keys with 24h (seed §7.5)


def _glob_escape(text: str) -> str:
    """Redis MATCH patterns take a backslash before a special character."""
    return "".join(f"\\{ch}" if ch in "*?[]\\" else ch for ch in text)


class _Scan(Record):
    names: list[str]
    scanned_at: float
    last_sum: int = 0


class ForeignUsage:
    """The other writers' daily_usage keys of each model-day, re-scanned at most every refresh_ms."""

    def __init__(self, client: Client, keys: Keys) -> None:
        self._client = client
        self._keys = keys
        self._scans: dict[tuple[str, str], _Scan] = {}

    def names(self, model: str, day: str) -> list[str]:
        key = (model, day)
        now = time.monotonic()
        cached = self._scans.get(key)
        if cached is not None and now - cached.scanned_at < self._keys.options.foreign_refresh_ms / 1000:
            return cached.names
        own = self._keys.own_daily_usage(model, day)
        base = self._keys.daily_usage_base(model, day)
        found = self._client.retrying("scan", lambda: self._client.scan(f"{_glob_escape(base)}*"))
        # a model named "m:x" has keys under "m:*" too: the hash is the last part, without a colon
        names = sorted(name for name in found if name != own and ":" not in name[len(base) :])
        self._scans[key] = _Scan(names, now, cached.last_sum if cached is not None else 0)
        return names

    def total(self, model: str, day: str) -> int:
        """Their usage of a model-day now (and remembered as the last seen)."""
        names = self.names(model, day)
        total = sum(int(float(v)) for v in self._client.mget(names) if v) if names else 0
        self._scans[(model, day)].last_sum = total
        return total

    def last(self, model: str, day: str) -> int:
        """The last total seen (by ``total`` or a reserve script), for the usage series."""
        cached = self._scans.get((model, day))
        return cached.last_sum if cached is not None else 0

    def seen(self, model: str, day: str, total: int) -> None:
        cached = self._scans.get((model, day))
        if cached is not None:
            cached.last_sum = total


def pick_snapshot(
    ours: Snapshot | None, balance: str | None, usage: str | None, ttl_ms: int, now: float
) -> Snapshot | None:
    """Ours, unless the LiteLLM sync thread wrote a newer one (its age is told by its 24h TTL, which the server
    counts: ``now`` is the server's clock)."""
    if balance is None or usage is None:
        return ours
    synced_at = now - max(0.0, THEIR_SNAPSHOT_TTL_S - ttl_ms / 1000) if ttl_ms > 0 else now
    their_balance, at_sync = max(0, int(float(balance))), max(0, int(float(usage)))
    if ours is not None and (
        synced_at <= ours.synced_at + 5 or (their_balance, at_sync) == (ours.balance, ours.usage_at_sync)
    ):
        return ours
    # The LiteLLM record has no lag information: at face value, as that limiter does (v6), unless
    # our own snapshot says which lag to apply (with_our_lag).
    return Snapshot(their_balance, at_sync, at_sync, synced_at, beijing_day(synced_at), "litellm")


def with_our_lag(client: Client, keys: Keys, model: str, theirs: Snapshot, lag_s: float) -> Snapshot:
    """The limiter's snapshot with our lag treatment (the balance lag): its lagged usage read from our usage
    series, which counts its usage too, at its sync time, as quota.lagged_usage does for ours."""
    today = records.usage_series(client.hgetall(keys.md_series(theirs.day, model)))
    before = records.usage_series(client.hgetall(keys.md_series(beijing_day(theirs.synced_at - DAY_S), model)))
    lagged = quota.lagged_usage(theirs.synced_at, lag_s, theirs.usage_at_sync, today, before)
    return dataclasses.replace(theirs, lagged_usage=lagged, lag_s=lag_s)
