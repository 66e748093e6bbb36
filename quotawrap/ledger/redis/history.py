"""The Redis ledger's records for reading back: runs, call records, run totals, packages,
the sync history and the usage series (and why Redis has nothing to prune or aggregate).

None of it is on the reserve/settle path; :class:`RedisLedger` takes it as a base class, so a
call costs what it did when these lived in ledger.py.
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

__all__ = ["RedisHistory"]

MAX_RUNS_INDEXED = 10_000


class RedisHistory:
    """The read-side queries of :class:`RedisLedger` (and the run/package writes whose format they read)."""

    options: RedisOptions
    _keys: Keys

    def _redis(self) -> Client:
        raise NotImplementedError  # RedisLedger connects

    def _now(self) -> float:
        raise NotImplementedError  # RedisLedger keeps the server's clock

    def usage_series(self, model: str, day: str) -> list[tuple[float, int]]:
        client = self._redis()
        return records.usage_series(client.retrying("read", lambda: client.hgetall(self._keys.md_series(day, model))))

    def sync_history(self, model: str, day: str) -> list[tuple[float, int]]:
        client = self._redis()
        raw = client.retrying("read", lambda: client.lrange(self._keys.md_sync(day, model)))
        return sorted(records.decode_sync_entry(entry) for entry in raw)

    def run_totals(self, run_id: str) -> RunTotals:
        client = self._redis()
        members = client.retrying("read", lambda: client.smembers(self._keys.run_model_days(run_id)))
        models: dict[str, ModelTotals] = {}
        for member in members:
            day, model = records.parse_model_day_member(member)
            key = self._keys.md_run_totals(day, model, run_id)
            raw = client.retrying("read", partial(client.hgetall, key))
            if not raw:
                continue
            totals = ModelTotals(**{name: as_int(raw.get(name)) for name in ModelTotals.__dataclass_fields__})
            models.setdefault(model, ModelTotals()).add(totals)
        return RunTotals(run_id, dict(sorted(models.items())))

    def reasoning_history(self, model: str, *, since: float, limit: int) -> list[int]:
        return reasoning_samples(self.call_records(since=since), limit).get(model, [])  # capped streams: few

    def call_records(
        self, *, since: float | None = None, until: float | None = None, run_id: str | None = None
    ) -> list[CallRecord]:
        """What Redis still keeps: the capped audit streams and the open holds of the indexed model-days."""
        client = self._redis()
        latest: dict[str, CallRecord] = {}
        for member in client.retrying("read", lambda: client.zrange(self._keys.active())):
            day, model = records.parse_model_day_member(member)
            audit, open_key = self._keys.md_audit(day, model), self._keys.md_open(day, model)
            # oldest first: a later entry of the same call replaces an earlier one
            for entry in client.retrying("read", partial(client.xrange, audit)):
                latest[entry["id"]] = records.call_record(model, day, entry)
            open_ids = client.retrying("read", partial(client.zrange, open_key))
            keys = [self._keys.hold(day, model, hold_id) for hold_id in open_ids]
            rows = client.retrying("read", partial(client.hgetall_many, keys))
            for hold_id, row in zip(open_ids, rows, strict=True):
                if row.get("state") == "held":
                    latest[hold_id] = records.call_record(
                        model, day, {**row, "id": hold_id, "ended": "", "latency": ""}
                    )
        found = [
            r
            for r in latest.values()
            if (since is None or r.started_at >= since)
            and (until is None or r.started_at < until)
            and (run_id is None or r.run_id == run_id)
        ]
        return sorted(found, key=lambda r: r.started_at)

    def start_run(self, run: RunRecord) -> None:
        client, runs = self._redis(), self._keys.runs()

        def write() -> None:
            client.set(self._keys.run_info(run.run_id), records.encode_run(run), ex=self.options.run_ttl_s)
            client.zadd(runs, run.run_id, run.started_at)
            # the index is bounded like the records it points to
            client.zremrangebyscore(runs, "-inf", self._now() - self.options.run_ttl_s)
            client.zremrangebyrank(runs, 0, -MAX_RUNS_INDEXED - 1)

        client.retrying("run", write)
        warn_without_persistence(client)  # once, as a run or a gateway starts: what a restart would lose

    def end_run(self, run_id: str, exit_code: int, ended_at: float) -> None:
        client, key = self._redis(), self._keys.run_info(run_id)
        raw = client.retrying("run", lambda: client.get(key))
        if raw is None:
            return
        ended = dataclasses.replace(records.decode_run(raw), exit_code=exit_code, ended_at=ended_at)
        client.retrying("run", lambda: client.set(key, records.encode_run(ended), ex=self.options.run_ttl_s))

    def runs(self, *, since: float | None = None, until: float | None = None) -> list[RunRecord]:
        client = self._redis()
        low = "-inf" if since is None else repr(float(since))
        high = "+inf" if until is None else f"({float(until)!r}"
        run_ids = client.retrying("read", lambda: client.zrangebyscore(self._keys.runs(), low, high))
        raws = client.retrying("read", lambda: [client.get(self._keys.run_info(r)) for r in run_ids])
        return sorted((records.decode_run(raw) for raw in raws if raw is not None), key=lambda r: r.started_at)

    def put_packages(self, model: str, packages: Sequence[Package], synced_at: float) -> None:
        client, payload = self._redis(), records.encode_packages(packages, synced_at)
        client.retrying("sync", lambda: client.set(self._keys.packages(model), payload))

    def packages(self, model: str) -> list[Package]:
        client = self._redis()
        raw = client.retrying("read", lambda: client.get(self._keys.packages(model)))
        return [] if raw is None else records.decode_packages(model, raw)

    def prune(self, before_day: str, *, dry_run: bool = False) -> PruneResult:
        """Redis bounds itself (docs/redis.md, "Memory"): nothing to fold or delete, and the note says why."""
        return PruneResult(before_day, dry_run=dry_run, note=records.PRUNE_NOTE)

    def aggregates(self, *, since_day: str | None = None, until_day: str | None = None) -> list[DayAggregate]:
        return []  # what Redis expired is gone, not aggregated: long reports belong to a SQLite ledger
