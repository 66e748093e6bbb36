"""A SQLite ledger's calls as CallRecords: the rows of holds (in flight) and calls (final), read as one."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from ..base import CallRecord
from .file import EVERY_CALL

__all__ = ["read_call_records"]

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


def read_call_records(
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
