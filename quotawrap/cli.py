"""The ``quotawrap`` command.

``quotawrap [OPTIONS] -- COMMAND [ARGS...]`` runs COMMAND guarded (the implicit ``run``
subcommand); the other subcommands inspect and maintain the ledger.

Exit codes: the child's own code (128+N when it died of signal N); 2 usage or configuration
error; 3 ``--fail-on-block`` and a call was blocked; 4 the ledger could not be opened;
127 the command was not found.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import click

from ._errors import EXIT_STORE, EXIT_USAGE, ConfigError, QuotawrapError, StoreError, exit_code, with_cure
from .settings import OPTIONS, Option, Settings, env_name, load_config_file, parse_value

__all__ = ["EXIT_BLOCKED", "EXIT_NOT_FOUND", "EXIT_STORE", "EXIT_USAGE", "cli", "main"]

EXIT_BLOCKED = 3
EXIT_NOT_FOUND = 127

F = Callable[..., Any]


def _click_option(option: Option) -> Callable[[F], F]:
    flag = option.cli_flag
    common: dict[str, Any] = {"envvar": env_name(option.name), "help": option.help, "show_envvar": True}
    if option.type is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", option.name, default=None, **common)
    if option.multiple:
        # Its variable is read in _settings, not by click (which would split it on whitespace).
        help_text = f"{option.help} [env var: {env_name(option.name)}, comma-separated or a JSON list]"
        return click.option(flag, option.name, multiple=True, type=str, help=help_text)
    return click.option(flag, option.name, type=option.type, default=None, **common)


def settings_options(names: Sequence[str] | None = None) -> Callable[[F], F]:
    """Decorate a command with the flags of these options (all when None), from the one table."""
    chosen = [option for option in OPTIONS if names is None or option.name in names]

    def decorate(func: F) -> F:
        for option in reversed(chosen):
            func = _click_option(option)(func)
        return func

    return decorate


def _settings(values: dict[str, Any]) -> Settings:
    """Settings from click's values; a repeatable option not given as a flag comes from its variable."""
    ctx = click.get_current_context(silent=True)
    for option in OPTIONS:
        if not option.multiple or option.name not in values:
            continue
        given = ctx is not None and ctx.get_parameter_source(option.name) == click.core.ParameterSource.COMMANDLINE
        if not given:
            raw = os.environ.get(env_name(option.name))
            if raw is not None:
                try:
                    values[option.name] = parse_value(option, raw)
                except ConfigError as exc:
                    _fail(str(exc), EXIT_USAGE)
    try:
        return Settings.from_values(values)
    except ConfigError as exc:  # every option's rule, checked before anything starts
        _fail(str(exc), EXIT_USAGE)


def _fail(message: str, code: int) -> NoReturn:
    from .redact import redact_text  # store errors quote their URL; its password stays out of the terminal

    click.echo(f"quotawrap: {redact_text(message)}", err=True)
    sys.exit(code)


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _open(settings: Settings) -> Any:
    from .ledger import default_store_url, normalize_store_url, open_ledger

    url = settings.store or default_store_url()
    if url.startswith(REDIS_SCHEMES) and importlib.util.find_spec("redis") is None:
        _fail("the Redis store needs the redis package: pip install 'quotawrap[redis]'", EXIT_STORE)
    try:
        return open_ledger(normalize_store_url(url))
    except QuotawrapError as exc:
        _fail(f"{with_cure(exc)}; the ledger was left untouched", exit_code(exc))


class _DefaultRunGroup(click.Group):
    """Anything that is not a subcommand name is the implicit ``run``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help", "--version")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultRunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quotawrap")
def cli() -> None:
    """Guard the LLM spend of a Python program: quotawrap [OPTIONS] -- COMMAND [ARGS...]"""


@cli.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@settings_options()
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run_command(command: tuple[str, ...], **values: Any) -> None:
    """Run COMMAND with every guarded LLM call reserved before and reconciled after."""
    from ._log import warn
    from .attribution import automatic_tags, merge_tags, parse_tags
    from .launcher import default_events_log, default_unguarded_log, nested_in, new_run_id, run_child
    from .ledger import default_store_url, normalize_store_url
    from .ledger.base import RunRecord
    from .redact import redact_argv
    from .report import append_step_summary, format_summary, read_unguarded, run_report, write_json
    from .status import WRAPPER_HOST_TAG, WRAPPER_PID_TAG, no_balance_today
    from .sync import SyncLoop, sync_source
    from .waiting import read_events

    settings = _settings(values)
    if not 0 <= settings.wait < float("inf"):
        _fail(f"--wait must be seconds >= 0 (0 refuses at once), got {settings.wait}", EXIT_USAGE)
    if settings.proxy:
        from .serve import without_hook

        without_hook()
    try:
        store = normalize_store_url(settings.store or default_store_url())
        tags = merge_tags(automatic_tags(), parse_tags(settings.tag))
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE)
    run_id = settings.run_id or new_run_id()
    settings = settings.replace(
        run_id=run_id,
        store=store,
        tag=tuple(f"{key}={value}" for key, value in tags.items()),
    )
    if settings.fail_open and not settings.unguarded_log:
        settings = settings.replace(unguarded_log=str(default_unguarded_log(run_id)))
    own_events_log = not settings.events_log  # ours to delete once the summary has read it
    if own_events_log:
        settings = settings.replace(events_log=str(default_events_log(run_id)))
    from .files import prepare_outputs

    if problem := prepare_outputs(settings):  # every file the run writes, checked before anything starts
        _fail(problem, EXIT_USAGE)
    ledger = _open(settings)
    nested = nested_in(settings)
    try:
        if not nested:  # a nested wrapper joins the outer run; its record is the outer wrapper's to write
            # the command says which program spent the money; its --api-key does not belong in the ledger
            wrapper = {WRAPPER_PID_TAG: str(os.getpid()), WRAPPER_HOST_TAG: socket.gethostname()}
            record = RunRecord(run_id, time.time(), command=shlex.join(redact_argv(command)), tags={**tags, **wrapper})
            ledger.start_run(record)
    except QuotawrapError as exc:
        if not settings.fail_open:
            _fail(f"{exc}; refusing to run unguarded (pass --fail-open to run anyway)", EXIT_STORE)
        warn(f"{exc}; --fail-open: running, and guarded calls go out UNGUARDED while the store is down")
    sync_loop = SyncLoop(ledger, settings) if sync_source(settings) else None
    if sync_loop is not None:
        if no_balance_today(ledger, settings, time.time()):
            sync_loop.tick()  # before the child's first call: until today's first sync, only the daily cap applies
        sync_loop.start()  # its first tick runs at once, beside the child's start
    if not settings.quiet:
        from .status import expiry_warnings

        with contextlib.suppress(QuotawrapError):  # a warning must not stop the run
            for line in expiry_warnings(ledger, settings, time.time()):
                warn(line)
    proxy = None
    child_options: dict[str, Any] = {}
    if settings.proxy:
        proxy, proxy_env = _start_proxy(settings, ledger)
        child_options = {"extra_env": proxy_env, "on_child_exit": proxy.stop}
    try:
        result = run_child(settings, command, ledger, **child_options)
    except FileNotFoundError:
        _fail(f"command not found: {command[0]}", EXIT_NOT_FOUND)
    except QuotawrapError as exc:
        _fail(with_cure(exc), exit_code(exc))
    finally:
        if proxy is not None:
            proxy.stop()
        if sync_loop is not None:
            sync_loop.stop()
    if not nested:
        with contextlib.suppress(QuotawrapError):  # already reported by run_child when the store is down
            ledger.end_run(run_id, result.exit_code, time.time())
    _auto_prune(ledger, settings)
    report = run_report(
        result.totals,
        settings=settings,
        exit_code=result.exit_code,
        tags=tags,
        unguarded=read_unguarded(settings.unguarded_log),
        store_error=result.store_error,
        unguarded_processes=[process.as_dict() for process in result.unguarded_processes],
        connections=result.connections,
        events=read_events(settings.events_log),
    )
    if own_events_log and settings.events_log:
        with contextlib.suppress(OSError):
            os.unlink(settings.events_log)
    if not settings.quiet:
        if nested:
            click.echo(f"quotawrap: nested in run {run_id}: the totals below are that whole run's so far", err=True)
        click.echo(format_summary(report), err=True)
    try:
        if settings.report_json:
            write_json(report, settings.report_json)
        if os.environ.get("GITHUB_STEP_SUMMARY"):
            append_step_summary(os.environ["GITHUB_STEP_SUMMARY"], report)
    except OSError as exc:  # checked at start, so only a disk that filled or changed meanwhile
        warn(f"cannot write the run's report: {exc}")
    if settings.fail_on_block and report["totals"]["blocked_calls"]:
        sys.exit(EXIT_BLOCKED)
    sys.exit(result.exit_code)


def _start_proxy(settings: Settings, ledger: Any) -> tuple[Any, dict[str, str]]:
    """``--proxy``: the run's gateway, started, and the child's variables pointing at it."""
    try:
        from .serve._runner import start_proxy
    except ImportError as exc:
        from .serve import MISSING_EXTRA

        _fail(f"--proxy: {MISSING_EXTRA} ({exc.name} is not installed)", EXIT_USAGE)
    try:
        return start_proxy(settings, ledger)
    except OSError as exc:
        _fail(f"--proxy: cannot start the gateway on loopback: {exc}", EXIT_USAGE)
    raise AssertionError("unreachable")


_SERVE_OPTIONS = [option.name for option in OPTIONS if option.name not in ("proxy", "report_json", "fail_on_block")]


@cli.command("serve")
@settings_options(_SERVE_OPTIONS)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8790, show_default=True, type=int, help="Port (0: any free port).")
def serve_command(host: str, port: int, **values: Any) -> None:
    """Serve a guarded OpenAI/Ark-compatible gateway: calls from any language, one Guard and ledger.

    It forwards to the first --base-url (else Ark), reserving and settling every billed call
    exactly as the in-process hook does; SIGTERM drains calls in flight, settles them, and exits.
    """
    from .serve import without_hook

    without_hook()
    try:
        from .serve._command import prepare, serve
    except ImportError as exc:
        from .serve import MISSING_EXTRA

        _fail(f"serve: {MISSING_EXTRA} ({exc.name} is not installed)", EXIT_USAGE)
    try:
        settings = prepare(_settings(values))
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE)
    ledger = _open(settings)
    try:
        serve(settings, ledger, host=host, port=port, say=click.echo)
    except StoreError as exc:
        _fail(f"{exc}; the gateway cannot guard without its ledger (pass --fail-open to serve anyway)", EXIT_STORE)
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        _fail(f"serve: cannot listen on {host}:{port}: {exc.strerror or exc}", EXIT_USAGE)


def _auto_prune(ledger: Any, settings: Settings) -> None:
    """The ledger's retention bound, at a run's end and at most once a day (``--retention``)."""
    from ._log import warn
    from .retention import auto_prune, describe

    try:
        result = auto_prune(ledger, settings.retention, time.time())
    except ConfigError as exc:
        warn(f"--retention: {exc}; nothing was pruned")
        return
    except QuotawrapError as exc:  # the run is over and guarded; a prune that failed waits for the next day
        warn(f"automatic prune failed ({exc}); run `quotawrap prune --older-than {settings.retention}`")
        return
    if result is not None and result.calls and not settings.quiet:
        warn(f"retention {settings.retention}: {describe(result)}")


@cli.command("simulate")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=0, type=int, help="Port (0: any free port).")
@click.option("--latency", "latency_s", type=float, default=None, help="Seconds before the first byte.")
@click.option("--chunk-delay", "chunk_delay_s", type=float, default=None, help="Seconds between stream chunks.")
@click.option("--reply-tokens", type=int, default=None, help="Answer tokens per call.")
@click.option("--reasoning-tokens", type=int, default=None, help="Reasoning tokens per call (0: no thinking).")
def simulate_command(host: str, port: int, **overrides: Any) -> None:
    """Serve a local Ark-compatible API (chat, responses, embeddings, billing) for offline runs."""
    import dataclasses

    from .simulator import SimConfig, run_forever, serve

    config = dataclasses.replace(SimConfig(), **{k: v for k, v in overrides.items() if v is not None})
    run_forever(serve(host=host, port=port, config=config))


@cli.command("demo")
@click.option("--model", default="deepseek-v4-flash", show_default=True)
@click.option("--cap-tokens", default=20_000, show_default=True, type=int)
@click.option("--calls", default=24, show_default=True, type=int, help="Parallel calls the demo agent makes.")
@settings_options(["store"])
def demo_command(model: str, cap_tokens: int, calls: int, store: str | None) -> None:
    """Run examples/agent.py guarded: against Ark when ARK_API_KEY is set, else the bundled simulator."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    # a checkout has examples/ beside the package; a wheel carries a copy inside it
    agent = next(p for p in (here.parent / "examples" / "agent.py", here / "_demo" / "agent.py") if p.is_file())
    base = [sys.executable, "-m", "quotawrap", "--model", model, "--cap-tokens", str(cap_tokens)]
    if store:
        base += ["--store", store]
    env = {**os.environ, "DEMO_MODEL": model, "DEMO_CALLS": str(calls)}
    if os.environ.get("ARK_API_KEY"):
        sys.exit(subprocess.call([*base, "--", sys.executable, str(agent)], env=env))
    from .simulator import serve

    with serve() as sim:
        click.echo(f"quotawrap demo: no ARK_API_KEY, using the bundled Ark simulator at {sim.url}", err=True)
        env.update(ARK_BASE_URL=sim.url, ARK_API_KEY="simulated")
        code = subprocess.call([*base, "--base-url", sim.url, "--", sys.executable, str(agent)], env=env)
        click.echo(f"quotawrap demo: the simulator billed {sim.billed_total():,} tokens", err=True)
    sys.exit(code)


@cli.command("status")
@settings_options(
    [
        "store",
        "daily_cap",
        "small_buffer",
        "usage_wall",
        "balance_wall",
        "balance_lag",
        "model",
        "thinking_floor",
        "default_max_tokens",
    ]
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_command(as_json: bool, **values: Any) -> None:
    """Per model: today's usage, in flight, waiting, the effective limit and what binds it."""
    from .launcher import default_events_log
    from .status import model_status, render_status
    from .waiting import waiting_now

    settings = _settings(values)
    ledger = _open(settings)
    ledger.reclaim_orphans(time.time())
    waiting = waiting_now(default_events_log("any").parent)
    rows = model_status(ledger, settings, time.time(), waiting=waiting)
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
    else:
        click.echo(render_status(rows))


def _time_bound(value: str | None) -> float | None:
    """``--since/--until``: an ISO date or datetime (Beijing time unless it says otherwise), or ``-2d``/``-6h``."""
    if value is None:
        return None
    from datetime import datetime

    from .quota import BEIJING

    text = value.strip()
    if text.startswith("-") and text[-1:] in ("d", "h", "m") and text[1:-1].isdigit():
        seconds = int(text[1:-1]) * {"d": 86_400, "h": 3_600, "m": 60}[text[-1]]
        return time.time() - seconds
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"{value!r}: use YYYY-MM-DD, YYYY-MM-DDTHH:MM or -7d / -12h") from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=BEIJING)).timestamp()


@cli.command("report")
@settings_options(["store"])
@click.option("--by", default="model", show_default=True, help="model, session, day or tag:KEY (e.g. tag:user).")
@click.option("--since", default=None, help="Start: YYYY-MM-DD[THH:MM] (Beijing) or -7d / -12h.")
@click.option("--until", default=None, help="End (exclusive), same forms.")
@click.option("--session", "session", default=None, help="Only this session (run id).")
@click.option("--audit-log", "audit_path", default=None, help="Read this JSONL audit log instead of the ledger.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
def report_command(
    by: str, since: str | None, until: str | None, session: str | None, audit_path: str | None, fmt: str, **values: Any
) -> None:
    """Who spent what: guarded calls grouped by model, session, day or any tag."""
    from .audit import aggregate, read_jsonl, render_csv, render_table
    from .report import ledger_rows

    start, end = _time_bound(since), _time_bound(until)
    try:
        if audit_path:
            records = [
                r
                for r in read_jsonl(audit_path)
                if (start is None or r.started_at >= start)
                and (end is None or r.started_at < end)
                and (session is None or r.run_id == session)
            ]
        else:
            rows = ledger_rows(_open(_settings(values)), by, since=start, until=end, session=session)
        if audit_path:
            rows = aggregate(records, by)
    except QuotawrapError as exc:
        _fail(with_cure(exc), exit_code(exc))
    if fmt == "json":
        click.echo(json.dumps({"by": by, "rows": rows}, indent=2))
    elif fmt == "csv":
        click.echo(render_csv(rows), nl=False)
    else:
        click.echo(render_table(rows, by))


@cli.command("sessions")
@settings_options(["store"])
@click.option("--since", default=None, help="Start: YYYY-MM-DD[THH:MM] (Beijing) or -7d / -12h.")
@click.option("--until", default=None, help="End (exclusive), same forms.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sessions_command(since: str | None, until: str | None, as_json: bool, **values: Any) -> None:
    """Runs with their totals, newest last."""
    from .status import render_sessions, session_rows

    ledger = _open(_settings(values))
    rows = session_rows(ledger, _time_bound(since), _time_bound(until))
    click.echo(json.dumps(rows, indent=2) if as_json else render_sessions(rows))


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


@cli.command("sync")
@settings_options(_SYNC_OPTIONS)
@click.option("--balance", "balances", multiple=True, metavar="MODEL=N", help="The console's free balance now.")
@click.option(
    "--b0",
    "b0s",
    multiple=True,
    metavar="MODEL=N",
    help="The console's initial balance of today (B0, before any use); see docs/quota-math.md.",
)
@click.option("--loop", is_flag=True, help="Keep syncing on the cadence (a daemon).")
@click.option("--calibrate", is_flag=True, help="Estimate the billing lag from the stored sync history.")
@click.option("--days", default=7, show_default=True, help="Days of history --calibrate looks at.")
def sync_command(
    balances: tuple[str, ...], b0s: tuple[str, ...], loop: bool, calibrate: bool, days: int, **values: Any
) -> None:
    """Record the free balance per model (manual, command or billing API) as today's snapshot."""
    from . import quota
    from .balance import parse_balance_args
    from .sync import SyncLoop, record_b0, record_balance, sync_once
    from .sync import calibrate as calibrate_lag

    settings = _settings(values)
    ledger = _open(settings)
    now = time.time()
    try:
        if calibrate:
            day_list = [quota.beijing_day(now - n * quota.DAY_S) for n in range(days)]
            for model in ledger.known_models():
                try:
                    lag, spread = calibrate_lag(ledger, model, day_list)
                except ValueError as exc:
                    click.echo(f"{model}: {exc}")
                    continue
                click.echo(f"{model}: billing lag ~{lag / 60:.0f} min (spread {spread:,.0f} tokens)")
            return
        if balances and b0s:
            _fail("give either --balance (the balance now) or --b0 (today's initial balance), not both", EXIT_USAGE)
        if balances:
            for model, balance in parse_balance_args(balances).items():
                snap = record_balance(ledger, model, balance, now, settings.quota, source="manual", settled=True)
                click.echo(f"{model}: balance {snap.balance:,} at usage {snap.usage_at_sync:,} recorded")
            return
        if b0s:
            for model, b0 in parse_balance_args(b0s, "--b0").items():
                snap = record_b0(ledger, model, b0, now)
                click.echo(
                    f"{model}: initial balance {b0:,} recorded (pool {quota.pool_estimate(snap, settings.quota):,}"
                    f" at usage {snap.usage_at_sync:,})"
                )
            return
        if loop:
            sync_loop = SyncLoop(ledger, settings, on_error=lambda m: click.echo(m, err=True))
            click.echo("quotawrap sync: looping; Ctrl-C to stop", err=True)
            try:
                while True:
                    for model, snap in sync_loop.tick().items():
                        click.echo(f"{model}: balance {snap.balance:,} synced ({snap.source})")
                    time.sleep(sync_loop.check_every_s)
            except KeyboardInterrupt:
                return
        for model, snap in sync_once(ledger, settings, now).items():
            click.echo(f"{model}: balance {snap.balance:,} at usage {snap.usage_at_sync:,} ({snap.source})")
    except QuotawrapError as exc:
        _fail(with_cure(exc), exit_code(exc))


_CONSUME_OPTIONS = [
    "store",
    "model",
    "base_url",
    "daily_cap",
    "small_buffer",
    "balance_lag",
    "balance_cmd",
    "billing_endpoint",
    "package_match",
    "hold_ttl",
    "report_json",
    "quiet",
]


@cli.command("consume")
@settings_options(_CONSUME_OPTIONS)
@click.option("--dry-run", is_flag=True, help="Print each model's plan and spend nothing.")
@click.option("--force", is_flag=True, help="Run even if consume already ran today (the day's lease is taken).")
@click.option("--at", "at", default=None, metavar="HH:MM", help="Wait until this Beijing time first.")
@click.option("--max-tokens-per-call", default=16_384, show_default=True, type=click.IntRange(256))
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 64), help="Calls at once.")
@click.option(
    "--stop-before",
    default=10.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Minutes before Beijing midnight to stop.",
)
@click.option(
    "--max-errors", default=5, show_default=True, type=click.IntRange(1), help="Stop after this many errors in a row."
)
def consume_command(
    dry_run: bool,
    force: bool,
    at: str | None,
    max_tokens_per_call: int,
    concurrency: int,
    stop_before: float,
    max_errors: int,
    **values: Any,
) -> None:
    """Spend what is left of today's free collection through guarded calls (the seed's 23:20 task)."""
    from . import quota
    from ._log import warn
    from .consume import DEFAULT_BASE_URL, ConsumeOptions, consume_models, execute, make_plans
    from .consume_plan import parse_at, render_plan, seconds_until
    from .sync import sync_once, sync_source

    settings = _settings(values)
    api_key = os.environ.get("ARK_API_KEY", "")
    if not api_key and not dry_run:
        _fail("consume calls Ark itself: set ARK_API_KEY", EXIT_USAGE)
    base_url = settings.base_url[0] if settings.base_url else os.environ.get("ARK_BASE_URL") or DEFAULT_BASE_URL
    try:
        wait = seconds_until(time.time(), *parse_at(at)) if at else 0.0
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)

    def say(line: str) -> None:
        if not settings.quiet:
            click.echo(f"quotawrap consume: {line}", err=True)

    if wait > 0 and not dry_run:
        say(f"waiting until {at} Beijing time ({wait / 60:,.0f} min)")
        try:
            time.sleep(wait)
        except KeyboardInterrupt:
            _fail("consume interrupted while waiting for --at; nothing spent", 130)
    ledger = _open(settings)
    now = time.time()
    day = quota.beijing_day(now)
    if sync_source(settings):
        try:
            sync_once(ledger, settings, now)
        except QuotawrapError as exc:
            warn(f"balance sync failed ({exc}); planning on the stored snapshot")
    models = consume_models(ledger, settings, day)
    if not models:
        _fail("no model to consume: pass --model, or sync a balance today (`quotawrap sync`)", EXIT_USAGE)
    if dry_run:
        for plan in make_plans(ledger, settings, models, now):
            click.echo(render_plan(plan))
        return
    options = ConsumeOptions(
        api_key=api_key,
        base_url=base_url,
        max_tokens_per_call=max_tokens_per_call,
        concurrency=concurrency,
        stop_before_s=stop_before * 60,
        max_errors=max_errors,
        force=force,
    )
    try:
        code = execute(ledger, settings, options, models, say=say, shout=lambda line: click.echo(line, err=True))
    except QuotawrapError as exc:
        _fail(str(exc), EXIT_STORE)
    sys.exit(code)


@cli.command("prune")
@settings_options(["store"])
@click.option("--older-than", required=True, metavar="DURATION", help="Prune whole days older than this: 90d, 12h.")
@click.option("--dry-run", is_flag=True, help="Say what would be pruned and change nothing.")
def prune_command(older_than: str, dry_run: bool, **values: Any) -> None:
    """Fold calls older than DURATION into daily aggregates and delete them (reports stay right)."""
    from .retention import cutoff_day, describe, parse_duration

    try:
        seconds = parse_duration(older_than)
    except ConfigError as exc:
        _fail(f"--older-than: {exc}", EXIT_USAGE)
    if seconds is None:
        _fail("--older-than: give a duration such as 90d or 12h ('off' is for --retention)", EXIT_USAGE)
        return
    ledger = _open(_settings(values))
    try:
        result = ledger.prune(cutoff_day(time.time(), seconds), dry_run=dry_run)
    except QuotawrapError as exc:
        _fail(f"{exc}; nothing of the day being pruned was lost (one day is one transaction)", EXIT_STORE)
    click.echo(describe(result))


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = load_config_file()
        default_map = {
            name: config for name in ("run", "serve", "status", "sync", "report", "sessions", "consume", "prune")
        }
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE)
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="quotawrap", default_map=default_map)
    except QuotawrapError as exc:  # any subcommand: one line naming the cure, never a traceback
        _fail(with_cure(exc), exit_code(exc))
