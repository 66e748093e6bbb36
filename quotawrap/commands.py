"""The ``quotawrap`` command group, for everything but a plain guarded run.

:mod:`quotawrap.cli` hands a plain ``quotawrap [OPTIONS] -- COMMAND`` straight to
:mod:`quotawrap.run` without loading click; whatever else (a subcommand, ``--help``, a run whose
arguments only click can judge) comes here. ``run`` is the implicit subcommand.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import click

from ._errors import EXIT_STORE, EXIT_USAGE, ConfigError, QuotawrapError, StoreError, exit_code, with_cure
from .cli_common import command_settings, fail, open_ledger, settings_options
from .ledger_commands import COMMANDS
from .settings import OPTIONS

__all__ = ["cli", "click_main"]


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


for _command in COMMANDS:  # status, report, sessions, sync, prune: defined beside the modules they drive
    cli.add_command(_command)


@cli.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@settings_options()
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run_command(command: tuple[str, ...], **values: Any) -> None:
    """Run COMMAND with every guarded LLM call reserved before and reconciled after."""
    from .run import run_guarded

    run_guarded(command_settings(values), command)


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

        fail(f"serve: {MISSING_EXTRA} ({exc.name} is not installed)", EXIT_USAGE)
    try:
        settings = prepare(command_settings(values))
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    ledger = open_ledger(settings)
    try:
        serve(settings, ledger, host=host, port=port, say=click.echo)
    except StoreError as exc:
        fail(f"{exc}; the gateway cannot guard without its ledger (pass --fail-open to serve anyway)", EXIT_STORE)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        fail(f"serve: cannot listen on {host}:{port}: {exc.strerror or exc}", EXIT_USAGE)


@cli.command("simulate")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=0, type=int, help="Port (0: any free port).")
@click.option("--latency", "latency_s", type=float, default=None, help="Seconds before the first byte.")
@click.option("--chunk-delay", "chunk_delay_s", type=float, default=None, help="Seconds between stream chunks.")
@click.option("--reply-tokens", type=int, default=None, help="Answer tokens per call.")
@click.option("--reasoning-tokens", type=int, default=None, help="Reasoning tokens per call (0: no thinking).")
@click.option(
    "--endpoint",
    "endpoints",
    multiple=True,
    metavar="ID=MODEL",
    help="Serve endpoint ID as foundation model MODEL (<name>-<version>); repeatable.",
)
def simulate_command(host: str, port: int, **overrides: Any) -> None:
    """Serve a local Ark-compatible API (chat, responses, embeddings, billing) for offline runs."""
    import dataclasses

    from .simulator import SimConfig, SimConfigError, run_forever, serve

    try:
        config = dataclasses.replace(SimConfig(), **{k: v for k, v in overrides.items() if v is not None})
    except SimConfigError as exc:
        fail(f"simulate: --endpoint {exc.message}", EXIT_USAGE)
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

    settings = command_settings(values)
    api_key = os.environ.get("ARK_API_KEY", "")
    if not api_key and not dry_run:
        fail("consume calls Ark itself: set ARK_API_KEY", EXIT_USAGE)
    base_url = settings.base_url[0] if settings.base_url else os.environ.get("ARK_BASE_URL") or DEFAULT_BASE_URL
    try:
        wait = seconds_until(time.time(), *parse_at(at)) if at else 0.0
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)

    def say(line: str) -> None:
        if not settings.quiet:
            click.echo(f"quotawrap consume: {line}", err=True)

    if wait > 0 and not dry_run:
        say(f"waiting until {at} Beijing time ({wait / 60:,.0f} min)")
        try:
            time.sleep(wait)
        except KeyboardInterrupt:
            fail("consume interrupted while waiting for --at; nothing spent", 130)
    ledger = open_ledger(settings)
    now = time.time()
    day = quota.beijing_day(now)
    if sync_source(settings):
        try:
            sync_once(ledger, settings, now)
        except QuotawrapError as exc:
            warn(f"balance sync failed ({exc}); planning on the stored snapshot")
    models = consume_models(ledger, settings, day)
    if not models:
        fail("no model to consume: pass --model, or sync a balance today (`quotawrap sync`)", EXIT_USAGE)
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
        fail(str(exc), EXIT_STORE)
    sys.exit(code)


def click_main(args: Sequence[str], config: dict[str, Any]) -> None:
    """Every command but the plain run (``quotawrap --help``, ``status``, a run click must parse)."""
    names = ("run", "serve", "status", "sync", "report", "sessions", "consume", "prune")
    default_map = {name: config for name in names}
    try:
        cli.main(args=list(args), prog_name="quotawrap", default_map=default_map)
    except QuotawrapError as exc:  # any subcommand: one line naming the cure, never a traceback
        fail(with_cure(exc), exit_code(exc))
