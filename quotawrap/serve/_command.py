"""``quotawrap serve``: the gateway as a long-running service with a session of its own in the ledger.

The CLI parses the flags and turns what this raises into one line and an exit code:
ConfigError (bad setting), StoreError (no ledger, without ``--fail-open``), OSError (cannot listen).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable

from ..config.settings import Settings
from ..core.errors import ConfigError, QuotawrapError
from ..dashboard.pages import DASHBOARD_PATH, Pages, store_reader
from ..dashboard.server import warn_if_exposed
from ..ledger import Ledger
from ..support.log import warn
from ._gateway import Gateway  # aiohttp: importing this module is the check that the serve extra is there
from ._members import MemberGate, provider_key
from ._runner import run_in_foreground

__all__ = ["prepare", "serve"]


def prepare(settings: Settings) -> Settings:
    """The settings a gateway runs with: the store made explicit, tags resolved, a ``serve-`` session id."""
    from ..books.attribution import automatic_tags
    from ..config.paths import default_store_url, default_unguarded_log, new_run_id
    from ..core.tags import merge_tags, parse_tags
    from ..ledger import normalize_store_url

    store = normalize_store_url(settings.store or default_store_url())
    tags = merge_tags(automatic_tags(), parse_tags(settings.tag))
    run_id = settings.run_id or f"serve-{new_run_id()}"
    settings = settings.replace(run_id=run_id, store=store, tag=tuple(f"{k}={v}" for k, v in tags.items()))
    if settings.fail_open and not settings.unguarded_log:
        settings = settings.replace(unguarded_log=str(default_unguarded_log(run_id)))
    return settings


def serve(
    settings: Settings,
    ledger: Ledger,
    *,
    host: str,
    port: int,
    say: Callable[[str], None],
    events_dir: str | None = None,
) -> None:
    """Record the session, sync balances if configured, serve until SIGTERM, drain, close the session.

    ``events_dir``: where this host's runs keep their events logs, for the dashboard's waits."""
    from ..books.sync import SyncLoop, sync_source
    from ..ledger.base import RunRecord

    assert settings.run_id, "prepare() assigns the session id"
    if settings.otel:
        from ..settling.otel import sdk_missing

        if problem := sdk_missing():
            raise ConfigError(problem)
    members = None
    if settings.upstream_key_env:  # read before anything is recorded: a missing key is a usage error
        variable = settings.upstream_key_env
        members = MemberGate(variable, provider_key(variable, os.environ), ledger.member_key)
    warn_if_exposed("serve", host, reach="spends through it and reads its dashboard")
    tags = dict(entry.partition("=")[::2] for entry in settings.tag)
    try:
        ledger.start_run(RunRecord(settings.run_id, time.time(), command=f"quotawrap serve --port {port}", tags=tags))
    except QuotawrapError as exc:
        if not settings.fail_open:
            raise
        warn(f"{exc}; --fail-open: serving, and guarded calls go out UNGUARDED while the store is down")
    sync_loop = SyncLoop(ledger, settings) if sync_source(settings) else None
    if sync_loop is not None:
        sync_loop.tick()
        sync_loop.start()
    from ..books.alerts import start_alerts

    read = store_reader(ledger, settings, events_dir)
    try:
        from ..books.metrics import Exposition
    except ImportError:  # an install from before the serve extra had it
        warn("serve: no /metrics without prometheus-client: pip install 'quotawrap[serve]'")
        exposition = None
    else:
        exposition = Exposition(read)
    gateway = Gateway(
        settings,
        ledger,
        host=host,
        port=port,
        drain_timeout=settings.drain_timeout,
        members=members,
        pages=Pages(read),
        metrics=exposition,
    )
    alerts = start_alerts(ledger, settings)

    def ready(url: str) -> None:
        keys = f", member keys only: the provider key from ${members.variable}" if members is not None else ""
        say(f"quotawrap gateway listening on {url} (upstream {gateway.shown_upstream}, run {settings.run_id}{keys})")
        say(f"quotawrap dashboard on {url}{DASHBOARD_PATH}")
        sys.stdout.flush()

    try:
        run_in_foreground(gateway, ready)
    finally:
        if sync_loop is not None:
            sync_loop.stop()
        if alerts is not None:
            alerts.stop()
    with contextlib.suppress(QuotawrapError):
        ledger.end_run(settings.run_id, 0, time.time())
    if not settings.quiet:
        warn("gateway drained and stopped (every call it took is settled or charged)")
