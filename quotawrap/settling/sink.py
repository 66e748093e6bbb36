"""Where a guarded call's settle goes: queued for the settler (which may hand it to the wrapper), or landed at once.

:class:`Landing` is the one :class:`~quotawrap.settling.call.SettleSink` of a guard: the calls it admits, its
advances and its admissions (a hold given back) all land through it. Once a call's settle has landed, it frees
the room (wakes this process's waiters), learns the call's reasoning and writes its audit record.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

from ..core.endpoint_prices import CostRule
from ..core.errors import QuotawrapError
from ..core.usage import Usage
from ..ledger import CallPath
from ..ledger.base import Settle, ledger_clock
from ..support.events import BoundEvent, EventLog, RoomSignal
from ..support.log import warn
from .books import Books
from .call import Landed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .draw_notes import DrawNotes
    from .settler import Settler

__all__ = ["Landing", "Store"]

# A settled call's reasoning, as the guard's allowances learn it: (model, reasoning, output, the bound set).
Learn = Callable[[str, int, int, int | None], None]


class Store:
    """The guard's ledger, opened on first use, and its clock: every part of the guard reads both through it, so
    none calls back into the guard for them."""

    __slots__ = ("_clock", "_lock", "_open", "ledger")

    def __init__(
        self, open_ledger: Callable[[], CallPath], ledger: CallPath | None, clock: Callable[[], float] | None
    ) -> None:
        """``clock``: None for the ledger's (``ledger_clock``: on Redis the server's, so hosts with wrong clocks
        share its day) once it is open; this host's until then."""
        self._open = open_ledger
        self.ledger = ledger
        self._clock = clock
        self._lock = threading.Lock()

    def __call__(self) -> CallPath:
        ledger = self.ledger
        if ledger is None:
            with self._lock:
                ledger = self.ledger
                if ledger is None:
                    ledger = self.ledger = self._open()
        return ledger

    def now(self) -> float:
        """The time by the guard's clock. A store that cannot be opened is the reserve's to report."""
        clock = self._clock
        if clock is None:
            try:
                ledger = self()
            except QuotawrapError:
                return time.time()
            clock = self._clock = ledger_clock(ledger)
        return clock()

    def clock(self) -> Callable[[], float]:
        """The clock itself, read without this in between (once the ledger is open)."""
        self.now()
        assert self._clock is not None or self.ledger is None
        return self._clock if self._clock is not None else self.now


class Landing:
    """Lands the settles of one process; never raises into the caller."""

    __slots__ = ("_books", "_events", "_room_signal", "_store", "learn", "notes", "settler")

    def __init__(self, store: Store, *, books: Books, events: EventLog, room_signal: RoomSignal) -> None:
        """Its ``learn`` is the guard's allowances' (set once they are made); a settler and draw notes, when the
        guard settles in the background."""
        self._store = store
        self._books = books
        self._events = events
        self._room_signal = room_signal
        self.learn: Learn | None = None
        self.settler: Settler | None = None
        self.notes: DrawNotes | None = None

    def land(self, settle: Settle, landed: Landed | None, bound: BoundEvent | None = None) -> None:
        """Settle or release one hold: queued for the settler, or at once. ``bound``: the call's bound event (the
        guard bounded it), recorded here unless the wrapper takes it with the settle."""
        settler = self.settler
        if settler is None:
            if bound is not None:
                self._events.bounds((bound,))
            try:
                self._store().settle_many((settle,))
            except Exception as exc:
                # The hold stays open and the wrapper charges it at exit; the caller's answer is intact.
                warn(f"could not settle a call: {exc}; the wrapper will charge its hold")
                return
            if landed is not None:
                self.landed(landed)
            return
        then: Callable[[], None] | None = None if landed is None else functools.partial(self.landed, landed)
        notes = self.notes
        if notes is not None and settle.drawn is not None and settle.event != "close":
            then = notes.clearing(settle.hold_id, then)  # once the wrapper has the settle, or it landed
        if not settler.submit(settle, then, bound) and bound is not None:
            self._events.bounds((bound,))

    def landed(self, landed: Landed) -> None:
        """A call's settle has landed: its room is free (wake this process's waiters), learn its reasoning, audit."""
        self._room_signal.room_freed()
        context, usage = landed.context, landed.usage
        if usage is not None and context.endpoint != "embeddings" and self.learn is not None:
            self.learn(context.model, usage.reasoning_tokens, usage.completion_tokens, context.output_bound)
        try:
            self._books.audit(context, landed.state, usage, landed.cost, landed.latency_s, anomaly=landed.anomaly)
        except Exception as exc:
            warn(f"cannot audit a call to {context.model}: {exc}")

    def price(self, model: str, usage: Usage, rule: CostRule | None = None) -> int:
        return self._books.actual_cost(model, usage, rule)

    def record_bound(self, bound: BoundEvent) -> None:
        self._events.bounds((bound,))

    def settles_in_transit(self) -> bool:
        """Whether settles of this process may not have landed yet (queued here, or handed to the wrapper)."""
        settler = self.settler
        if settler is None:
            return False
        relay = settler.relay
        return settler.landing or (relay is not None and relay.unsynced > 0)

    def flush(self, timeout: float = -1) -> bool:
        """Land every settle queued so far, and wait until the wrapper has landed those this process handed
        to it (tests, a program that reads the ledger itself). False on timeout."""
        settler = self.settler
        if settler is None:
            return True
        relay = settler.relay
        if relay is None:
            return settler.flush(timeout)
        deadline = time.monotonic() + (timeout if timeout >= 0 else 3600.0)
        landed_here = settler.flush(timeout)
        return relay.sync(max(deadline - time.monotonic(), 0)) and landed_here
