"""The run's summary: the stderr table, ``--report-json`` and the CI step summary, all from one dict."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from ..books.report import anomalous_line
from ..config.settings import Settings
from ..core.budgets import BudgetUse
from ..core.errors import EXIT_BLOCKED
from ..core.identity import UNMAPPED
from ..core.money import format_cny
from ..core.output_bound import ADDED, REPLACED
from ..core.quota import BEIJING
from ..core.redact import redact_url
from ..ledger import ModelTotals, RunTotals
from ..support.events import RunEvents
from ..support.files import append_private, write_private
from ..support.log import printable, summary_head

__all__ = [
    "append_step_summary",
    "format_summary",
    "read_unguarded",
    "run_report",
    "step_summary_markdown",
    "write_json",
]

_COLUMNS = (
    ("calls", "calls"),
    ("settled_tokens", "settled"),
    ("blocked_calls", "blocked"),
    ("overshoot_calls", "overshoot"),
    ("unresolved_calls", "unresolved"),
)


def read_unguarded(path: str | os.PathLike[str] | None, reason: str = "fail-open") -> dict[str, int]:
    """Calls per model let through unguarded, as the children recorded them: by ``--fail-open`` (the store was
    unreachable), or, with ``reason="model-filter"``, because ``--model`` does not name their model."""
    counts: dict[str, int] = {}
    if not path or not Path(path).is_file():
        return counts
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            model = str(record["model"])
            why = record.get("reason") or "fail-open"  # records written before there were two reasons
        except (ValueError, KeyError, TypeError, AttributeError):
            model, why = "(unreadable record)", "fail-open"
        if why == reason:
            counts[model] = counts.get(model, 0) + 1
    return counts


def run_report(
    totals: RunTotals,
    *,
    settings: Settings,
    exit_code: int,  # the command's
    tags: Mapping[str, str] | None = None,
    unguarded: Mapping[str, int] | None = None,
    store_error: str | None = None,
    unguarded_processes: Sequence[Mapping[str, Any]] = (),
    connections: Sequence[Mapping[str, Any]] = (),
    events: RunEvents | None = None,
    outside_filter: Mapping[str, int] | None = None,
    budgets: Sequence[BudgetUse] = (),
) -> dict[str, Any]:
    """The run's summary as data; token counts are tokens, costs ``cost_micro_cny`` (micro-CNY, the name and
    unit ``quotawrap report --format json`` uses; the ledger's ``settled_cost``).

    ``outside_filter``: calls per model that went out unguarded because ``--model`` does not name the model
    (``outside_filter_calls``, per model and in the totals).

    A call that waited for room may have left refused attempts in the ledger before it was admitted
    (``events.superseded_by_model``): they are not refusals of the program's calls, so ``blocked``
    counts calls the program was answered 429, not attempts.
    """
    events = events or RunEvents()
    models = {
        name: dataclasses.asdict(model)
        for name, model in totals.models.items()
        # the unmapped endpoints' row once each of their calls moved to the model it is: nothing of its own
        if name != UNMAPPED or model != ModelTotals()
    }
    for name, model in models.items():
        model["blocked_calls"] = max(0, model["blocked_calls"] - events.superseded_by_model.get(name, 0))
        model["bounded_calls"] = events.bounded_by_model.get(name, 0)
        model["replaced_max_tokens_calls"] = events.replaced_by_model.get(name, 0)
        model["cut_by_bound_calls"] = events.cut_by_model.get(name, 0)
    unguarded = dict(unguarded or {})
    for name, count in unguarded.items():
        models.setdefault(name, dataclasses.asdict(ModelTotals()))["unguarded_calls"] = count
    outside = dict(outside_filter or {})
    for name, count in outside.items():
        models.setdefault(name, dataclasses.asdict(ModelTotals()))["outside_filter_calls"] = count
    for model in models.values():
        model.setdefault("unguarded_calls", 0)
        model.setdefault("outside_filter_calls", 0)
    summed = dataclasses.asdict(totals.totals)
    for counts in (*models.values(), summed):  # a new model of --fail-open's log has its zero too
        counts["cost_micro_cny"] = counts.pop("settled_cost")
    summed["unguarded_calls"] = sum(unguarded.values())
    summed["outside_filter_calls"] = sum(outside.values())
    # What went around the guard: Python processes without the hook, connections no client made.
    summed["unguarded_processes"] = [dict(process) for process in unguarded_processes]
    summed["refused_connections"] = sum(1 for c in connections if not c.get("allowed"))
    summed["unguarded_connections"] = sum(1 for c in connections if c.get("allowed"))
    summed["blocked_calls"] = sum(model.get("blocked_calls", 0) for model in models.values())
    summed["bounded_calls"] = events.bounded_calls
    summed["replaced_max_tokens_calls"] = events.bounds.get(REPLACED, 0)
    summed["cut_by_bound_calls"] = sum(events.cut.values())
    return {
        "session": totals.run_id,
        "store": redact_url(settings.store) if settings.store else None,
        # quotawrap's own exit code (what CI sees), and the command's
        "exit_code": EXIT_BLOCKED if settings.fail_on_block and summed["blocked_calls"] else exit_code,
        "command_exit_code": exit_code,
        "mode": "watch" if settings.watch else "enforce",
        "limits": {"cap_tokens": settings.cap_tokens, "cap_cost": settings.cap_cost},
        "model_filter": list(settings.model),
        "tags": dict(tags or {}),
        "models": models,
        "totals": summed,
        "unguarded_log": settings.unguarded_log if unguarded else None,
        "store_error": store_error,
        "connections": [dict(connection) for connection in connections],
        # the budgets its calls may count against, as the run ended (issue 33)
        "budgets": [use.as_json() for use in budgets],
        "waits": events.as_dict(),
        # calls the guard sent with a whole-output bound, per how (added / replaced max_tokens), and those cut there
        "bounds": {
            "reasoning_reserve": settings.reasoning_reserve,
            **{how: events.bounds.get(how, 0) for how in (ADDED, REPLACED)},
            **{f"{how}_cut": events.cut.get(how, 0) for how in (ADDED, REPLACED)},
        },
        # False when the ledger could not total the run: the numbers above are a lower bound
        "complete": store_error is None,
    }


def append_step_summary(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """GitHub Actions shows ``$GITHUB_STEP_SUMMARY`` Markdown on the run's page."""
    append_private(path, step_summary_markdown(report).encode())


def format_summary(report: dict[str, Any]) -> str:
    totals = report["totals"]
    watch = report["mode"] == "watch"
    lines = [
        summary_head(
            report["session"],
            totals["calls"],
            totals["settled_tokens"],
            format_cny(totals["cost_micro_cny"]),
            totals["blocked_calls"],
            would_block=totals["would_block_calls"] if watch else None,
            went_around=_went_around(totals),
        )
    ]
    if report["models"]:
        names = {name: printable(name) for name in report["models"]}  # a model name is the program's or provider's
        width = max(len("model"), *(len(shown) for shown in names.values()))
        header = "  " + "model".ljust(width) + "".join(f"  {title:>10}" for _, title in _COLUMNS)
        went_unguarded = any(_unguarded(model) for model in report["models"].values())
        if watch:
            header += f"  {'would-block':>11}"
        if went_unguarded:
            header += f"  {'UNGUARDED':>10}"
        lines.append(header)
        for name, model in sorted(report["models"].items()):
            row = "  " + names[name].ljust(width) + "".join(f"  {model[key]:>10,}" for key, _ in _COLUMNS)
            if watch:
                row += f"  {model['would_block_calls']:>11,}"
            if went_unguarded:
                row += f"  {_unguarded(model):>10,}"
            lines.append(row)
    filters = ", ".join(report.get("model_filter") or ()) or "(none)"
    for name, model in sorted(report["models"].items()):
        if model.get("outside_filter_calls"):
            lines.append(
                f"  {model['outside_filter_calls']} call(s) to {name} went out UNGUARDED: --model {filters}"
                " does not name that model (its tokens are in no total above)"
            )
    waits = report.get("waits") or {}
    if waits.get("waited_calls"):
        lines.append(
            f"  {waits['waited_calls']} call(s) waited for room (--wait): {waits['admitted_after_wait']} admitted,"
            f" {waits['refused_after_wait']} refused;"
            f" wait p50 {waits['wait_p50_s']:.2f}s, p99 {waits['wait_p99_s']:.2f}s"
        )
    lines += _bound_lines(report.get("bounds") or {})
    lines += [f"  {BudgetUse.from_json(budget).line()}" for budget in report.get("budgets") or ()]
    if totals.get("unguarded_calls"):
        lines.append(
            f"  {totals['unguarded_calls']} call(s) went out UNGUARDED while the store was unreachable"
            f" (--fail-open); recorded in {report['unguarded_log']}"
        )
    for process in totals.get("unguarded_processes", ()):
        what = "STOPPED by --strict" if process.get("stopped") else "its calls were NOT guarded"
        lines.append(
            f"  UNGUARDED PROCESS: pid {process['pid']} ({process['command']}) ran without quotawrap's hook"
            f" ({process['reason']}): {what}"
        )
    if totals.get("refused_connections"):
        lines.append(
            f"  {totals['refused_connections']} connection(s) to a guarded endpoint refused: made outside every"
            f" guarded HTTP client ({_stacks(report, allowed=False)}); --allow-unguarded lets them through"
        )
    if totals.get("unguarded_connections"):
        lines.append(
            f"  {totals['unguarded_connections']} connection(s) to a guarded endpoint went out UNGUARDED"
            f" (--allow-unguarded; {_stacks(report, allowed=True)}): their calls are not in these totals"
        )
    if report.get("store_error"):
        lines.append(f"  the ledger could not close this run ({report['store_error']}): totals above are incomplete")
    unresolved = totals["unresolved_calls"] - totals.get("anomalous_calls", 0)
    if unresolved > 0:
        lines.append(
            f"  {unresolved} call(s) ended without usage (cut, abandoned or crashed): charged at their full reservation"
        )
    if totals.get("anomalous_calls"):
        lines.append(f"  {anomalous_line(totals['anomalous_calls'])}")
    return printable("\n".join(lines), lines=True)


def _bound_lines(bounds: Mapping[str, Any]) -> list[str]:
    """What the guard did to the requests it changed, one line per way, with the calls it cut short."""
    lines = []

    def cut(how: str) -> str:
        count = bounds.get(f"{how}_cut", 0)
        return f"; {count} cut short there (finish_reason length)" if count else "; none cut short there"

    if bounds.get(ADDED):
        lines.append(
            f"  {bounds[ADDED]} call(s) that may think set no output bound: sent with max_completion_tokens"
            f" at the model's learned allowance{cut(ADDED)} (--no-bound to opt out)"
        )
    if bounds.get(REPLACED):
        why = (
            "--reasoning-reserve cut"
            if bounds.get("reasoning_reserve") == "cut"
            else "the cap can never hold max_tokens + the model's reasoning ceiling; --reasoning-reserve"
        )
        lines.append(
            f"  {bounds[REPLACED]} call(s) that may think set max_tokens: sent as max_completion_tokens ="
            f" max_tokens, reasoning and answer together ({why}){cut(REPLACED)}"
        )
    return lines


def _unguarded(model: Mapping[str, Any]) -> int:
    """A model's calls that went out unguarded (--fail-open, or outside --model)."""
    return int(model.get("unguarded_calls", 0)) + int(model.get("outside_filter_calls", 0))


def _went_around(totals: dict[str, Any]) -> bool:
    """Calls the totals cannot include: unguarded processes, connections, --fail-open calls or calls to models
    --model does not name."""
    return bool(
        totals.get("unguarded_processes")
        or totals.get("unguarded_connections")
        or totals.get("unguarded_calls")
        or totals.get("outside_filter_calls")
    )


def _stacks(report: dict[str, Any], *, allowed: bool) -> str:
    made = sorted(
        {
            f"{c.get('stack')} -> {c.get('target')}"
            for c in report.get("connections", ())
            if bool(c.get("allowed")) == allowed
        }
    )
    return "; ".join(made[:3]) + (f"; and {len(made) - 3} more" if len(made) > 3 else "")


def write_json(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    write_private(path, (json.dumps(report, indent=2, sort_keys=True) + "\n").encode())


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
