"""The ``report`` command's rows: call records and pruned days' aggregates, grouped and rendered."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from typing import Any

from ..core.errors import ConfigError
from ..core.money import format_cny
from ..core.output_bound import REPLACED, cut_short, read_bound_mark, without_bound_mark
from ..core.quota import DAY_S, beijing_day, beijing_day_start
from ..core.retry_mark import RETRY_MARK
from ..ledger import Reader
from ..ledger.base import REPORT_SUMS, CallRecord, DayAggregate
from ..support.log import printable

__all__ = [
    "BOUND_SUMS",
    "GROUPINGS",
    "aggregate",
    "anomalous_line",
    "bound_line",
    "day_range",
    "ledger_rows",
    "render_csv",
    "render_table",
]

GROUPINGS = ("model", "session", "day", "tag:KEY")


def _group_key(record: CallRecord | DayAggregate, by: str) -> str:
    if by == "model":
        return record.model
    if by == "session":
        return record.run_id
    if by == "day":
        return record.day
    if by.startswith("tag:") and len(by) > 4:
        return record.tags.get(by[4:], "(none)")
    raise ConfigError(f"--by {by!r}: use one of {', '.join(GROUPINGS)}")


# Counted from kept calls' hold ids (core/output_bound.py) beside REPORT_SUMS, since a pruned day keeps none of them.
BOUND_SUMS = ("bounded_calls", "replaced_max_tokens_calls", "cut_by_bound_calls")


def aggregate(records: Iterable[CallRecord | DayAggregate], by: str = "model") -> list[dict[str, Any]]:
    """Totals per group, sorted by settled tokens (largest first); a pruned day's aggregate adds its sums.

    Pure (records in, rows out), so ``quotawrap report`` gives the same numbers whether the records come from
    the SQLite ledger, the Redis ledger's capped stream or an ``--audit-log`` JSONL file.
    """
    groups: dict[str, dict[str, Any]] = {}
    records = list(records)
    retried = set()
    for r in records:
        if isinstance(r, CallRecord) and (numbered := without_bound_mark(r.id)).endswith(RETRY_MARK):
            retried.add(numbered[: -len(RETRY_MARK)])
    for record in records:
        key = _group_key(record, by)
        row = groups.setdefault(key, {"key": key, **dict.fromkeys((*REPORT_SUMS, *BOUND_SUMS), 0)})
        if isinstance(record, DayAggregate):
            for name in REPORT_SUMS:
                row[name] += getattr(record, name)
            continue
        if record.handed_to is not None:  # a video task's create: the task's own row is the call
            continue
        if record.state == "blocked":
            row["blocked_calls"] += without_bound_mark(record.id) not in retried
            continue
        mark = read_bound_mark(record.id)
        if mark is not None:
            row["bounded_calls"] += 1
            row["replaced_max_tokens_calls"] += mark[0] == REPLACED
            output = record.completion_tokens
            row["cut_by_bound_calls"] += output is not None and cut_short(output, mark[1])
        row["calls"] += 1
        row["settled_tokens"] += record.charged
        row["cost_micro_cny"] += record.charged_cost
        row["unresolved_calls"] += record.state == "unresolved"
        row["overshoot_calls"] += record.outcome == "overshoot"
        row["released_calls"] += record.state == "released"
        row["anomalous_calls"] += record.usage_anomaly is not None
        for name in ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens"):
            row[name] += getattr(record, name) or 0
    return sorted(groups.values(), key=lambda row: (-row["settled_tokens"], row["key"]))


def anomalous_line(count: int) -> str:
    """The words every view uses for calls whose answer's usage was not believed."""
    return f"{count} call(s) with implausible usage (charged their hold)"


def render_table(rows: list[dict[str, Any]], by: str) -> str:
    if not rows:
        return "no guarded calls in that range"
    title = printable(by.split(":", 1)[-1])
    keys = [printable(row["key"]) for row in rows]  # model names, tags: the program's or provider's words
    width = max(len(title), *(len(key) for key in keys))
    header = f"{title:<{width}}  {'calls':>7}  {'blocked':>7}  {'settled':>12}  {'cost':>11}  {'unresolved':>10}"
    lines = [header, "-" * len(header)]
    for key, row in zip(keys, rows, strict=True):
        lines.append(
            f"{key:<{width}}  {row['calls']:>7,}  {row['blocked_calls']:>7,}  {row['settled_tokens']:>12,}"
            f"  {format_cny(row['cost_micro_cny']):>11}  {row['unresolved_calls']:>10,}"
        )
    anomalous = sum(row.get("anomalous_calls", 0) for row in rows)
    if anomalous:
        lines.append(f"{anomalous_line(anomalous)}: counted in unresolved above")
    bounded = sum(row.get("bounded_calls", 0) for row in rows)
    if bounded:
        lines.append(bound_line(bounded, sum(row.get("cut_by_bound_calls", 0) for row in rows)))
    return "\n".join(lines)


def bound_line(bounded: int, cut: int) -> str:
    """The words every ledger view uses for calls the guard sent with its own whole-output bound."""
    return f"{bounded} call(s) sent with the guard's output bound, {cut} of them cut short there (finish_reason length)"


def render_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["key", *REPORT_SUMS, *BOUND_SUMS], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def day_range(since: float | None, until: float | None) -> tuple[str | None, str | None]:
    """The pruned days a report over [since, until) counts: those that *start* in the range, so that
    adjacent ranges count every pruned day exactly once (a pruned day is kept whole, not by the hour)."""

    def first_day_from(ts: float | None) -> str | None:
        if ts is None:
            return None
        start = beijing_day_start(ts)
        return beijing_day(start if start >= ts else start + DAY_S)

    return first_day_from(since), first_day_from(until)


def ledger_rows(
    ledger: Reader, by: str, *, since: float | None = None, until: float | None = None, session: str | None = None
) -> list[dict[str, Any]]:
    """``quotawrap report``'s rows: the calls still kept, plus the daily aggregates of pruned days."""
    found: list[CallRecord | DayAggregate] = [*ledger.call_records(since=since, until=until, run_id=session)]
    if session is None:  # aggregates keep no session: a session filter sees only kept calls
        since_day, until_day = day_range(since, until)
        found += ledger.aggregates(since_day=since_day, until_day=until_day)
    return aggregate(found, by)
