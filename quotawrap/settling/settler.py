"""Settle guarded calls off the caller's path: one daemon thread per process, settles in batches.

The reserve must be answered before a call is sent; its settle need not hold the caller. A call's
settle is queued here and a daemon thread lands the queue in one ledger call
(:meth:`Ledger.settle_many`: one SQLite transaction, one Redis pipeline).

Sound while pending: a queued settle has not touched its hold, so the ledger still counts the whole
hold in flight and a later reserve sees at least the truth. Nothing is lost: the queue is flushed at
interpreter exit (atexit, which also runs after Ctrl-C; in a multiprocessing child started by fork,
which ends with ``os._exit()``, its exit finalizers), before ``fork()`` in the parent (the child
starts empty), and on demand (:meth:`Settler.flush`). A process killed before its queue lands leaves
those holds open, and the wrapper's ``resolve_run`` (or reclaim) charges them whole, as unresolved.

Under ``quotawrap run`` a guarded child that draws advances hands its settles to the wrapper instead (``relay``,
:mod:`quotawrap.settling.handoff`), which lands them off this process's GIL; this queue then takes only
what the wrapper did not take, and the settles of a process whose call waits for room.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence

from ..ledger.base import Settle
from ..ledger.interface import CallPath
from ..support.log import warn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..support.events import BoundEvent
    from .handoff import Sender

__all__ = ["MAX_BATCH", "Settler", "before_flush_all", "flush_all"]

MAX_BATCH = 256  # settles per ledger call: bounds one transaction's lock time
LINGER_S = 0.005  # once woken, the thread gathers settles this long: fewer, larger batches, fewer GIL hand-offs
EXIT_FLUSH_S = 30.0  # at exit, how long to wait for a batch the thread is landing (or the store to come back)
RETRY_MIN_S, RETRY_MAX_S = 0.05, 2.0  # a batch the ledger refused is asked again after these (doubling)

Landed = Callable[[], None] | None  # run once the settle has landed (the audit record)

_settlers: weakref.WeakSet[Settler] = weakref.WeakSet()


class Settler:
    """A per-process queue of settles and the daemon thread that lands them. Thread-safe."""

    def __init__(
        self,
        ledger: Callable[[], CallPath],
        *,
        what: str = "call",
        relay: Sender | None = None,
        relay_now: Callable[[], bool] | None = None,
    ) -> None:
        """``relay``: the wrapper's socket (a guarded child's): settles go there while ``relay_now()`` says
        so, and land here when it says no or the wrapper does not take them."""
        self._ledger = ledger  # a getter: the guard opens its ledger lazily
        self._what = what
        self._relay = relay
        self._relay_now = relay_now
        self._fresh()
        _settlers.add(self)

    def _fresh(self) -> None:
        self._queue: deque[tuple[Settle, Landed]] = deque()
        self._lock = threading.Lock()  # one batch lands at a time
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._failing = False  # warned once per outage

    def submit(self, settle: Settle, landed: Landed = None, bound: BoundEvent | None = None) -> bool:
        """Queue one settle; returns at once (at interpreter exit, lands it at once instead). True when the
        wrapper took it, and ``bound`` with it (it records that event); False: ``bound`` is the caller's."""
        relay = self._relay
        if relay is not None and (self._relay_now is None or self._relay_now()) and relay.send(settle, bound):
            # The wrapper lands it; the record and the lesson are this process's, taken now.
            _after_landing(landed)
            return True
        self._queue.append((settle, landed))
        if _exiting or sys.is_finalizing():
            # After atexit no new thread runs (starting one waits forever): a stream the program left
            # open is closed by the interpreter's last collection, and its settle lands here.
            self.flush()
            return False
        thread = self._thread
        if thread is None or not thread.is_alive() or self._pid != os.getpid():
            self._start()
        self._wake.set()
        return False

    def _start(self) -> None:
        with _start_lock:
            if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="quotawrap-settler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        backoff = RETRY_MIN_S
        while True:
            self._wake.wait()
            self._wake.clear()  # a submit after this line sets it again: nothing waits unseen
            if len(self._queue) < MAX_BATCH:
                time.sleep(LINGER_S)
            if self.flush():
                backoff = RETRY_MIN_S
            else:  # the store is away: keep the settles (exact once it is back), ask again later
                time.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                self._wake.set()

    @property
    def relay(self) -> Sender | None:
        return self._relay

    @property
    def pending(self) -> int:
        """Settles queued and not yet taken for landing."""
        return len(self._queue)

    @property
    def landing(self) -> bool:
        """Whether settles are queued or a batch taken from the queue is being landed now."""
        return bool(self._queue) or self._lock.locked()

    def flush(self, timeout: float = -1) -> bool:
        """Land every settle queued so far. False when a batch in progress did not end within ``timeout``,
        or the ledger refused a batch (it stays queued, in order: settles are idempotent, so a retry of a
        batch that partly landed is exact)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            while self._queue:
                batch: list[tuple[Settle, Landed]] = []
                while self._queue and len(batch) < MAX_BATCH:
                    batch.append(self._queue.popleft())
                if not self._land(batch):
                    self._queue.extendleft(reversed(batch))
                    return False
        finally:
            self._lock.release()
        return True

    def _land(self, batch: Sequence[tuple[Settle, Landed]]) -> bool:
        try:
            self._ledger().settle_many([settle for settle, _ in batch])
        except Exception as exc:  # never let the thread die; until they land the holds count whole
            if not self._failing:
                warn(f"could not settle {len(batch)} {self._what}(s) yet: {exc}; retrying (holds count whole)")
            self._failing = True
            return False
        self._failing = False
        for _, landed in batch:
            _after_landing(landed)
        return True

    def _after_fork_in_child(self) -> None:
        # The parent flushed before forking; whatever it queued since is its own to land.
        self._fresh()


_start_lock = threading.Lock()
_before_flush_all: list[Callable[[], None]] = []


def before_flush_all(step: Callable[[], None]) -> None:
    """Run ``step`` first whenever every queue is landed (at exit, before fork): what it queues lands too."""
    _before_flush_all.append(step)


def flush_all(timeout: float = EXIT_FLUSH_S, *, retry: bool = True) -> None:
    """Land every settler's queue: at exit, retrying while the store is away (up to ``timeout``);
    before fork once (what does not land stays queued in the parent, the child starts empty)."""
    for step in _before_flush_all:
        try:
            step()
        except Exception as exc:  # pragma: no cover - never stops an exit or a fork
            warn(f"before landing the settles: {exc}")
    deadline = time.monotonic() + timeout
    for settler in list(_settlers):
        if settler._pid != os.getpid():
            continue
        # What is still queued at the deadline stays held: the wrapper charges it whole.
        while not settler.flush(max(deadline - time.monotonic(), 0)) and retry and time.monotonic() < deadline:
            time.sleep(RETRY_MIN_S)


class _ForkToken:
    """What multiprocessing's after-fork registry holds a weak reference to (it needs an object)."""


_FORK_TOKEN = _ForkToken()


def _flush_at_mp_exit(_token: object) -> None:
    # A multiprocessing child started by fork ends with os._exit(): atexit never runs there, its
    # own finalizers do. Registered after its after-fork step, which clears the finalizers first.
    import multiprocessing.util

    multiprocessing.util.Finalize(None, flush_all, exitpriority=10)


def _fresh_in_child() -> None:
    global _start_lock
    _start_lock = threading.Lock()
    for settler in list(_settlers):
        settler._after_fork_in_child()
    _watch_multiprocessing(now=False)


def _watch_multiprocessing(*, now: bool) -> None:
    """Flush at a multiprocessing child's exit: ``now`` (this process may be one), and in each forked later."""
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        if now:
            _flush_at_mp_exit(_FORK_TOKEN)
        mp_util.register_after_fork(_FORK_TOKEN, _flush_at_mp_exit)


def _at_exit() -> None:
    global _exiting
    _exiting = True
    flush_all()


_exiting = False
atexit.register(_at_exit)
_watch_multiprocessing(now=True)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: flush_all(retry=False), after_in_child=_fresh_in_child)


def _after_landing(landed: Callable[[], None] | None) -> None:
    """Run a settle's ``landed`` callback (record and lesson); it never takes the settler down."""
    if landed is not None:
        try:
            landed()
        except Exception as exc:  # pragma: no cover - the audit writer never raises
            warn(f"after a settle: {exc}")
