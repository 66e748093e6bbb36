"""The child's process: spawn it with the hook's environment (:mod:`.child`), stay its parent, close the books.

Unlike ``ddtrace-run`` and ``opentelemetry-instrument`` this does not ``exec``: quotawrap
forwards signals, waits, charges the holds the run left open and prints the summary.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from ..config.settings import Settings
from ..support.log import warn
from ..support.processes import which
from .child import HOOK_DIR, child_environment, injection_blockers, nested_in

# Everything up to the child's spawn is paid by every guarded command: the process watcher, the
# signal forwarding, the threads and their modules load once the child is on its way; the child
# is spawned with os.posix_spawn, not subprocess (importing its module and selectors would delay the child).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import threading
    from collections.abc import Callable, Mapping, Sequence
    from types import FrameType
    from typing import Any

    from ..core.budgets import BudgetUse
    from ..ledger import Books, Ledger, RunTotals
    from .registry import UnguardedProcess

__all__ = ["ChildResult", "run_child"]

_RECLAIM_EVERY_S = 10.0
_MARK_POLL_S = 0.05  # the reclaimer's look for a process of the run that opened the ledger
_RECLAIMER_JOIN_S = 0.1  # its connection only: an unjoined one leaves the WAL beside the file, no harm
_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    """Linux: processes the child leaves behind become ours, so the run waits for them too."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _prctl(_PR_SET_CHILD_SUBREAPER, 1) == 0
    except (OSError, AttributeError, ImportError):
        return False


def _prctl(option: int, arg: int) -> int:
    """libc's ``prctl(option, arg, 0, 0, 0)`` through ``_ctypes`` itself: the ``ctypes`` package
    (its types and their classes) would delay every guarded command's child."""
    import _ctypes

    class _Int(_ctypes._SimpleCData):  # type: ignore[type-arg]  # ctypes.c_int
        _type_ = "i"

    class _Function(_ctypes.CFuncPtr):  # a CDLL's function returning an int
        _flags_ = _ctypes.FUNCFLAG_CDECL
        _restype_ = _Int

    libc: Any = _ctypes.dlopen  # typeshed has no None (this process's own symbols, as CDLL(None))
    address = _ctypes.dlsym(libc(None, 0), "prctl")
    return int(_Function(address)(option, arg, 0, 0, 0))


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


class ChildResult:
    def __init__(
        self,
        exit_code: int,
        totals: RunTotals | None,
        resolved_at_exit: int,
        store_error: str | None = None,
        *,
        unguarded_processes: Sequence[UnguardedProcess] = (),
        connections: Sequence[Mapping[str, object]] = (),
        budgets: Sequence[BudgetUse] = (),
    ) -> None:
        self.exit_code = exit_code
        self.totals = totals  # None: no process of the run opened the ledger, so every total is zero
        self.resolved_at_exit = resolved_at_exit
        self.store_error = store_error  # the books could not be closed: totals are empty, holds stay open
        self.unguarded_processes = list(unguarded_processes)  # Python processes that ran without the hook
        self.connections = list(connections)  # connections to guarded hosts that went around every client
        self.budgets = list(budgets)  # the budgets its calls may count against, as the run ends


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
    watch_tree = os.path.isdir("/proc/self/task")
    if not watch_tree:  # elsewhere the process watcher cannot tell; say what argv alone shows
        for flag in injection_blockers(command):
            warn(f"the command runs Python with {flag}: the hook may not load there, so its calls may NOT be guarded")
    from ..support.files import RUN_DIR_PREFIX, new_private_dir, remove_tree

    run_dir = new_private_dir(RUN_DIR_PREFIX)
    try:
        return _run(settings, executable, command, ledger, run_dir, watch_tree, extra_env, on_child_exit, while_running)
    finally:
        remove_tree(run_dir)


class _Child:
    """The spawned command: its pid, and its exit status once reaped (``Popen``'s, without subprocess)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def wait(self) -> int:
        """Reap it (a signal's handler runs meanwhile and the wait goes on); its code, -N for signal N."""
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _spawn(executable: str, argv: Sequence[str], env: Mapping[str, str]) -> _Child:
    """``subprocess.Popen(argv, executable=..., env=env)``'s child: the descriptors it would close are
    closed (close_fds: every inheritable one above stderr), SIGPIPE and SIGXFSZ back to their default
    (restore_signals: Python ignores them), the rest inherited."""
    import _signal

    close = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"):
            fd = int(name)
            with contextlib.suppress(OSError):
                if fd > 2 and os.get_inheritable(fd):
                    close.append((os.POSIX_SPAWN_CLOSE, fd))
    reset = [getattr(_signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(_signal, name)]
    return _Child(os.posix_spawn(executable, list(argv), env, file_actions=close, setsigdef=reset))


def _run(
    settings: Settings,
    executable: str,
    command: Sequence[str],
    ledger: Ledger,
    run_path: str,
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
    env["QUOTAWRAP_RUN_DIR"] = os.pathsep.join([run_path, *([outer] if outer else [])])
    from ..support.files import SOCKET_VARIABLE, relay_path  # the children's settles land here

    env.pop(SOCKET_VARIABLE, None)  # never an outer run's (it may keep another ledger)
    if settings.draws_ahead:  # the relay is the advances' (Settings.draws_ahead)
        env[SOCKET_VARIABLE] = relay_path(run_path)
    reaping = _become_subreaper()
    process = _spawn(executable, [executable, *command[1:]], env)
    # From here on the child runs: what follows is off its start-up path (on the other core).
    import _signal as signal  # the C module: signal.py wraps it in enums, and importing enum costs the run
    import functools
    import threading

    from .registry import ProcessWatcher, RunDir, publish_unguarded
    from .sockets import GuardedPeers

    run_dir = RunDir(run_path)
    # Bound once the child is on its way, off its start-up path: its first guarded call comes tens of ms
    # later, and a settle sent before (or with no relay at all) fails at once and lands in the child.
    # Lean books: bound once a process of the run opens the ledger (on the reclaimer's thread), so a
    # run that makes no guarded call never loads the socket modules beside its child's start.
    relay = _Relay(env.get(SOCKET_VARIABLE), ledger, settings.events_log)
    lean = bool(getattr(ledger, "lean", False))  # run.py's books: the full ledger opens on first use
    if not lean:
        relay.open()
    watcher = (
        ProcessWatcher(
            process.pid,
            run_dir,
            strict=settings.strict,
            hook_dir=HOOK_DIR,
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

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
    previous = {sig: signal.signal(sig, forward) for sig in forwarded}
    stop = threading.Event()
    reclaimer = threading.Thread(
        target=_reclaim_loop, args=(ledger, stop, run_path if lean else None, relay), daemon=True
    )
    reclaimer.start()
    beside = threading.Thread(target=_beside_child, args=(while_running,), daemon=True)
    if while_running is not None:
        beside.start()
    # --quiet: no live view (nor summary); stopped after resolve_run so its final lines show the charge
    # a nested wrapper shares the outer one's terminal: one live line is enough
    view: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if not (settings.quiet or nested):

        def live_view() -> contextlib.AbstractContextManager[object]:
            from .live import LiveView  # only a run that shows it pays for it

            assert settings.run_id
            return LiveView(ledger, settings, settings.run_id)

        view = _ViewOnceUsed(live_view, run_path) if lean else live_view()
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
            # every settle received lands before the open holds are charged; and every draw, so what is left of
            # the advances of dead processes is released (their calls in flight have rows of their own)
            every_draw_landed = relay.close()
        unguarded = watcher.stop() if watcher is not None else []
        connections = run_dir.connections()
        from ..core.errors import QuotawrapError
        from ..support.files import ledger_used

        if lean and not nested and not ledger_used(run_path):
            # No process of the run opened the ledger (each marks the run directory before its first
            # reserve): no hold of this run exists, nothing to charge, every total is zero.
            return ChildResult(_exit_code(returncode), None, 0, unguarded_processes=unguarded, connections=connections)
        try:
            # Nested: the outer wrapper closes the run; charging its open holds here would charge calls
            # still in flight elsewhere in the tree, so only holds of dead processes are charged.
            from ..ledger.base import ledger_clock

            resolved = (
                ledger.reclaim_orphans(ledger_clock(ledger)())
                if nested
                else ledger.resolve_run(settings.run_id, release_advances=every_draw_landed)
            )
            totals = ledger.run_totals(settings.run_id)
            from ..ledger.budgets import run_budget_uses

            budgets = run_budget_uses(ledger, ledger_clock(ledger)(), settings.run_id, settings.tag)
            if not nested:  # the run's own budgets (--budget) end with it: no reserve reads them again
                for use in budgets:
                    if use.budget.run_id == settings.run_id:
                        ledger.remove_budget(use.budget.id)
        except QuotawrapError as exc:
            # Nothing is lost: the run's open holds stay in the ledger and the next run, `status` or
            # reclaim charges them (they carry an expiry and their owner's pid).
            warn(f"could not close the run's books: {exc}; its open holds stay and are charged later")
            from ..ledger import RunTotals

            return ChildResult(
                _exit_code(returncode),
                RunTotals(settings.run_id, {}),
                0,
                store_error=str(exc),
                unguarded_processes=unguarded,
                connections=connections,
            )
    return ChildResult(
        _exit_code(returncode),
        totals,
        resolved,
        unguarded_processes=unguarded,
        connections=connections,
        budgets=budgets,
    )


class _Relay:
    """The run's settle relay (:mod:`quotawrap.settling.handoff`), bound at most once and never after it was
    closed; never without a ``path`` (the run's processes draw no advances)."""

    def __init__(self, path: str | None, ledger: Ledger, events_log: str | None) -> None:
        import _thread

        self._path = path
        self._ledger = ledger
        self._events_log = events_log  # where the bound events that come with the settles are written
        self._relay: Any = None
        self._closed = False
        self._lock = _thread.allocate_lock()

    def open(self) -> None:
        with self._lock:
            if self._closed or self._relay is not None or self._path is None:
                return
            from ..settling.handoff import open_relay
            from ..support.events import EventLog

            self._relay = open_relay(self._path, lambda: self._ledger, warn, EventLog(self._events_log))

    def close(self) -> bool:
        """Whether every datagram the relay received has landed (True with no relay: none was sent)."""
        with self._lock:
            self._closed = True
            relay, self._relay = self._relay, None
        return relay is None or relay.close()


class _ViewOnceUsed:
    """The live view, started once a process of the run opens the ledger: until then it has nothing
    to show (it draws the models the run called and the calls that waited), and the wrapper need
    not load the live view's modules and the full ledger beside its child's start."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager[object]], run_dir: str) -> None:
        import threading

        self._make = make
        self._run_dir = run_dir
        self._view: contextlib.AbstractContextManager[object] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._wait, name="quotawrap-live-start", daemon=True)

    def _wait(self) -> None:
        from ..support.files import ledger_used

        while not ledger_used(self._run_dir):
            if self._stop.wait(_MARK_POLL_S):
                return
        view = self._make()
        view.__enter__()
        self._view = view

    def __enter__(self) -> _ViewOnceUsed:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._view is not None:
            self._view.__exit__(None, None, None)


def _beside_child(work: Callable[[], None] | None) -> None:
    try:
        if work is not None:
            work()
    except Exception as exc:  # a head start only: the run's end redoes whatever it needs
        warn(f"could not prepare the run's end: {exc!r}")


def _reclaim_loop(ledger: Books, stop: threading.Event, run_dir: str | None, relay: _Relay) -> None:
    """Charge holds of processes that died (a SIGKILLed grandchild, a crashed run before) while the run goes on.

    The first pass runs beside the child's start rather than before it: until it ends, a dead
    process's hold can only refuse a call for want of room, never let one overspend. With
    ``run_dir`` (the full ledger not opened yet) it waits until a process of the run opens the
    ledger (:func:`files.ledger_used`): a run that makes no guarded call needs no pass, and its
    wrapper never loads the full ledger.
    """
    if run_dir is not None:
        from ..support.files import ledger_used

        while not ledger_used(run_dir):
            if stop.wait(_MARK_POLL_S):
                return
        relay.open()  # settles sent before it is bound land in their process, as without a relay
    from ..ledger.base import ledger_clock  # once the run's processes opened the ledger: the wrapper needs it too

    first = True
    while first or not stop.wait(_RECLAIM_EVERY_S):
        first = False
        try:
            ledger.reclaim_orphans(ledger_clock(ledger)())
        except Exception as exc:
            warn(f"could not reclaim orphaned holds: {exc}")
