"""How the Redis ledger's records are written as strings and read back.

The Lua scripts write some of these (a hold's hash, the audit stream, a run's hold copies, a
hold's location); the formats are in lua/lib.lua and docs/redis.md, and are parsed here only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import cast

from ...core.quota import Package, Snapshot
from ...core.records import Record
from ..base import CallRecord, CallState, RunRecord

__all__ = [
    "PRUNE_NOTE",
    "Location",
    "call_record",
    "decode_packages",
    "decode_run",
    "decode_sync_entry",
    "encode_packages",
    "encode_run",
    "encode_sync_entry",
    "model_day_member",
    "parse_model_day_member",
    "parse_owner",
    "parse_run_hold",
    "snapshot_fields",
    "snapshot_from_fields",
    "usage_series",
]


class Location(Record, frozen=True):
    """Where a hold lives: its model-day's slot, and its run. Stored as ``day<TAB>model<TAB>run``."""

    day: str
    model: str
    run_id: str

    def encode(self) -> str:
        return f"{self.day}\t{self.model}\t{self.run_id}"

    @classmethod
    def decode(cls, text: str) -> Location:
        day, model, run_id = text.split("\t", 2)
        return cls(day, model, run_id)


def model_day_member(day: str, model: str) -> str:
    """A model-day as a member of the active index and of a run's model-days set."""
    return f"{day}\t{model}"


def parse_model_day_member(member: str) -> tuple[str, str]:
    """(day, model)."""
    day, _, model = member.partition("\t")
    return day, model


def parse_owner(field: str) -> tuple[str, str]:
    """(host, pid) of a field of a model-day's pids hash, ``host|pid``."""
    host, _, pid = field.rpartition("|")
    return host, pid


def parse_run_hold(text: str) -> tuple[str, str, str]:
    """(state, day, model) of a run's copy of a hold (lib.lua run_hold: state, reserved, charged,
    reserved cost, charged cost, day, model; tab separated)."""
    state, _, _, _, _, day, model = text.split("\t", 6)
    return state, day, model


def _optional_int(text: str | None) -> int | None:
    return None if text in (None, "") else int(float(text or 0))


def _optional_float(text: str | None) -> float | None:
    return None if text in (None, "") else float(text or 0)


def call_record(model: str, day: str, f: Mapping[str, str]) -> CallRecord:
    """A CallRecord from an audit stream entry or an open hold's hash."""
    return CallRecord(
        id=f["id"],
        run_id=f.get("run") or "",
        model=model,
        day=day,
        endpoint=f.get("endpoint") or "",
        state=cast(CallState, f.get("state") or "held"),
        reserved=_optional_int(f.get("reserved")) or 0,
        charged=_optional_int(f.get("charged")) or 0,
        reserved_cost=_optional_int(f.get("reserved_cost")) or 0,
        charged_cost=_optional_int(f.get("charged_cost")) or 0,
        prompt_tokens=_optional_int(f.get("prompt")),
        completion_tokens=_optional_int(f.get("completion")),
        reasoning_tokens=_optional_int(f.get("reasoning")),
        cached_tokens=_optional_int(f.get("cached")),
        overshoot=f.get("overshoot") == "1",
        would_block=f.get("would_block") == "1",
        blocked_by=f.get("blocked_by") or None,
        key_fingerprint=f.get("kf") or None,
        tags=json.loads(f["tags"]) if f.get("tags") else {},
        started_at=_optional_float(f.get("started")) or 0.0,
        ended_at=_optional_float(f.get("ended")),
        latency_s=_optional_float(f.get("latency")),
        pid=_optional_int(f.get("pid")) or 0,
        host=f.get("host") or "",
        usage_anomaly=f.get("anomaly") or None,
        handed_to=f.get("handed_to") or None,
    )


def snapshot_fields(snapshot: Snapshot) -> dict[str, str | int]:
    """Our snapshot hash."""
    return {
        "balance": snapshot.balance,
        "usage_at_sync": snapshot.usage_at_sync,
        "lagged_usage": snapshot.lagged_usage,
        "synced_at": repr(float(snapshot.synced_at)),
        "day": snapshot.day,
        "source": snapshot.source,
        "lag_s": repr(float(snapshot.lag_s)),
    }


def snapshot_from_fields(fields: Mapping[str, str]) -> Snapshot | None:
    if not fields.get("synced_at"):
        return None
    return Snapshot(
        balance=int(fields.get("balance") or 0),
        usage_at_sync=int(fields.get("usage_at_sync") or 0),
        lagged_usage=int(fields.get("lagged_usage") or 0),
        synced_at=float(fields["synced_at"]),
        day=fields.get("day") or "",
        source=fields.get("source") or "manual",
        lag_s=float(fields.get("lag_s") or 0),
    )


def usage_series(raw: Mapping[str, str]) -> list[tuple[float, int]]:
    """A model-day's usage series hash (minute -> cumulative tokens) as (timestamp, cumulative), ascending."""
    return sorted((int(minute or 0) * 60.0, int(float(value or 0))) for minute, value in raw.items())


def encode_sync_entry(snapshot: Snapshot) -> str:
    return f"{snapshot.synced_at!r}\t{snapshot.balance}\t{snapshot.usage_at_sync}\t{snapshot.source}"


def decode_sync_entry(text: str) -> tuple[float, int]:
    """(synced_at, balance)."""
    synced_at, balance, _ = text.split("\t", 2)
    return float(synced_at), int(balance)


def encode_run(run: RunRecord) -> str:
    return json.dumps(
        {
            "run_id": run.run_id,
            "started_at": run.started_at,
            "ended_at": run.ended_at,
            "command": run.command,
            "tags": dict(run.tags),
            "exit_code": run.exit_code,
        }
    )


def decode_run(text: str) -> RunRecord:
    data = json.loads(text)
    return RunRecord(
        data["run_id"],
        float(data["started_at"]),
        data.get("ended_at"),
        data.get("command") or "",
        data.get("tags") or {},
        data.get("exit_code"),
    )


def encode_packages(packages: Sequence[Package], synced_at: float) -> str:
    return json.dumps({"synced_at": synced_at, "packages": [[p.available, p.expires_at] for p in packages]})


def decode_packages(model: str, text: str) -> list[Package]:
    return [Package(model, int(available), float(expires)) for available, expires in json.loads(text)["packages"]]


PRUNE_NOTE = (
    "nothing to prune on Redis: model-day keys (counters, series, sync history, the audit stream capped at"
    " audit_max) expire 2 days after their day and run keys after run_ttl_s, so the store is already bounded"
)
