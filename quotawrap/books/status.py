"""``quotawrap status``: each model's day, explained from the same limits the guard enforces."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections import Counter
from collections.abc import Collection
from datetime import datetime
from typing import Any

from ..admission.allowance import HISTORY_S, model_reasoning
from ..config.settings import Settings
from ..core import quota
from ..core.estimate import MAX_OUTPUT_TOKENS
from ..core.expiry import keep_alive_daily_usage
from ..core.identity import UNMAPPED
from ..core.model_limits import limits_for, reasoning_ceiling
from ..ledger import CallPath, Ledger, Reader, model_day_key
from ..ledger.base import CallRecord, RunRecord
from ..settling.followups import TASK_HOLD_PREFIX, open_task_holds
from ..support.log import printable
from ..support.processes import pid_alive
from .attribution import WRAPPER_HOST_TAG, WRAPPER_PID_TAG

__all__ = [
    "TAG_KEYS",
    "TOP_ROWS",
    "WRAPPER_HOST_TAG",
    "WRAPPER_PID_TAG",
    "current_status",
    "expiry_warnings",
    "model_status",
    "no_balance_today",
    "render_sessions",
    "render_status",
    "render_unguarded",
    "session_rows",
    "session_state",
    "status_snapshot",
    "unguarded_now",
]


def model_status(
    ledger: Ledger,
    settings: Settings,
    now: float,
    *,
    waiting: dict[str, int] | None = None,
    recent: list[CallRecord] | None = None,
) -> list[dict[str, Any]]:
    """``waiting``: per model, calls waiting for room now (the ledger's lines, and this host's events logs).
    ``recent``: the calls started in the last :data:`HISTORY_S`, when the caller has read them already."""
    from .report import aggregate

    day = quota.beijing_day(now)
    qsettings = settings.quota
    tasks: dict[str, list[dict[str, Any]]] = {}
    for record in open_task_holds(ledger, now):
        tasks.setdefault(record.model, []).append(
            {"task_id": record.id.removeprefix(TASK_HOLD_PREFIX), "held": record.reserved, "since": record.started_at}
        )
    if recent is None:
        recent = ledger.call_records(since=now - HISTORY_S)  # the last 24 h: all of today
    reasoning = model_reasoning(recent)
    anomalous = Counter(r.model for r in recent if r.day == day and r.usage_anomaly is not None)
    today = [r for r in recent if r.day == day and r.state != "blocked"]
    bounded = {row["key"]: row for row in aggregate(today, "model")}
    rows = []
    # what calls to endpoints whose model is not known yet hold and were charged counts against every model
    unmapped = ledger.counters([model_day_key(UNMAPPED, day)])[model_day_key(UNMAPPED, day)]
    for model in ledger.known_models():
        counters = ledger.counters([model_day_key(model, day)])[model_day_key(model, day)]
        if model == UNMAPPED and counters == quota.Counters():
            continue  # every unmapped call of today moved to the model it is
        also = unmapped.settled + unmapped.in_flight if model != UNMAPPED else 0
        stored = ledger.snapshot(model)
        snapshot = stored if stored is not None and stored.day == day else None
        limits = quota.model_day_limits(snapshot, qsettings, today=day)
        hold = next(limit for limit in limits if limit.kind == "hold")
        evicted = quota.evicted_by(limits, {"model_day": counters})
        packages = ledger.packages(model)
        advice = keep_alive_daily_usage(packages, now, daily_cap=qsettings.daily_cap)
        rows.append(
            {
                "model": model,
                "day": day,
                "usage": counters.settled,
                "in_flight": counters.in_flight,
                "effective_limit": hold.cap,
                "binding": hold.name,
                "limit_detail": hold.detail,
                "headroom": max(0, hold.cap - counters.settled - counters.in_flight - also),
                "evicted": evicted is not None,
                "evicted_by": evicted.name if evicted else None,
                "evicted_detail": evicted.detail if evicted else None,
                "balance_at_sync": snapshot.balance if snapshot else None,
                "usage_at_sync": snapshot.usage_at_sync if snapshot else None,
                "synced_at": snapshot.synced_at if snapshot else None,
                "sync_age_s": round(now - snapshot.synced_at, 1) if snapshot else None,
                "sync_source": snapshot.source if snapshot else None,
                "balance_known": snapshot is not None,
                "expiring_within_9_days": [
                    {"available": p.available, "expires_at": p.expires_at} for a in advice for p in a.expiring
                ],
                # capped at the daily cap: usage past it is not returned (§1.2)
                "keep_alive_daily_usage": advice[0].advised_daily_usage if advice else None,
                "keep_alive_needed": advice[0].daily_usage if advice else None,
                "keep_alive_shortfall": advice[0].shortfall if advice else None,
                "keep_alive_advice": advice[0].text() if advice else None,
                "seconds_to_reset": round(quota.seconds_to_beijing_midnight(now), 1),
                "open_video_tasks": tasks.get(model, []),
                "reasoning_p99": reasoning.get(model),
                "reasoning_ceiling": reasoning_ceiling(model),
                "reasoning_ceiling_known": limits_for(model) is not None,
                # the bound a call that may think and sets no bound goes out with (admission/room.py: plan_output)
                "output_allowance": min(
                    MAX_OUTPUT_TOKENS,
                    settings.default_max_tokens + reasoning_ceiling(model),
                    settings.default_max_tokens + settings.thinking_floor
                    if model not in reasoning
                    else max(settings.thinking_floor, settings.default_max_tokens + reasoning[model]),
                ),
                "reasoning_reserve": settings.reasoning_reserve,
                # today's calls the guard sent with its own output bound, and those it cut short
                "bounded_calls": bounded.get(model, {}).get("bounded_calls", 0),
                "cut_by_bound_calls": bounded.get(model, {}).get("cut_by_bound_calls", 0),
                "waiting": (waiting or {}).get(model, 0),
                "anomalous_calls": anomalous.get(model, 0),  # today's calls whose usage was not believed
            }
        )
    return rows


#: The tags whose values the spend breakdown shows (automatic ``user``, and ``team`` when runs set it).
TAG_KEYS = ("user", "team")
#: Rows kept per breakdown: the largest spenders; the rest are summed into one ``(others)`` row.
TOP_ROWS = 10


def status_snapshot(ledger: Ledger, settings: Settings, now: float, *, events_dir: str | None = None) -> dict[str, Any]:
    """The state of the store at ``now`` (the ledger's clock), as plain JSON values.

    ``events_dir``: where this host's runs keep their events logs (waits for room, processes outside the
    guard), of which those of this store's runs started in the last day are read; None reads the ledger's
    lines alone.

    Shape (every token figure an int; times are Unix seconds):

    - ``now``, ``day`` (Beijing), ``seconds_to_reset``;
    - ``models``: one row per model, exactly ``status --json``'s (``model_status``), plus ``refused`` (today's
      refused calls) and ``limits`` ({``v6``, ``lag_aware``, ``daily_cap``, ``walls``: [{name, cap, detail}]});
    - ``curves``: per model, ``usage`` [[minute, cumulative settled tokens]] of today and ``syncs``
      [[synced_at, balance]] of today;
    - ``waiting`` and ``refused``: per model, calls waiting for room now and calls refused today;
    - ``by_tag``: per key of :data:`TAG_KEYS`, today's rows {key, calls, blocked_calls, settled_tokens,
      cost_micro_cny} by the tag's value;
    - ``sessions``: today's runs (``session_rows``);
    - ``budgets``: the ledger's budgets in their current periods (``BudgetUse.as_json``, plus ``name``, the
      budget's id, and ``limit`` for the page): used, in flight, left, when each resets;
    - ``unguarded_processes``: processes of live runs outside the guard (``unguarded_now``).
    """
    from ..support.events import waiting_now
    from .report import aggregate

    day = quota.beijing_day(now)
    # the events directory holds the logs of every store's runs on this host: this store's runs of the last day
    runs = {run.run_id for run in ledger.runs(since=now - HISTORY_S)} if events_dir is not None else set()
    waiting = waiting_now(events_dir, runs=runs) if events_dir is not None else {}
    for model, count in ledger.waiting(now).items():  # the ledger's lines: every run and host
        waiting[model] = max(count, waiting.get(model, 0))
    recent = ledger.call_records(since=now - HISTORY_S)  # the last 24 h: all of today
    rows = model_status(ledger, settings, now, waiting=waiting, recent=recent)
    today = [record for record in recent if record.day == day]
    refused = {row["key"]: row["blocked_calls"] for row in aggregate(today, "model") if row["blocked_calls"]}
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for row in rows:
        row["refused"] = refused.get(row["model"], 0)
        row["limits"] = _limits(ledger, settings.quota, row["model"], day)
        curves[row["model"]] = {
            "usage": [[t, used] for t, used in ledger.usage_series(row["model"], day)],
            "syncs": [[t, balance] for t, balance in ledger.sync_history(row["model"], day)],
        }
    return {
        "now": now,
        "day": day,
        "seconds_to_reset": round(quota.seconds_to_beijing_midnight(now), 1),
        "models": rows,
        "curves": curves,
        "waiting": {model: count for model, count in sorted(waiting.items()) if count},
        "refused": refused,
        "by_tag": {key: _top(aggregate(today, f"tag:{key}")) for key in TAG_KEYS},
        "sessions": session_rows(ledger, quota.beijing_day_start(now), None),
        # named by id, as a refusal names it: a token and a money budget may share a selector and period
        "budgets": [
            {**use.as_json(), "name": use.budget.id, "limit": use.budget.amount} for use in ledger.budget_uses(now, "")
        ],
        "unguarded_processes": unguarded_now(events_dir, runs=runs) if events_dir is not None else [],
    }


def _limits(ledger: Ledger, settings: quota.QuotaSettings, model: str, day: str) -> dict[str, Any]:
    """Today's limits of one model: v6's (the balance taken as settled at the sync), the lag-aware one the
    guard enforces, and the soft-evict walls."""
    stored = ledger.snapshot(model)
    snapshot = stored if stored is not None and stored.day == day else None
    v6, _ = quota.effective_limit(snapshot, dataclasses.replace(settings, balance_lag_s=0.0), today=day)
    limits = quota.model_day_limits(snapshot, settings, today=day)
    return {
        "v6": v6,
        "lag_aware": next(limit.cap for limit in limits if limit.kind == "hold"),
        "daily_cap": settings.daily_cap,
        "walls": [{"name": w.name, "cap": w.cap, "detail": w.detail} for w in limits if w.kind == "wall"],
    }


_SUMS = ("calls", "blocked_calls", "settled_tokens", "cost_micro_cny")


def _top(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The :data:`TOP_ROWS` largest rows (``aggregate`` sorts them), the rest summed as ``(others)``."""
    kept = [{"key": row["key"], **{name: row[name] for name in _SUMS}} for row in rows[:TOP_ROWS]]
    rest = rows[TOP_ROWS:]
    if rest:
        kept.append({"key": "(others)", **{name: sum(row[name] for row in rest) for name in _SUMS}})
    return kept


def current_status(ledger: Ledger, settings: Settings, *, events_dir: str | None = None) -> dict[str, Any]:
    """``status_snapshot`` now, as ``quotawrap status`` reads it: on the ledger's clock (on Redis the server's, so
    a host whose clock is off shows the ledger's day), with the holds of dead runs charged first."""
    from ..ledger.base import ledger_clock

    now = ledger_clock(ledger)()
    ledger.reclaim_orphans(now)
    return status_snapshot(ledger, settings, now, events_dir=events_dir)


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, quota.BEIJING).strftime("%m-%d %H:%M")


def render_status(rows: list[dict[str, Any]]) -> str:
    from .report import anomalous_line, bound_line

    if not rows:
        return "quotawrap: the ledger has no models yet (no guarded call, no balance sync)."
    lines = []
    for row in map(_shown, rows):
        state = f"EVICTED ({row['evicted_by']})" if row["evicted"] else "open"
        lines.append(f"{row['model']}  [{state}]  Beijing day {row['day']}")
        lines.append(
            f"  usage {row['usage']:,} + in flight {row['in_flight']:,} of limit {row['effective_limit']:,}"
            f" (bound by {row['binding']}; headroom {row['headroom']:,})"
        )
        lines.append(f"  limit: {row['limit_detail']}")
        if row.get("anomalous_calls"):
            lines.append(f"  today: {anomalous_line(row['anomalous_calls'])}")
        if row.get("waiting"):
            lines.append(
                f"  {row['waiting']} call(s) waiting for room in line, every run and host"
                " (holds in flight must settle first)"
            )
        learned = (
            "none learned yet"
            if row.get("reasoning_p99") is None
            else f"learned reasoning p99 {row['reasoning_p99']:,}"
        )
        ceiling = f"{row['reasoning_ceiling']:,}" + (
            "" if row["reasoning_ceiling_known"] else " (unknown model: the largest documented)"
        )
        lines.append(
            f"  {learned}: a call that may think and sets no bound goes out with max_completion_tokens"
            f" {row['output_allowance']:,} (fitted to the cap's room); one that sets max_tokens reserves it +"
            + (
                f" the reasoning ceiling {ceiling}"
                if row["reasoning_reserve"] == "ceiling"
                else " the learned p99"
                if row["reasoning_reserve"] == "learned"
                else " nothing more (sent as max_completion_tokens)"
            )
            + f" (--reasoning-reserve {row['reasoning_reserve']})"
        )
        if row.get("bounded_calls"):
            lines.append(f"  today: {bound_line(row['bounded_calls'], row['cut_by_bound_calls'])}")
        if row["evicted"]:
            lines.append(f"  evicted: {row['evicted_detail']}")
        if row["balance_known"]:
            lines.append(
                f"  balance at sync {row['balance_at_sync']:,} ({row['sync_source']}, "
                f"{row['sync_age_s'] / 60:,.1f} min ago)"
            )
        else:
            lines.append("  balance: unknown today, so this model is guarded by its daily cap alone")
        for package in row["expiring_within_9_days"]:
            lines.append(f"  package of {package['available']:,} expires {_when(package['expires_at'])}")
        if row["keep_alive_advice"]:
            lines.append(f"  {row['keep_alive_advice']}")
        for task in row.get("open_video_tasks", []):
            lines.append(
                f"  video task {printable(task['task_id'])} holds {task['held']:,} since {_when(task['since'])}"
                " (settled when a poll sees it end; charged in full if none does)"
            )
        hours, rest = divmod(int(row["seconds_to_reset"]), 3600)
        lines.append(f"  resets at Beijing midnight in {hours}h{rest // 60:02d}m")
    return "\n".join(lines)


def unguarded_now(
    directory: str | os.PathLike[str], *, max_age_s: float = 86_400.0, runs: Collection[str] | None = None
) -> list[dict[str, Any]]:
    """Processes of live runs that run without quotawrap's hook, as each run's wrapper found them
    (``registry.publish_unguarded``, in the events logs of ``directory``, of ``runs`` alone when given;
    the command is redacted).

    A run's events log goes when its wrapper ends; one a dead wrapper left behind is not a live run."""
    from ..support.events import recent_logs

    found: list[dict[str, Any]] = []
    for run_id, events in recent_logs(directory, max_age_s, runs=runs):
        for event in events:
            if not isinstance(event, dict) or event.get("ev") != "unguarded":
                continue
            wrapper = event.get("wrapper_pid")
            if not isinstance(wrapper, int) or not pid_alive(wrapper):
                break  # every event of a log has the same wrapper
            found.append(
                {
                    "session": run_id,
                    "pid": event.get("pid"),
                    "command": str(event.get("command", "")),
                    "reason": str(event.get("reason", "")),
                    "stopped": bool(event.get("stopped")),
                }
            )
    return found


def render_unguarded(found: list[dict[str, Any]]) -> list[str]:
    if not found:
        return []
    lines = ["running sessions with processes outside the guard (their LLM calls are NOT guarded):"]
    for process in map(_shown, found):
        what = "stopped by --strict" if process["stopped"] else process["reason"]
        lines.append(f"  session {process['session']}: pid {process['pid']} ({process['command']}): {what}")
    return lines


def expiry_warnings(ledger: Ledger, settings: Settings, now: float) -> list[str]:
    """One line per model this run may use whose packages expire within ``expiry_warning_days``.

    Said at the start of a run: the cure (use, or ``quotawrap consume``) is only possible before
    the expiry, and a guarded agent is the moment someone looks.
    """
    from ..core.endpoints import model_matches
    from ..core.identity import canonical

    window = settings.expiry_warning_days
    lines = []
    patterns = [canonical(pattern) for pattern in settings.model]  # as the ledger keys models
    for model in ledger.known_models():
        if patterns and not model_matches(model, patterns):
            continue
        for advice in keep_alive_daily_usage(ledger.packages(model), now, window, settings.daily_cap):
            lines.append(
                f"{model}: {advice.expiring_tokens:,} free tokens in {len(advice.expiring)} package(s) expire"
                f" within {window:g} days (first {_when(advice.first_expiry_at)} Beijing); {advice.text()},"
                " or run `quotawrap consume`"
            )
    return lines


def session_state(run: RunRecord, host: str | None = None) -> str:
    """``exit N``; ``running``; or ``wrapper died`` once a local wrapper's pid is gone (SIGKILL, power)."""
    if run.exit_code is not None:
        return f"exit {run.exit_code}"
    pid = run.tags.get(WRAPPER_PID_TAG, "")
    if pid.isdigit() and run.tags.get(WRAPPER_HOST_TAG) == (host or socket.gethostname()) and not pid_alive(int(pid)):
        return "wrapper died"
    return "running"


def session_rows(ledger: Reader, since: float | None, until: float | None) -> list[dict[str, Any]]:
    """``quotawrap sessions``: each run with its state, its command (secrets hidden) and its totals."""
    from ..core.redact import redact_command_line
    from .report import aggregate

    totals = {row["key"]: row for row in aggregate(ledger.call_records(since=since, until=until), "session")}
    rows = []
    for run in ledger.runs(since=since, until=until):
        row = totals.get(run.run_id, {})
        rows.append(
            {
                "session": run.run_id,
                "started_at": run.started_at,
                "ended_at": run.ended_at,
                "exit_code": run.exit_code,
                "state": session_state(run),
                "command": redact_command_line(run.command),  # ledgers written before redaction too
                "tags": dict(run.tags),
                "calls": row.get("calls", 0),
                "blocked_calls": row.get("blocked_calls", 0),
                "settled_tokens": row.get("settled_tokens", 0),
                "cost_micro_cny": row.get("cost_micro_cny", 0),
            }
        )
    return rows


def render_sessions(rows: list[dict[str, Any]]) -> str:
    import time

    from ..core.money import format_cny

    if not rows:
        return "no sessions in that range"
    return "\n".join(
        f"{row['session']}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(row['started_at']))}  {row['state']}"
        f"  {row['calls']} calls  {row['blocked_calls']} blocked  {row['settled_tokens']:,} tokens"
        f"  {format_cny(row['cost_micro_cny'])}  {row['command'][:60]}"
        for row in map(_shown, rows)
    )


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    """A row whose text cells (model names, commands, provider words) are escaped for the terminal."""
    return {key: printable(value) if isinstance(value, str) else value for key, value in row.items()}


def no_balance_today(ledger: CallPath, settings: Settings, now: float) -> bool:
    """Whether a guarded model has no balance snapshot of today's Beijing day (or the store cannot say)."""
    from ..core.errors import QuotawrapError
    from .sync import candidate_models

    today = quota.beijing_day(now)
    try:
        snapshots = [ledger.snapshot(model) for model in candidate_models(ledger, settings)]
    except QuotawrapError:
        return True
    return not snapshots or any(snapshot is None or snapshot.day != today for snapshot in snapshots)
