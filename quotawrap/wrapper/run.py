"""A guarded run, from checked settings to the child's exit code: ``quotawrap [OPTIONS] -- COMMAND``.

Both ways in end here: :mod:`quotawrap.cli`'s own parse of a plain run, and click's ``run``
subcommand. Every import is made where it is first needed, and the work that need not come
before the child (reclaiming dead holds, loading what the summary and the end of the run use)
runs while it runs: the wrapper's start-up is paid by every guarded command.

Exit codes: the child's own code (128+N when it died of signal N); 2 usage or configuration
error; 3 ``--fail-on-block`` and a call was blocked; 4 the ledger could not be opened;
127 the command was not found.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from ..config.settings import Settings
from ..core.errors import EXIT_BLOCKED, EXIT_STORE, EXIT_USAGE, ConfigError, QuotawrapError, exit_code, with_cure
from ..ledger import open_store
from ..support.log import fail, warn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, NoReturn


__all__ = ["EXIT_BLOCKED", "EXIT_NOT_FOUND", "run_guarded"]

EXIT_NOT_FOUND = 127


def _lean(ledger: Any) -> bool:
    """Whether ``ledger`` is the run's lean books (:class:`.ledger.runs.RunBooks`), without importing them."""
    return bool(getattr(ledger, "lean", False))


def _open_books(settings: Settings) -> Any:
    """The run's ledger: lean on the usual SQLite store (a current ledger file, no gateway, no balance
    source), else the full ledger as every subcommand opens it (exit 4 when it cannot be opened)."""
    from ..config.settings import sync_source

    store = settings.store or ""
    if store.startswith("sqlite:///") and not settings.proxy and sync_source(settings) is None:
        from ..ledger.sqlite.runs import RunBooks, open_runs

        runs = open_runs(store.removeprefix("sqlite:///"))
        if runs is not None:
            from ..ledger import open_ledger as open_full

            return RunBooks(store, runs, open_full)
    return open_store(settings)


def run_guarded(settings: Settings, command: Sequence[str], *, ends_process: bool = False) -> NoReturn:
    """Run ``command`` with every guarded LLM call reserved before and reconciled after; exit with its code.

    ``ends_process``: this interpreter exits with the run (the console script, not a test calling in).
    """
    from ..books.attribution import begin_automatic_tags
    from ..config.paths import default_store_url
    from ..core.tags import merge_tags, parse_tags
    from ..ledger import normalize_store_url

    if not 0 <= settings.wait < float("inf"):
        fail(f"--wait must be seconds >= 0 (0 refuses at once), got {settings.wait}", EXIT_USAGE)
    if settings.proxy:
        from ..serve import without_hook

        without_hook()
    automatic = begin_automatic_tags()  # git's two queries run beside what follows
    try:
        store = normalize_store_url(settings.store or default_store_url())
        explicit = parse_tags(settings.tag)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    from ..config.paths import default_events_log, default_unguarded_log, new_run_id
    from .child import nested_in

    run_id = settings.run_id or new_run_id()
    settings = settings.replace(run_id=run_id, store=store)
    if (settings.fail_open or settings.model) and not settings.unguarded_log:
        # the calls --fail-open, or a --model that does not name their model, let through: for the summary
        settings = settings.replace(unguarded_log=default_unguarded_log(run_id))
    if _has_config_file():
        _check_endpoints_table()
    own_events_log = not settings.events_log  # ours to delete once the summary has read it
    if own_events_log:
        settings = settings.replace(events_log=default_events_log(run_id))

    if problem := prepare_outputs(settings):  # every file the run writes, checked before anything starts
        fail(problem, EXIT_USAGE)
    if settings.otel:
        from ..settling.otel import sdk_missing

        if problem := sdk_missing():
            fail(problem, EXIT_USAGE)
    ledger = _open_books(settings)
    tags = merge_tags(automatic(), explicit)
    settings = settings.replace(tag=tuple(f"{key}={value}" for key, value in tags.items()))
    nested = nested_in(settings)
    _start_run(ledger, settings, command, tags, nested=nested)
    sync_loop = _start_sync(ledger, settings)
    alerts = _start_alerts(ledger, settings)
    if ends_process:
        _freeze_what_start_up_made()
    result = _run_child(settings, command, ledger, sync_loop)
    if alerts is not None:
        alerts.stop()  # after the run's books are closed: its last look sees the final numbers
    if not nested:
        with contextlib.suppress(QuotawrapError):  # already reported by run_child when the store is down
            ledger.end_run(run_id, result.exit_code, time.time())
    _auto_prune(ledger, settings)
    with contextlib.suppress(Exception):  # the books are closed: nothing is left to lose
        ledger.close()
    _finish(settings, result, tags, own_events_log=own_events_log, nested=nested)


def _has_config_file() -> bool:
    from ..config.file import config_path

    return config_path() is not None


def _check_endpoints_table() -> None:
    """quotawrap.toml's ``[endpoints]`` is read by each guarded process at its first endpoint call: a table it
    cannot read is said here, before the child starts (exit 2), rather than as a refusal of every such call."""
    from ..ledger.endpoint_ids import configured_endpoints

    try:
        configured_endpoints()
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)


def _freeze_what_start_up_made() -> None:
    """Take the objects of every module loaded so far out of the garbage collector's sight.

    The interpreter's exit collects garbage over every object it holds, nearly all of them module
    objects that were never garbage. What the run makes from here on is collected as ever (a thread's
    ledger connection is closed so, the last close folding the WAL into the file); the wrapper's own
    connection, made before, is closed by the run's end. The collector, off during start-up
    (:func:`quotawrap.cli.main`), is back on for what the run makes from here.
    """
    import gc

    gc.freeze()
    gc.enable()


def _start_run(ledger: Any, settings: Settings, command: Sequence[str], tags: dict[str, str], *, nested: bool) -> None:
    """The run's record, written before the child can make a guarded call."""
    if nested:  # a nested wrapper joins the outer run; its record is the outer wrapper's to write
        return
    from ..books.attribution import WRAPPER_HOST_TAG, WRAPPER_PID_TAG
    from ..core.redact import join_command, redact_argv
    from ..support.host import hostname

    # the command says which program spent the money; its --api-key does not belong in the ledger
    wrapper = {WRAPPER_PID_TAG: str(os.getpid()), WRAPPER_HOST_TAG: hostname()}
    assert settings.run_id
    line, all_tags = join_command(redact_argv(command)), {**tags, **wrapper}
    try:
        if _lean(ledger):
            ledger.start_run(settings.run_id, time.time(), line, all_tags)
        else:
            from ..ledger.base import RunRecord

            ledger.start_run(RunRecord(settings.run_id, time.time(), command=line, tags=all_tags))
        if settings.budget:  # the run's own budgets, in the ledger before its first call
            from ..core.budgets import parse_budget

            books = ledger.full() if _lean(ledger) else ledger
            for spec in settings.budget:
                books.set_budget(parse_budget(spec, run_id=settings.run_id))
    except QuotawrapError as exc:
        if not settings.fail_open:
            fail(f"{exc}; refusing to run unguarded (pass --fail-open to run anyway)", EXIT_STORE)
        warn(f"{exc}; --fail-open: running, and guarded calls go out UNGUARDED while the store is down")


def _start_sync(ledger: Any, settings: Settings) -> Any:
    """The balance sync loop when a source is configured (None otherwise)."""
    from ..config.settings import sync_source

    if not sync_source(settings):
        return None  # the usual run: the sync module stays unloaded
    from ..books.status import no_balance_today
    from ..books.sync import SyncLoop

    sync_loop = SyncLoop(ledger, settings)
    if no_balance_today(ledger, settings, time.time()):
        sync_loop.tick()  # before the child's first call: until today's first sync, only the daily cap applies
    sync_loop.start()  # its first tick runs at once, beside the child's start
    return sync_loop


def _start_alerts(ledger: Any, settings: Settings) -> Any:
    """The ``--alert-webhook`` watcher (None without one: the usual run never loads it)."""
    if not settings.alert_webhook:
        return None
    from ..books.alerts import start_alerts

    return start_alerts(ledger, settings)


def _expiry_warnings(ledger: Any, settings: Settings) -> None:
    with contextlib.suppress(QuotawrapError):  # a warning must not stop the run
        if not ledger.known_models():
            return  # no package can expire: the status module (and the price table) stay unloaded
        from ..books.status import expiry_warnings

        for line in expiry_warnings(ledger, settings, time.time()):
            warn(line)


def _run_child(settings: Settings, command: Sequence[str], ledger: Any, sync_loop: Any) -> Any:
    from .launcher import run_child

    proxy = None
    child_options: dict[str, Any] = {}
    if settings.proxy:
        proxy, proxy_env = _start_proxy(settings, ledger)
        child_options = {"extra_env": proxy_env, "on_child_exit": proxy.stop}
    try:
        return run_child(
            settings, command, ledger, while_running=lambda: _beside_child(ledger, settings), **child_options
        )
    except FileNotFoundError:
        fail(f"command not found: {command[0]}", EXIT_NOT_FOUND)
    except QuotawrapError as exc:
        fail(with_cure(exc), exit_code(exc))
    finally:
        if proxy is not None:
            proxy.stop()
        if sync_loop is not None:
            sync_loop.stop()


def _beside_child(ledger: Any, settings: Settings) -> None:
    """Work that need not delay the child, done on a thread as it starts (the wrapper only waits meanwhile).

    The warnings of packages about to expire (reading them loads the status module and the price
    table), and the modules the summary needs.
    """
    if settings.quiet:
        return
    _expiry_warnings(ledger, settings)
    if not _lean(ledger):  # lean books: only a run that made calls needs it, and imports it at its end
        import quotawrap.wrapper.summary  # noqa: F401


def _finish(settings: Settings, result: Any, tags: dict[str, str], *, own_events_log: bool, nested: bool) -> NoReturn:
    """The summary, the run's report files, and the exit code."""
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if settings.quiet and not (settings.report_json or step_summary or settings.fail_on_block):
        _remove_events_log(settings, own_events_log)  # nobody reads the report: it is not built
        sys.exit(result.exit_code)
    if (
        result.totals is None  # no process of the run opened the ledger: nothing was held, called or waited
        and not (settings.quiet or nested or settings.fail_open or settings.report_json or step_summary)
        and not (result.unguarded_processes or result.connections)
        and not (settings.unguarded_log and os.path.exists(settings.unguarded_log))  # calls --model let by
    ):
        from ..support.log import NO_COST, summary_head

        _remove_events_log(settings, own_events_log)
        assert settings.run_id
        would_block = 0 if settings.watch else None
        _say(summary_head(settings.run_id, 0, 0, NO_COST, 0, would_block=would_block, went_around=False))
        sys.exit(result.exit_code)
    from ..support.events import read_events
    from .summary import append_step_summary, format_summary, read_unguarded, run_report, write_json

    totals = result.totals
    if totals is None:  # no process of the run opened the ledger: nothing was held or spent
        from ..ledger import RunTotals

        assert settings.run_id
        totals = RunTotals(settings.run_id, {})
    report = run_report(
        totals,
        settings=settings,
        exit_code=result.exit_code,
        tags=tags,
        unguarded=read_unguarded(settings.unguarded_log),
        outside_filter=read_unguarded(settings.unguarded_log, "model-filter"),
        store_error=result.store_error,
        unguarded_processes=[process.as_dict() for process in result.unguarded_processes],
        connections=result.connections,
        events=read_events(settings.events_log),
        budgets=result.budgets,
    )
    _remove_events_log(settings, own_events_log)
    if not settings.quiet:
        if nested:
            _say(f"quotawrap: nested in run {settings.run_id}: the totals below are that whole run's so far")
        _say(format_summary(report))
    try:
        if settings.report_json:
            write_json(report, settings.report_json)
        if step_summary:
            append_step_summary(step_summary, report)
    except OSError as exc:  # checked at start, so only a disk that filled or changed meanwhile
        warn(f"cannot write the run's report: {exc}")
    sys.exit(report["exit_code"])  # the command's, or EXIT_BLOCKED under --fail-on-block: the report says which


def _remove_events_log(settings: Settings, own_events_log: bool) -> None:
    if own_events_log and settings.events_log:
        with contextlib.suppress(OSError):
            os.unlink(settings.events_log)


def _say(text: str) -> None:
    from ..support.log import printable

    sys.stderr.write(printable(text, lines=True) + "\n")
    sys.stderr.flush()


def _start_proxy(settings: Settings, ledger: Any) -> tuple[Any, dict[str, str]]:
    """``--proxy``: the run's gateway, started, and the child's variables pointing at it."""
    try:
        from ..serve._runner import start_proxy
    except ImportError as exc:
        from ..serve import MISSING_EXTRA

        fail(f"--proxy: {MISSING_EXTRA} ({exc.name} is not installed)", EXIT_USAGE)
    try:
        return start_proxy(settings, ledger)
    except OSError as exc:
        fail(f"--proxy: cannot start the gateway on loopback: {exc}", EXIT_USAGE)


def _auto_prune(ledger: Any, settings: Settings) -> None:
    """The ledger's retention bound, at a run's end and at most once a day (``--retention``)."""
    if _lean(ledger) and ledger.pruned_today(time.time()):
        return  # another run pruned in the last 24 h: the retention modules and the full ledger stay unloaded
    from ..books.retention import auto_prune, describe

    try:
        result = auto_prune(ledger, settings.retention, time.time())
    except QuotawrapError as exc:  # the run is over and guarded; a prune that failed waits for the next day
        warn(f"automatic prune failed ({exc}); run `quotawrap prune --older-than {settings.retention}`")
        return
    if result is not None and result.calls and not settings.quiet:
        warn(f"retention {settings.retention}: {describe(result)}")


def prepare_outputs(settings: Settings) -> str | None:
    from ..support.files import prepare

    """Every file a run will write (audit log, report JSON, unguarded log), made ready; the first problem."""
    for name in ("audit_log", "report_json", "unguarded_log"):
        path = getattr(settings, name)
        problem = prepare(path) if path else None
        if problem is not None:
            return f"--{name.replace('_', '-')} {path}: {problem}"
    return None
