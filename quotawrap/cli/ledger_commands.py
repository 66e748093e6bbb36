"""The subcommands that read and maintain the ledger: ``status``, ``dashboard``, ``report``, ``sessions``,
``sync`` and ``prune``. :mod:`quotawrap.cli` adds them to the command group.

Each parses its flags and delegates the work to the module that owns it (status, report,
audit, sync, retention); what is left here is the terminal: output and one-line failures.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import click

from ..core.errors import EXIT_STORE, EXIT_USAGE, QuotawrapError, exit_code, with_cure
from ..ledger import open_store
from ..support.log import fail
from .common import command_settings, echo, settings_options

__all__ = ["COMMANDS"]


# What status and the dashboard show depends on these: the store, and the settings of the limits they explain.
_STATUS_OPTIONS = [
    "store",
    "daily_cap",
    "small_buffer",
    "usage_wall",
    "balance_wall",
    "balance_lag",
    "model",
    "thinking_floor",
    "default_max_tokens",
    "reasoning_reserve",
]


@click.command("status")
@settings_options(_STATUS_OPTIONS)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_command(as_json: bool, **values: Any) -> None:
    """Per model: tokens used today, in flight and waiting, the limit that applies now and why."""
    from ..books.status import current_status, render_status, render_unguarded
    from ..config.paths import default_events_log
    from ..core.budgets import BudgetUse

    settings = command_settings(values)
    ledger = open_store(settings)
    # the waits and processes outside the guard of this host's runs, from their events logs
    snapshot = current_status(ledger, settings, events_dir=os.path.dirname(default_events_log("any")))
    rows, unguarded = snapshot["models"], snapshot["unguarded_processes"]
    budgets = [
        BudgetUse.from_json(row) for row in snapshot["budgets"]
    ]  # the ledger's own (a run's own are its summary's)
    if as_json:
        for row in rows:  # the list of model rows stays the output's shape; like the reset time, same in each
            row["unguarded_processes"] = unguarded
            row["budgets"] = snapshot["budgets"]
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
    else:
        shown = ["budgets:", *(f"  {use.line()}" for use in budgets)] if budgets else []
        echo("\n".join([render_status(rows), *shown, *render_unguarded(unguarded)]))


@click.command("dashboard")
@settings_options(_STATUS_OPTIONS)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8791, show_default=True, type=click.IntRange(0, 65535), help="Port (0: any free port).")
def dashboard_command(host: str, port: int, **values: Any) -> None:
    """A local web page of what status shows, updating by itself: open the address it prints."""
    from ..config.paths import default_events_log
    from ..dashboard.pages import Pages, store_reader
    from ..dashboard.server import DashboardServer, warn_if_exposed

    settings = command_settings(values)
    ledger = open_store(settings)
    read = store_reader(ledger, settings, os.path.dirname(default_events_log("any")))
    pages = Pages(read, extra=_metrics_page(read))
    try:
        server = DashboardServer(pages, host, port)
    except OSError as exc:
        fail(f"dashboard: cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port", EXIT_USAGE)
    warn_if_exposed("dashboard", host)
    server.serve_until_stopped(lambda url: echo(f"quotawrap dashboard on {url} (Ctrl-C to stop)"))


def _metrics_page(read: Any) -> dict[str, Any]:
    """``/metrics`` beside the page, when prometheus-client is installed (the serve extra)."""
    try:
        from ..books.metrics import Exposition
    except ImportError:
        return {}
    return {"metrics": Exposition(read)}


def _time_bound(value: str | None, flag: str) -> float | None:
    """``--since/--until``: an ISO date or datetime (Beijing time unless it says otherwise), or ``-2d``/``-30m``."""
    if value is None:
        return None
    from datetime import datetime

    from ..core.quota import BEIJING

    text = value.strip()
    forms = f"{value!r}: use YYYY-MM-DD, YYYY-MM-DDTHH:MM (Beijing time) or a time ago: -7d, -12h, -30m"
    if text.startswith("-"):
        from ..core.durations import parse_duration

        try:
            return time.time() - parse_duration(text[1:])
        except ValueError:
            raise click.BadParameter(forms, param_hint=flag) from None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(forms, param_hint=flag) from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=BEIJING)).timestamp()


@click.command("report")
@settings_options(["store"])
@click.option("--by", default="model", show_default=True, help="model, session, day or tag:KEY (e.g. tag:user).")
@click.option("--since", default=None, help="Start: YYYY-MM-DD[THH:MM] (Beijing) or -7d / -12h / -30m.")
@click.option("--until", default=None, help="End (exclusive), same forms.")
@click.option("--session", "session", default=None, help="Only this session (run id).")
@click.option(
    "--audit-log",
    "audit_path",
    default=None,
    help="Read this JSONL audit log (--audit-log of a run) instead of the store.",
)
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
def report_command(
    by: str, since: str | None, until: str | None, session: str | None, audit_path: str | None, fmt: str, **values: Any
) -> None:
    """Who spent what: guarded calls grouped by model, session, day or any tag."""
    from ..books.report import aggregate, ledger_rows, render_csv, render_table
    from ..core.budgets import BudgetUse
    from ..ledger.base import ledger_clock
    from ..settling.audit_log import read_jsonl

    start, end = _time_bound(since, "--since"), _time_bound(until, "--until")
    budgets: list[BudgetUse] = []  # the ledger's budgets now (an audit log keeps none)
    try:
        if audit_path:
            records = [
                r
                for r in read_jsonl(audit_path)
                if (start is None or r.started_at >= start)
                and (end is None or r.started_at < end)
                and (session is None or r.run_id == session)
            ]
            rows = aggregate(records, by)
        else:
            ledger = open_store(command_settings(values))
            rows = ledger_rows(ledger, by, since=start, until=end, session=session)
            budgets = ledger.budget_uses(ledger_clock(ledger)(), session or "")
    except QuotawrapError as exc:
        fail(with_cure(exc), exit_code(exc))
    if fmt == "json":
        click.echo(json.dumps({"by": by, "rows": rows, "budgets": [use.as_json() for use in budgets]}, indent=2))
    elif fmt == "csv":
        click.echo(render_csv(rows), nl=False)
    else:
        echo("\n".join([render_table(rows, by), *(use.line() for use in budgets)]))


@click.command("sessions")
@settings_options(["store"])
@click.option("--since", default=None, help="Start: YYYY-MM-DD[THH:MM] (Beijing) or -7d / -12h / -30m.")
@click.option("--until", default=None, help="End (exclusive), same forms.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sessions_command(since: str | None, until: str | None, as_json: bool, **values: Any) -> None:
    """Runs with their totals, newest last."""
    from ..books.status import render_sessions, session_rows

    start, end = _time_bound(since, "--since"), _time_bound(until, "--until")
    rows = session_rows(open_store(command_settings(values)), start, end)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        echo(render_sessions(rows))


_SYNC_OPTIONS = [
    "store",
    "model",
    "balance_lag",
    "balance_cmd",
    "billing_endpoint",
    "package_match",
    "sync_interval",
    "sync_interval_low",
    "low_balance",
    "sync_burst",
    "sync_check",
]


@click.command("sync")
@settings_options(_SYNC_OPTIONS)
@click.option(
    "--balance",
    "balances",
    multiple=True,
    metavar="MODEL=N",
    help="A model's free balance now, as the console shows it.",
)
@click.option(
    "--b0",
    "b0s",
    multiple=True,
    metavar="MODEL=N",
    help="A model's free balance at the start of today, before any use, as the console showed it.",
)
@click.option("--loop", is_flag=True, help="Keep syncing on the cadence (a daemon).")
@click.option(
    "--calibrate", is_flag=True, help="Estimate how far the balance runs behind usage (--balance-lag) from past reads."
)
@click.option("--days", default=7, show_default=True, help="Days of past reads --calibrate looks at.")
def sync_command(
    balances: tuple[str, ...], b0s: tuple[str, ...], loop: bool, calibrate: bool, days: int, **values: Any
) -> None:
    """Record each model's free token balance (typed in, --balance-cmd or the billing API) for today's limits."""
    from ..books.balance import parse_balance_args
    from ..books.sync import SyncLoop, record_b0, record_balance, sync_once
    from ..books.sync import calibrate as calibrate_lag
    from ..core import quota
    from ..ledger.base import ledger_clock

    settings = command_settings(values)
    ledger = open_store(settings)
    now = ledger_clock(ledger)()
    try:
        if calibrate:
            day_list = [quota.beijing_day(now - n * quota.DAY_S) for n in range(days)]
            for model in ledger.known_models():
                try:
                    lag, spread = calibrate_lag(ledger, model, day_list)
                except ValueError as exc:
                    echo(f"{model}: {exc}")
                    continue
                echo(f"{model}: billing lag ~{lag / 60:.0f} min (spread {spread:,.0f} tokens)")
            return
        if balances and b0s:
            fail("give either --balance (the balance now) or --b0 (today's initial balance), not both", EXIT_USAGE)
        if balances:
            for model, balance in parse_balance_args(balances).items():
                snap = record_balance(ledger, model, balance, now, settings.quota, source="manual", settled=True)
                echo(f"{model}: balance {snap.balance:,} at usage {snap.usage_at_sync:,} recorded")
            return
        if b0s:
            for model, b0 in parse_balance_args(b0s, "--b0").items():
                snap = record_b0(ledger, model, b0, now)
                echo(
                    f"{model}: initial balance {b0:,} recorded (pool {quota.pool_estimate(snap, settings.quota):,}"
                    f" at usage {snap.usage_at_sync:,})"
                )
            return
        if loop:
            sync_loop = SyncLoop(ledger, settings, on_error=lambda m: echo(m, err=True))
            click.echo("quotawrap sync: looping; Ctrl-C to stop", err=True)
            sync_loop.list_endpoints()
            try:
                while True:
                    for model, snap in sync_loop.tick().items():
                        echo(f"{model}: balance {snap.balance:,} synced ({snap.source})")
                    time.sleep(sync_loop.check_every_s)
            except KeyboardInterrupt:
                return
        for model, snap in sync_once(ledger, settings, now).items():
            echo(f"{model}: balance {snap.balance:,} at usage {snap.usage_at_sync:,} ({snap.source})")
        listing = SyncLoop(ledger, settings, on_error=lambda m: echo(m, err=True))
        for endpoint, model in sorted(listing.list_endpoints().items()):
            echo(f"{endpoint}: serves {model} (ark management API)")
    except QuotawrapError as exc:
        fail(with_cure(exc), exit_code(exc))


@click.command("prune")
@settings_options(["store"])
@click.option(
    "--older-than", required=True, metavar="DURATION", help="Prune whole days older than this: 90d, 12h, 30m."
)
@click.option("--dry-run", is_flag=True, help="Say what would be pruned and change nothing.")
def prune_command(older_than: str, dry_run: bool, **values: Any) -> None:
    """Fold calls older than DURATION into daily aggregates and delete them (reports stay right)."""
    from ..books.retention import cutoff_day, describe
    from ..core.durations import parse_duration

    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        fail(f"--older-than: {exc}", EXIT_USAGE)
    ledger = open_store(command_settings(values))
    try:
        result = ledger.prune(cutoff_day(time.time(), seconds), dry_run=dry_run)
    except QuotawrapError as exc:
        fail(f"{exc}; nothing of the day being pruned was lost (one day is one transaction)", EXIT_STORE)
    click.echo(describe(result))


COMMANDS = (status_command, dashboard_command, report_command, sessions_command, sync_command, prune_command)
