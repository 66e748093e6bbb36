"""Who spent what: aggregation of call records, the JSONL audit sink, and CI summaries.

Aggregation is pure (records in, rows out), so ``quotawrap report`` gives the same numbers
whether the records come from the SQLite ledger, the Redis ledger's capped stream or an
``--audit-log`` JSONL file.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from ..core.money import format_cny
from ..core.output_bound import REPLACED, cut_short, read_bound_mark, without_bound_mark
from ..core.quota import BEIJING
from ..ledger.base import REPORT_SUMS, CallRecord, DayAggregate
from ..support.files import append_private
from ..support.log import printable

__all__ = [
    "BOUND_SUMS",
    "GROUPINGS",
    "aggregate",
    "anomalous_line",
    "append_jsonl",
    "bound_line",
    "read_jsonl",
    "render_csv",
    "render_table",
    "step_summary_markdown",
]

GROUPINGS = ("model", "session", "day", "tag:KEY")

# A call refused on a bound fitted to counters since outgrown is refitted and asks again (reserving.py) under
# its refused attempt's id and this mark. The attempt stays a record (the ledger wrote it in the reserve's
# own transaction), but the program was not refused: no view counts it as blocked (the run summary drops
# the same attempts, counted in the events log).
RETRY_MARK = "~"


def retry_id(hold_id: str) -> str:
    """The hold id of a call's next attempt after a refused one it refitted."""
    return hold_id + RETRY_MARK


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


# What a report row counts of the calls still kept, beside REPORT_SUMS (a pruned day keeps none of them):
# calls the guard sent with a whole-output bound, those whose max_tokens it sent as that bound, and those
# cut short at it (read from the hold id, admission.bound_mark).
BOUND_SUMS = ("bounded_calls", "replaced_max_tokens_calls", "cut_by_bound_calls")


def aggregate(records: Iterable[CallRecord | DayAggregate], by: str = "model") -> list[dict[str, Any]]:
    """Totals per group, sorted by settled tokens (largest first); a pruned day's aggregate adds its sums."""
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


# -- the JSONL sink --------------------------------------------------------------------------


def append_jsonl(path: str | os.PathLike[str], record: CallRecord) -> None:
    """Append one record as one line; O_APPEND and a single write keep concurrent writers whole."""
    data = asdict(record)
    data["outcome"] = record.outcome
    line = (json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    append_private(path, line)


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[CallRecord]:
    """Records of an audit log; a damaged line is reported, not silently skipped."""
    fields = set(CallRecord.__dataclass_fields__)
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                yield CallRecord(**{key: value for key, value in data.items() if key in fields})
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{path}:{number}: not an audit record ({exc})") from None


# -- CI ----------------------------------------------------------------------------------------


def step_summary_markdown(report: Mapping[str, Any]) -> str:
    """The run's report as Markdown for ``$GITHUB_STEP_SUMMARY``."""
    totals = report["totals"]
    cap = report.get("limits", {})
    caps = ", ".join(
        text
        for text in (
            f"token cap {cap['cap_tokens']:,}" if cap.get("cap_tokens") is not None else "",
            f"cost cap {format_cny(round(cap['cap_cost'] * 1_000_000))}" if cap.get("cap_cost") is not None else "",
        )
        if text
    )
    verdict = "**blocked calls: {}**".format(totals["blocked_calls"]) if totals["blocked_calls"] else "no call blocked"
    warnings = []  # unguarded calls, processes and connections are listed below the table
    if report.get("store_error"):
        warnings.append(
            f"> **Totals are incomplete**: the ledger could not close this run ({_cell(report['store_error'])})."
        )
    lines = [
        f"### quotawrap · session `{report['session']}`",
        "",
        *(line for warning in warnings for line in (warning, "")),
        f"{totals['calls']} guarded call(s), {totals['settled_tokens']:,} tokens settled"
        f" ({format_cny(totals.get('cost_micro_cny', 0))}); {verdict}" + (f"; {caps}" if caps else ""),
        "",
        "| model | calls | blocked | settled tokens | cost | overshoot | unresolved |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, model in sorted(report["models"].items()):
        lines.append(
            f"| {_cell(name)} | {model['calls']:,} | {model['blocked_calls']:,} | {model['settled_tokens']:,}"
            f" | {format_cny(model.get('cost_micro_cny', 0))} | {model['overshoot_calls']:,}"
            f" | {model['unresolved_calls']:,} |"
        )
    if totals.get("anomalous_calls"):
        lines += ["", f"- {anomalous_line(totals['anomalous_calls'])}"]
    lines += _went_around_markdown(totals)
    when = datetime.now(BEIJING).strftime("%Y-%m-%d %H:%M Beijing")
    code = f"exit code {report['exit_code']}"
    if report.get("command_exit_code", report["exit_code"]) != report["exit_code"]:
        code += f" (--fail-on-block; the command exited {report['command_exit_code']})"
    lines += ["", f"<sub>{when} · {code} · mode {report['mode']}</sub>", ""]
    return "\n".join(lines)


def _cell(text: object) -> str:
    """Text from a program or provider inside the Markdown: one line, and no ``|`` or backtick that ends its cell."""
    return printable(text).replace("|", "\\|").replace("`", "'")


def _went_around_markdown(totals: Mapping[str, Any]) -> list[str]:
    """What the totals above cannot include: a CI page must say so as loudly as the terminal summary does."""
    items = [
        f"- **UNGUARDED PROCESS** pid {process['pid']} (`{_cell(process['command'])}`) ran without quotawrap's hook"
        f" ({_cell(process['reason'])}): "
        + ("stopped by --strict" if process.get("stopped") else "its calls were **not** guarded")
        for process in totals.get("unguarded_processes", ())
    ]
    if totals.get("unguarded_connections"):
        items.append(
            f"- **{totals['unguarded_connections']} connection(s) went out UNGUARDED** (--allow-unguarded):"
            " their calls are not in these totals"
        )
    if totals.get("refused_connections"):
        items.append(
            f"- {totals['refused_connections']} connection(s) made outside every guarded HTTP client were refused"
        )
    if totals.get("unguarded_calls"):
        items.append(
            f"- **{totals['unguarded_calls']} call(s) went out UNGUARDED** while the store was down (--fail-open)"
        )
    if totals.get("outside_filter_calls"):
        items.append(
            f"- **{totals['outside_filter_calls']} call(s) went out UNGUARDED**: --model does not name their model"
            " (`outside_filter_calls` per model in the report JSON)"
        )
    return ["", "**Not everything went through the guard:**", *items] if items else []
