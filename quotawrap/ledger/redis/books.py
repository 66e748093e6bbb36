"""The Redis ledger's books and read side: runs, call records, run totals, packages, the sync history and the
usage series (and why Redis has nothing to prune or aggregate), as functions of the client and the key names.

None of it is on the reserve/settle path; :class:`~quotawrap.ledger.redis.ledger.RedisLedger` delegates to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

from ...core.quota import Package
from ..base import CallRecord, DayAggregate, ModelTotals, PruneResult, RunRecord, RunTotals
from ..reasoning import reasoning_samples
from . import records
from .client import Client, as_int
from .keys import Keys
from .options import RedisOptions
from .persistence import warn_without_persistence

__all__ = [
    "MAX_RUNS_INDEXED",
    "aggregates",
    "call_records",
    "end_run",
    "packages",
    "prune",
    "put_packages",
    "reasoning_history",
    "run_totals",
    "runs",
    "start_run",
    "sync_history",
    "usage_series",
]

MAX_RUNS_INDEXED = 10_000


def usage_series(client: Client, keys: Keys, model: str, day: str) -> list[tuple[float, int]]:
    return records.usage_series(client.retrying("read", lambda: client.hgetall(keys.md_series(day, model))))


def sync_history(client: Client, keys: Keys, model: str, day: str) -> list[tuple[float, int]]:
    raw = client.retrying("read", lambda: client.lrange(keys.md_sync(day, model)))
    return sorted(records.decode_sync_entry(entry) for entry in raw)


def run_totals(client: Client, keys: Keys, run_id: str) -> RunTotals:
    members = client.retrying("read", lambda: client.smembers(keys.run_model_days(run_id)))
    models: dict[str, ModelTotals] = {}
    for member in members:
        day, model = records.parse_model_day_member(member)
        key = keys.md_run_totals(day, model, run_id)
        raw = client.retrying("read", partial(client.hgetall, key))
        if not raw:
            continue
        totals = ModelTotals(**{name: as_int(raw.get(name)) for name in ModelTotals.__dataclass_fields__})
        models.setdefault(model, ModelTotals()).add(totals)
    return RunTotals(run_id, dict(sorted(models.items())))


def reasoning_history(client: Client, keys: Keys, model: str, *, since: float, limit: int) -> list[int]:
    return reasoning_samples(call_records(client, keys, since=since), limit).get(model, [])  # capped streams: few


def call_records(
    client: Client, keys: Keys, *, since: float | None = None, until: float | None = None, run_id: str | None = None
) -> list[CallRecord]:
    """What Redis still keeps: the capped audit streams and the open holds of the indexed model-days."""
    latest: dict[str, CallRecord] = {}
    for member in client.retrying("read", lambda: client.zrange(keys.active())):
        day, model = records.parse_model_day_member(member)
        audit, open_key = keys.md_audit(day, model), keys.md_open(day, model)
        # oldest first: a later entry of the same call replaces an earlier one
        for entry in client.retrying("read", partial(client.xrange, audit)):
            latest[entry["id"]] = records.call_record(model, day, entry)
        open_ids = client.retrying("read", partial(client.zrange, open_key))
        hold_keys = [keys.hold(day, model, hold_id) for hold_id in open_ids]
        rows = client.retrying("read", partial(client.hgetall_many, hold_keys))
        for hold_id, row in zip(open_ids, rows, strict=True):
            if row.get("state") == "held":
                latest[hold_id] = records.call_record(model, day, {**row, "id": hold_id, "ended": "", "latency": ""})
    found = [
        r
        for r in latest.values()
        if (since is None or r.started_at >= since)
        and (until is None or r.started_at < until)
        and (run_id is None or r.run_id == run_id)
    ]
    return sorted(found, key=lambda r: r.started_at)


def start_run(client: Client, keys: Keys, options: RedisOptions, run: RunRecord, now: float) -> None:
    """``now``: the ledger's clock, which the index of runs is trimmed by."""
    runs_key = keys.runs()

    def write() -> None:
        client.set(keys.run_info(run.run_id), records.encode_run(run), ex=options.run_ttl_s)
        client.zadd(runs_key, run.run_id, run.started_at)
        # the index is bounded like the records it points to
        client.zremrangebyscore(runs_key, "-inf", now - options.run_ttl_s)
        client.zremrangebyrank(runs_key, 0, -MAX_RUNS_INDEXED - 1)

    client.retrying("run", write)
    warn_without_persistence(client)  # once, as a run or a gateway starts: what a restart would lose


def end_run(client: Client, keys: Keys, options: RedisOptions, run_id: str, exit_code: int, ended_at: float) -> None:
    key = keys.run_info(run_id)
    raw = client.retrying("run", lambda: client.get(key))
    if raw is None:
        return
    ended = dataclasses.replace(records.decode_run(raw), exit_code=exit_code, ended_at=ended_at)
    client.retrying("run", lambda: client.set(key, records.encode_run(ended), ex=options.run_ttl_s))


def runs(client: Client, keys: Keys, *, since: float | None = None, until: float | None = None) -> list[RunRecord]:
    low = "-inf" if since is None else repr(float(since))
    high = "+inf" if until is None else f"({float(until)!r}"
    run_ids = client.retrying("read", lambda: client.zrangebyscore(keys.runs(), low, high))
    raws = client.retrying("read", lambda: [client.get(keys.run_info(r)) for r in run_ids])
    return sorted((records.decode_run(raw) for raw in raws if raw is not None), key=lambda r: r.started_at)


def put_packages(client: Client, keys: Keys, model: str, packages: Sequence[Package], synced_at: float) -> None:
    payload = records.encode_packages(packages, synced_at)
    client.retrying("sync", lambda: client.set(keys.packages(model), payload))


def packages(client: Client, keys: Keys, model: str) -> list[Package]:
    raw = client.retrying("read", lambda: client.get(keys.packages(model)))
    return [] if raw is None else records.decode_packages(model, raw)


def prune(before_day: str, *, dry_run: bool = False) -> PruneResult:
    """Redis bounds itself (docs/redis.md, "Memory"): nothing to fold or delete, and the note says why."""
    return PruneResult(before_day, dry_run=dry_run, note=records.PRUNE_NOTE)


def aggregates() -> list[DayAggregate]:
    return []  # what Redis expired is gone, not aggregated: long reports belong to a SQLite ledger
