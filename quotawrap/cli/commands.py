"""The ``quotawrap`` command group, for everything but a plain guarded run.

:mod:`quotawrap.cli` hands a plain ``quotawrap [OPTIONS] -- COMMAND`` straight to
:mod:`quotawrap.wrapper.run` without loading click; whatever else (a subcommand, ``--help``, a run whose
arguments only click can judge) comes here. ``run`` is the implicit subcommand.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import click

from ..config.settings import OPTIONS
from ..core.errors import EXIT_STORE, EXIT_USAGE, ConfigError, QuotawrapError, StoreError, exit_code, with_cure
from ..ledger import open_store
from ..support.log import fail
from ..support.packages import import_problem
from .budget_commands import budget_group
from .common import command_settings, echo, settings_options
from .key_commands import keys_group
from .ledger_commands import COMMANDS

__all__ = ["cli", "click_main"]


class _DefaultRunGroup(click.Group):
    """Anything that is not a subcommand name is the implicit ``run``; nothing at all is the usage."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help", "--version"):
            if not args[0].startswith("-"):
                _refuse_a_misspelt_subcommand(ctx, args[0], self.commands)
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _refuse_a_misspelt_subcommand(ctx: click.Context, word: str, names: Iterable[str]) -> None:
    """``quotawrap statu``: a word where a subcommand goes that names no program but looks like a subcommand
    is a typo, refused as click refuses one; a program of any name still runs after ``--``."""
    import shlex
    from difflib import get_close_matches

    from ..support.processes import which

    if which(word) is not None:
        return
    close = get_close_matches(word, sorted(names), n=1)
    if close:
        ctx.fail(
            f"No such command {word!r}. Did you mean {close[0]!r}?"
            f" (to run a program named {word!r}, put it after --: quotawrap -- {shlex.quote(word)})"
        )


@click.group(cls=_DefaultRunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quotawrap")
def cli() -> None:
    """Cap what a program spends on LLM calls: quotawrap [OPTIONS] -- COMMAND [ARGS...]"""


for _command in COMMANDS:  # status, dashboard, report, sessions, sync, prune: defined beside the modules they drive
    cli.add_command(_command)
cli.add_command(budget_group)
cli.add_command(keys_group)


@cli.command(
    "run",
    # options end at the command's first word (its own flags are its own); an unknown flag before it is a typo
    context_settings={"allow_interspersed_args": False},
)
@settings_options()
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run_command(command: tuple[str, ...], **values: Any) -> None:
    """Run COMMAND; each LLM call it makes is checked against the caps first and charged from its answer."""
    from ..wrapper.run import run_guarded

    run_guarded(command_settings(values), command)


# a run's own budget (--budget) is stored by the wrapper of a run: the gateway keeps to the ledger's budgets
_SERVE_OPTIONS = [
    option.name for option in OPTIONS if option.name not in ("proxy", "report_json", "fail_on_block", "budget")
]


@cli.command("serve")
@settings_options(_SERVE_OPTIONS)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8790, show_default=True, type=click.IntRange(0, 65535), help="Port (0: any free port).")
def serve_command(host: str, port: int, **values: Any) -> None:
    """Serve a guarded OpenAI/Ark-compatible API: programs in any language send their calls here.

    It forwards to the first --base-url (else Ark) and checks and charges every billed call exactly as
    a guarded run does; on SIGTERM it lets the calls in flight finish, charges them, and exits.
    Its dashboard (what status shows, updating by itself) is at /_quotawrap/dashboard/.
    """
    from ..config.paths import default_events_log
    from ..serve import without_hook

    without_hook()
    try:
        from ..serve._command import prepare, serve
    except ImportError as exc:
        from ..serve import MISSING_EXTRA

        fail(f"serve: {MISSING_EXTRA} ({exc.name} is not installed)", EXIT_USAGE)
    try:
        settings = prepare(command_settings(values))
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    ledger = open_store(settings)
    try:
        serve(settings, ledger, host=host, port=port, say=echo, events_dir=os.path.dirname(default_events_log("any")))
    except StoreError as exc:
        fail(f"{exc}; the gateway cannot guard without its ledger (pass --fail-open to serve anyway)", EXIT_STORE)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        fail(f"serve: cannot listen on {host}:{port}: {exc.strerror or exc}", EXIT_USAGE)


@cli.command("simulate")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=0, type=click.IntRange(0, 65535), help="Port (0: any free port).")
@click.option("--latency", "latency_s", type=click.FloatRange(0), default=None, help="Seconds before the first byte.")
@click.option(
    "--chunk-delay", "chunk_delay_s", type=click.FloatRange(0), default=None, help="Seconds between stream chunks."
)
@click.option("--reply-tokens", type=click.IntRange(0), default=None, help="Answer tokens per call.")
@click.option(
    "--reasoning-tokens", type=click.IntRange(0), default=None, help="Reasoning tokens per call (0: no thinking)."
)
@click.option(
    "--endpoint",
    "endpoints",
    multiple=True,
    metavar="EP=MODEL-VERSION",
    help="Serve this endpoint id as that foundation model, e.g. ep-20250101-abc=deepseek-v3-2-251201 (repeatable).",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="ID",
    help="Serve this model id too, beside the price table's (repeatable).",
)
@click.option("--lenient", is_flag=True, help="Accept any model and parameter (default: validate as Ark does).")
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON object of simulator settings (POST /_sim/config's fields); options given here win.",
)
def simulate_command(
    host: str,
    port: int,
    endpoints: tuple[str, ...],
    models: tuple[str, ...],
    lenient: bool,
    config_file: str | None,
    **overrides: Any,
) -> None:
    """Serve a local Ark-compatible API (chat, responses, embeddings, billing) for offline runs.

    It refuses what Ark refuses, with Ark's error bodies (docs/ark-contract.md); --lenient turns that off.
    """
    import json

    from ..simulator import SimConfig, SimConfigError, run_forever, serve
    from ..simulator._config import apply_patch

    patch: Any = {}
    if config_file:
        try:
            with open(config_file, encoding="utf-8") as handle:
                patch = json.load(handle)
        except (OSError, ValueError) as exc:
            fail(f"simulate: cannot read --config {config_file}: {exc}", EXIT_USAGE)
        if not isinstance(patch, dict):
            fail(f"simulate: --config {config_file} must hold a JSON object of settings", EXIT_USAGE)
    try:
        config = apply_patch(SimConfig(), patch)
        config = apply_patch(config, {k: v for k, v in overrides.items() if v is not None})
        config = apply_patch(
            config, {"endpoints": [*config.endpoints, *endpoints], "models": [*config.models, *models]}
        )
        if lenient:
            config = apply_patch(config, {"strict": False})
    except SimConfigError as exc:
        fail(f"simulate: {exc.param}: {exc.message}", EXIT_USAGE)
    run_forever(serve(host=host, port=port, config=config))


@cli.command("demo")
@click.option("--model", default="deepseek-v4-flash", show_default=True, help="Model the demo agent calls.")
@click.option("--cap-tokens", default=20_000, show_default=True, type=int, help="Most tokens the demo may spend.")
@click.option("--calls", default=24, show_default=True, type=int, help="Parallel calls the demo agent makes.")
@settings_options(["store"])
def demo_command(model: str, cap_tokens: int, calls: int, store: str | None) -> None:
    """Run examples/agent.py guarded: against Ark when ARK_API_KEY is set, else the bundled simulator."""
    import subprocess
    from pathlib import Path

    if problem := import_problem("openai", "the demo agent (the official openai SDK)", "demo"):
        fail(problem, EXIT_STORE)  # exit 4: what is missing is the environment's, not the command line's
    package = Path(__file__).resolve().parent.parent
    # a checkout has examples/ beside the package; a wheel carries a copy inside it
    agent = next(p for p in (package.parent / "examples" / "agent.py", package / "_demo" / "agent.py") if p.is_file())
    base = [sys.executable, "-m", "quotawrap", "--model", model, "--cap-tokens", str(cap_tokens)]
    if store:
        base += ["--store", store]
    env = {**os.environ, "DEMO_MODEL": model, "DEMO_CALLS": str(calls)}
    if os.environ.get("ARK_API_KEY"):
        sys.exit(subprocess.call([*base, "--", sys.executable, str(agent)], env=env))
    from ..simulator import serve

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
@click.option("--force", is_flag=True, help="Run even if consume already ran today (on any host of the store).")
@click.option("--at", "at", default=None, metavar="HH:MM", help="Wait until this Beijing time first.")
@click.option(
    "--max-tokens-per-call",
    default=16_384,
    show_default=True,
    type=click.IntRange(256),
    help="Largest answer each call asks for.",
)
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
    """Spend what is left of today's free token allowance through guarded calls before it expires at midnight."""
    from ..books.sync import sync_once, sync_source
    from ..consume.plan import parse_at, render_plan, seconds_until
    from ..consume.spend import DEFAULT_BASE_URL, ConsumeOptions, consume_models, execute, make_plans
    from ..core import quota
    from ..support.log import warn

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
            echo(f"quotawrap consume: {line}", err=True)

    if wait > 0 and not dry_run:
        say(f"waiting until {at} Beijing time ({wait / 60:,.0f} min)")
        try:
            time.sleep(wait)
        except KeyboardInterrupt:
            fail("consume interrupted while waiting for --at; nothing spent", 130)
    from ..ledger.base import ledger_clock

    ledger = open_store(settings)
    now = ledger_clock(ledger)()  # on Redis the server's: every host consumes the same Beijing day
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
            echo(render_plan(plan))
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
        code = execute(ledger, settings, options, models, say=say, shout=lambda line: echo(line, err=True))
    except QuotawrapError as exc:
        fail(str(exc), EXIT_STORE)
    sys.exit(code)


def click_main(args: Sequence[str], config: dict[str, Any]) -> None:
    """Every command but the plain run (``quotawrap --help``, ``status``, a run click must parse)."""
    names = ("run", "serve", "status", "dashboard", "sync", "report", "sessions", "consume", "prune")
    default_map: dict[str, Any] = {name: config for name in names}
    default_map["keys"] = {name: config for name in keys_group.commands}  # a group's are per subcommand
    try:
        cli.main(args=list(args), prog_name="quotawrap", default_map=default_map)
    except QuotawrapError as exc:  # any subcommand: one line naming the cure, never a traceback
        fail(with_cure(exc), exit_code(exc))
