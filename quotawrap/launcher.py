"""Run the child with the hook injected, stay its parent, and close the books when it exits.

Unlike ``ddtrace-run`` and ``opentelemetry-instrument`` this does not ``exec``: quotawrap
forwards signals, waits, charges the holds the run left open and prints the summary.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType

import quotawrap

from ._errors import QuotawrapError
from ._log import warn
from .ledger import Ledger, RunTotals, user_state_dir
from .registry import ProcessWatcher, RunDir, UnguardedProcess, publish_unguarded
from .settings import OPTIONS, Settings, config_path, env_name
from .sockets import GuardedPeers

__all__ = [
    "HOOK_DIR",
    "ChildResult",
    "child_environment",
    "default_events_log",
    "default_unguarded_log",
    "injection_blockers",
    "nested_in",
    "new_run_id",
    "run_child",
]

HOOK_DIR = Path(__file__).resolve().parent.parent / "sitecustomize_hook"
PACKAGE_HOME = Path(quotawrap.__file__).resolve().parent.parent
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_RECLAIM_EVERY_S = 10.0
_RECLAIMER_JOIN_S = 0.1  # its connection only: an unjoined one leaves the WAL beside the file, no harm
_PR_SET_CHILD_SUBREAPER = 36
# Set by a wrapper for its child: a quotawrap started below with the same run id joins that run
# instead of opening (and later overwriting and closing) it a second time.
NESTED_VARIABLE = "QUOTAWRAP_WRAPPED_RUN"


def default_unguarded_log(run_id: str) -> Path:
    """Where a --fail-open run's children record what they let through while the store was down."""
    return Path(user_state_dir()) / "unguarded" / f"{run_id}.jsonl"


def default_events_log(run_id: str) -> Path:
    """Where a run's children record their waits for room and the calls they bounded."""
    return Path(user_state_dir()) / "events" / f"{run_id}.jsonl"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + os.urandom(3).hex()  # secrets.token_hex(3), without its imports


def child_environment(settings: Settings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: our hook first on PYTHONPATH (once), settings as QUOTAWRAP_*."""
    env = dict(os.environ if base is None else base)
    hook = str(HOOK_DIR)
    # Empty entries stay: Python reads them as the working directory, which the program may rely on.
    existing = [
        entry
        for entry in (env["PYTHONPATH"].split(os.pathsep) if env.get("PYTHONPATH") else [])
        if not entry or os.path.normpath(entry) != hook
    ]
    env["PYTHONPATH"] = os.pathsep.join([hook, *existing])
    env["QUOTAWRAP_HOME"] = str(PACKAGE_HOME)
    found = config_path()
    if found is not None:
        env["QUOTAWRAP_CONFIG"] = str(found)  # the children read the wrapper's file, whatever their cwd
    # A leftover QUOTAWRAP_CAP_TOKENS="" from the caller's shell must not outlive an unset option.
    for option in OPTIONS:
        if option.child:
            env.pop(env_name(option.name), None)
    env.update(settings.child_env())
    env[NESTED_VARIABLE] = settings.run_id or ""
    return env


def nested_in(settings: Settings, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this wrapper runs inside another's child with that run's id (``quotawrap -- ... quotawrap``)."""
    env = os.environ if environ is None else environ
    return bool(settings.run_id) and env.get(NESTED_VARIABLE) == settings.run_id


def _become_subreaper() -> bool:
    """Linux: processes the child leaves behind become ours, so the run waits for them too."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _has_children() -> bool:
    """Whether this process has any child left, without reaping one (no /proc walk when it has none)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    except (OSError, AttributeError):  # no waitid here: walk /proc to tell
        return True
    return True


def _left_behind(child: int) -> list[int]:
    """Our children other than the child: what it forked and left running (reparented to us)."""
    if not _has_children():  # the usual end: the child was reaped and left nothing behind
        return []
    me, found = os.getpid(), []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == child:
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as handle:
                    fields = handle.read().rpartition(b")")[2].split()
            except OSError:
                continue  # gone meanwhile
            if len(fields) > 1 and int(fields[1]) == me:
                found.append(int(entry.name))
    return found


def _wait_left_behind(child: int, linger_s: float) -> None:
    """Wait (at most ``linger_s``) for the processes the child left running: their calls belong to this run.

    Bounded, so a daemon the command started cannot keep the run open forever; one still running when
    the time is up is named, and whatever it calls later is still guarded by the ledger's daily limits.
    """
    told = False
    deadline = time.monotonic() + linger_s
    while pids := _left_behind(child):
        if not told:
            warn(
                f"the command exited but left {len(pids)} process(es) running ({', '.join(map(str, pids))});"
                f" waiting up to {linger_s:g} s (--linger) so their calls are counted (signals are forwarded)"
            )
            told = True
        if time.monotonic() >= deadline:
            warn(
                f"{len(pids)} process(es) still running after --linger {linger_s:g} s"
                f" ({', '.join(map(str, pids))}): the run's totals close without their later calls"
            )
            return
        for pid in pids:
            with contextlib.suppress(ChildProcessError, InterruptedError):
                os.waitpid(pid, os.WNOHANG)  # reap the ones that ended; they are ours now
        time.sleep(0.05)


def which(name: str, path: str | None = None) -> str | None:
    """``shutil.which`` on POSIX, without shutil's imports (the compressors) on every run's start path."""
    if os.name != "posix":  # pragma: no cover - PATHEXT and the like
        import shutil

        return shutil.which(name, path=path)

    def runnable(candidate: str) -> bool:
        return os.path.exists(candidate) and os.access(candidate, os.F_OK | os.X_OK) and not os.path.isdir(candidate)

    if os.path.dirname(name):
        return name if runnable(name) else None
    search = os.environ.get("PATH") if path is None else path
    if search is None:
        search = os.confstr("CS_PATH") or os.defpath
    if not search:
        return None
    seen: set[str] = set()
    for directory in search.split(os.pathsep):
        normalized = os.path.normcase(directory)
        if normalized in seen:
            continue
        seen.add(normalized)
        candidate = os.path.join(directory, name)
        if runnable(candidate):
            return candidate
    return None


_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def injection_blockers(command: Sequence[str]) -> list[str]:
    """Interpreter flags that stop PYTHONPATH's sitecustomize from running (-I, -E, -S)."""
    if not command or not _PYTHON.match(Path(command[0]).name):
        return []
    found: list[str] = []
    args = iter(command[1:])
    for arg in args:
        if arg == "-" or not arg.startswith("-"):
            break  # the script: what follows is its own
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                next(args, None)
            continue
        letters = arg[1:]
        for index, letter in enumerate(letters):
            if letter in "cm":
                return found  # -c CODE / -m MODULE: what follows is the program's
            if letter in "WX":  # -W ARG, -X ARG: the argument is the rest, or the next word
                if index == len(letters) - 1:
                    next(args, None)
                break
            if letter in "IES" and f"-{letter}" not in found:
                found.append(f"-{letter}")
    return found


class ChildResult:
    def __init__(
        self,
        exit_code: int,
        totals: RunTotals,
        resolved_at_exit: int,
        store_error: str | None = None,
        *,
        unguarded_processes: Sequence[UnguardedProcess] = (),
        connections: Sequence[Mapping[str, object]] = (),
    ) -> None:
        self.exit_code = exit_code
        self.totals = totals
        self.resolved_at_exit = resolved_at_exit
        self.store_error = store_error  # the books could not be closed: totals are empty, holds stay open
        self.unguarded_processes = list(unguarded_processes)  # Python processes that ran without the hook
        self.connections = list(connections)  # connections to guarded hosts that went around every client


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _terminal_delivers_sigint() -> bool:
    """Ctrl-C reaches the whole foreground group; forwarding it would interrupt the child twice."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def run_child(
    settings: Settings,
    command: Sequence[str],
    ledger: Ledger,
    *,
    extra_env: Mapping[str, str] | None = None,
    on_child_exit: Callable[[], None] | None = None,
    while_running: Callable[[], None] | None = None,
) -> ChildResult:
    """Start the child, forward signals, wait; then charge open holds and total the run.

    ``on_child_exit`` runs before the books close (``--proxy`` stops its gateway there, so the
    calls it still had in flight settle before the run's open holds are charged).
    ``while_running`` runs on a thread once the child has started: work the run's end needs,
    done while the wrapper would only wait.
    """
    assert settings.run_id, "the CLI assigns a run id"
    executable = which(command[0])
    if executable is None:
        raise FileNotFoundError(command[0])
    watch_tree = Path("/proc/self/task").is_dir()
    if not watch_tree:  # elsewhere the process watcher cannot tell; say what argv alone shows
        for flag in injection_blockers(command):
            warn(f"the command runs Python with {flag}: the hook may not load there, so its calls may NOT be guarded")
    run_dir = RunDir()
    try:
        return _run(settings, executable, command, ledger, run_dir, watch_tree, extra_env, on_child_exit, while_running)
    finally:
        run_dir.remove()


def _run(
    settings: Settings,
    executable: str,
    command: Sequence[str],
    ledger: Ledger,
    run_dir: RunDir,
    watch_tree: bool,
    extra_env: Mapping[str, str] | None,
    on_child_exit: Callable[[], None] | None,
    while_running: Callable[[], None] | None,
) -> ChildResult:
    assert settings.run_id
    nested = nested_in(settings)
    env = {**child_environment(settings), **(extra_env or {})}
    # A run inside another run: its processes register with both wrappers, innermost first.
    outer = os.environ.get("QUOTAWRAP_RUN_DIR")
    env["QUOTAWRAP_RUN_DIR"] = os.pathsep.join([str(run_dir.path), *([outer] if outer else [])])
    from .settle_relay import SOCKET_VARIABLE, open_relay, relay_path  # the children's settles land here

    env[SOCKET_VARIABLE] = relay_path(str(run_dir.path))  # ours, never an outer run's (it may keep another ledger)
    reaping = _become_subreaper()
    process = subprocess.Popen([executable, *command[1:]], env=env)
    # Bound once the child is on its way, off its start-up path: its first guarded call comes tens of ms
    # later, and a settle sent before (or with no relay at all) fails at once and lands in the child.
    relay = open_relay(env[SOCKET_VARIABLE], lambda: ledger, warn)
    watcher = (
        ProcessWatcher(
            process.pid,
            run_dir,
            strict=settings.strict,
            hook_dir=str(HOOK_DIR),
            peers=GuardedPeers(settings.base_url),
            on_unguarded=functools.partial(publish_unguarded, settings.events_log),
        ).start()
        if watch_tree
        else None
    )

    def forward(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and _terminal_delivers_sigint():
            return
        for pid in [process.pid, *(_left_behind(process.pid) if process.returncode is not None else ())]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    stop = threading.Event()
    reclaimer = threading.Thread(target=_reclaim_loop, args=(ledger, stop), daemon=True)
    reclaimer.start()
    beside = threading.Thread(target=_beside_child, args=(while_running,), daemon=True)
    if while_running is not None:
        beside.start()
    # --quiet: no live view (nor summary); stopped after resolve_run so its final lines show the charge
    # a nested wrapper shares the outer one's terminal: one live line is enough
    view: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if not (settings.quiet or nested):
        from .live import LiveView  # only a run that shows it pays for it

        view = LiveView(ledger, settings, settings.run_id)
    with view:
        try:
            while True:
                try:
                    returncode = process.wait()
                    break
                except KeyboardInterrupt:  # pragma: no cover - only without our handler
                    continue
            if reaping:
                _wait_left_behind(process.pid, settings.linger)
        finally:
            stop.set()
            if beside.is_alive():
                beside.join()  # what it says belongs to the run's start, before its end
            # Ended threads release their ledger connections, so the wrapper's own close at exit is the
            # last and folds the SQLite WAL back into the file; one stuck in a pass is not waited for.
            reclaimer.join(timeout=_RECLAIMER_JOIN_S)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if on_child_exit is not None:
                on_child_exit()
            if relay is not None:
                relay.close()  # every settle received lands before the open holds are charged
        unguarded = watcher.stop() if watcher is not None else []
        connections = run_dir.connections()
        try:
            # Nested: the outer wrapper closes the run; charging its open holds here would charge calls
            # still in flight elsewhere in the tree, so only holds of dead processes are charged.
            resolved = ledger.reclaim_orphans(time.time()) if nested else ledger.resolve_run(settings.run_id)
            totals = ledger.run_totals(settings.run_id)
        except QuotawrapError as exc:
            # Nothing is lost: the run's open holds stay in the ledger and the next run, `status` or
            # reclaim charges them (they carry an expiry and their owner's pid).
            warn(f"could not close the run's books: {exc}; its open holds stay and are charged later")
            return ChildResult(
                _exit_code(returncode),
                RunTotals(settings.run_id, {}),
                0,
                store_error=str(exc),
                unguarded_processes=unguarded,
                connections=connections,
            )
    return ChildResult(_exit_code(returncode), totals, resolved, unguarded_processes=unguarded, connections=connections)


def _beside_child(work: Callable[[], None] | None) -> None:
    try:
        if work is not None:
            work()
    except Exception as exc:  # a head start only: the run's end redoes whatever it needs
        warn(f"could not prepare the run's end: {exc!r}")


def _reclaim_loop(ledger: Ledger, stop: threading.Event) -> None:
    """Charge holds of processes that died (a SIGKILLed grandchild, a crashed run before) while the run goes on.

    The first pass runs at once, beside the child's start rather than before it: until it ends,
    a dead process's hold can only refuse a call for want of room, never let one overspend.
    """
    first = True
    while first or not stop.wait(_RECLAIM_EVERY_S):
        first = False
        try:
            ledger.reclaim_orphans(time.time())
        except Exception as exc:
            warn(f"could not reclaim orphaned holds: {exc}")
