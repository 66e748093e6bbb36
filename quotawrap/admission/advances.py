"""Advances: room a guarded process reserves ahead for its next calls, so most calls never wait on the ledger.

A reserve is one ledger transaction (SQLite) or round trip (Redis) on the caller's path, and a large share of
what the guard adds to a call (docs/benchmarks.md measures it). Where room is plenty, a call reserves an
advance of several calls' room instead, and the next calls of its process are drawn from what is left of it,
under a lock, without asking the ledger.

Exact as a hold per call is:

* An advance is a hold: the ledger checked every limit when it took it and counts all of it in flight. A call is
  drawn from it only when what is left covers the call's whole reserve, tokens and cost; else it reserves alone.
* A call is drawn only once a note of it (a ``draw``) is where the wrapper reads it even after a kill (a slot of a
  shared file: :mod:`quotawrap.settling.draw_notes`), and its settle carries the same
  :class:`~quotawrap.ledger.base.Drawn`: the ledger splits the call's own row from the advance's as the first of
  the two lands, once, in the transaction that lands it, so what is in flight never drops below the truth.
* What is not drawn is given back (a *close*) when the advance is ``ADVANCE_S`` old, too small for the next
  call, idle, at exit, and before ``fork()`` (the child starts with none, so two processes never draw from one
  advance). A process killed with an advance open: its wrapper lands every note it received, so each call in
  flight has its own row, charged whole as any hold, and then releases the rest. Where it cannot be sure it
  landed every note (the store was away, a nested wrapper, a later reclaim) it charges the rest whole instead:
  pessimistic by at most ``ADVANCE_CALLS - 1`` calls' reserve and ``1 / ROOM_SHARE`` of the room, never short.
* Only where room is plenty (:func:`advance_size`): near a cap, a wall or the run's cost cap, calls reserve one
  by one as before, so the waiting lines, the usable share of a cap and every refusal are unchanged there.
  A limit that moves while an advance is open (a sync lowers the pool) binds its calls when it closes, within
  ``ADVANCE_S``, as it binds the calls already in flight.

Only calls that enforce (never ``--watch``), to endpoints whose answer is all their settle needs (no task or
context follows), and only on a ledger that lands drawn settles (``Ledger.takes_advances``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ..core.errors import StoreError
from ..core.quota import Counters, Limit, Verdict, counts_cost
from ..ledger.base import ADVANCE, Decision, Drawn, HoldRequest, LimitsFor, Settle, new_hold_id
from ..settling.settler import before_flush_all

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..ledger.interface import CallPath

__all__ = ["ADVANCE_CALLS", "ADVANCE_S", "ENDPOINTS", "ROOM_SHARE", "Advances", "advance_size"]

ADVANCE_CALLS = 16  # an advance holds at most this many calls' reserve (the one that takes it included)
ROOM_SHARE = 64  # and beyond that call's own reserve, at most 1/ROOM_SHARE of the room its tightest limit leaves
ADVANCE_S = 1.0  # seconds after which what is left is given back (a limit that moved binds again)
ENDPOINTS = frozenset({"chat", "bot_chat", "responses", "completions", "embeddings"})


def advance_size(
    limits: Sequence[Limit], counters: Mapping[str, Counters], reserve: int, reserve_cost: int
) -> tuple[int, int] | None:
    """The tokens and cost of an advance for a call reserving ``reserve`` and ``reserve_cost``, given the
    counters last seen; None when it would not hold a second such call (then the call reserves alone).

    Beyond the call's own reserve: ``ADVANCE_CALLS - 1`` more of it, and at most ``1 / ROOM_SHARE`` of what
    the tightest limit leaves (walls included: near a soft-evict line calls ask one by one). The cost is the
    call's, scaled as its tokens are, and within the same share of the cost cap's room.
    """
    if reserve <= 0 or reserve_cost < 0:
        return None
    room: int | None = None
    cost_room: int | None = None
    for limit in limits:
        c = counters.get(limit.scope, Counters())
        free = limit.cap - c.settled - (0 if limit.kind == "wall" else c.in_flight)
        if counts_cost(limit.scope):
            cost_room = free if cost_room is None else min(cost_room, free)
        else:
            room = free if room is None else min(room, free)
    extra = (ADVANCE_CALLS - 1) * reserve
    if room is not None:
        extra = min(extra, room // ROOM_SHARE)
    if extra < reserve:
        return None
    extra_cost = -(-reserve_cost * extra // reserve)  # rounded up: never less per token than the call
    if cost_room is not None and extra_cost > cost_room // ROOM_SHARE:
        return None
    return reserve + extra, reserve_cost + extra_cost


@dataclasses.dataclass
class _Advance:
    hold_id: str
    left: int
    left_cost: int
    taken_at: float  # time.monotonic()
    verdict: Verdict
    counters: Mapping[str, Counters]

    def left_over(self) -> Drawn:
        """What a close gives back: what no call drew."""
        return Drawn(self.hold_id, self.left, self.left_cost, ADVANCE, None, 0.0, 0.0)


class _Key(NamedTuple):
    run_id: str
    model: str
    day: str


class Advances:
    """This process's open advances, one per (run, model, day). Thread-safe; fork-safe (a child has none)."""

    def __init__(
        self,
        ledger: Callable[[], CallPath],
        land: Callable[[Settle], None],
        tell: Callable[[Settle], bool],
        listening: Callable[[], bool] = lambda: True,
    ) -> None:
        """``land`` hands a close to the settler (or the wrapper), off the caller's path; ``tell`` notes a draw for
        the wrapper (True once noted): a call is drawn only once the wrapper would learn of it, so a process
        killed with calls in flight leaves each its own row, charged whole, and what it did not draw released."""
        self._ledger = ledger
        self._land = land
        self._tell = tell
        self._listening = listening  # whether ``tell`` may work: no advance is taken while it cannot
        self._lock = threading.Lock()
        self._open: dict[_Key, _Advance] = {}
        self._closer: threading.Thread | None = None
        self.drawn = 0  # calls admitted from an advance (not by a reserve of their own)
        self.declined = False  # the store refused an advance that every limit let through: it takes none
        _all.add(self)

    def draw(self, hold: HoldRequest, started_at: float) -> Decision | None:
        """The call's admission from its process's open advance; None when none covers it (it reserves)."""
        key = _Key(hold.run_id, hold.model, hold.day)
        with self._lock:
            advance = self._open.get(key)
            if advance is None:
                return None
            if hold.reserve <= 0:  # its row would be split from an advance that may be gone by then
                return None
            if (
                advance.left < hold.reserve
                or advance.left_cost < hold.reserve_cost
                or time.monotonic() - advance.taken_at > ADVANCE_S
            ):
                self._close(key)
                return None
            return self._drawn(advance, hold, started_at)

    def _drawn(self, advance: _Advance, hold: HoldRequest, started_at: float) -> Decision | None:
        """Draw ``hold`` from ``advance`` once the wrapper knows of it (under the lock: a close in between would
        give back what the call took)."""
        if not self._tell(Settle(hold.hold_id, "draw", drawn=Drawn.of(advance.hold_id, hold, started_at))):
            return None
        advance.left -= hold.reserve
        advance.left_cost -= hold.reserve_cost
        self.drawn += 1
        return Decision(hold.hold_id, advance.verdict, True, advance.counters, advance_id=advance.hold_id)

    def take(
        self,
        hold: HoldRequest,
        started_at: float,
        limits_for: LimitsFor,
        limits: Sequence[Limit],
        seen: Mapping[str, Counters],
    ) -> Decision | None:
        """Reserve an advance sized from the counters ``seen`` last and draw the call from it: its admission,
        or None when room is short or the ledger refused the advance (the call then reserves alone)."""
        if self.declined:
            return None
        size = advance_size(limits, seen, hold.reserve, hold.reserve_cost)
        if size is None or not self._listening():
            return None
        request = dataclasses.replace(
            hold,
            hold_id=new_hold_id(),
            reserve=size[0],
            reserve_cost=size[1],
            endpoint=ADVANCE,
            waiter=None,
            ticket=None,
            can_wait=False,
            advance=True,
        )
        try:
            decision = self._ledger().reserve(request, limits_for)
        except StoreError:  # it may have landed before the link broke: give it back
            self._land(Settle(request.hold_id, "release"))
            raise
        if not decision.held:
            # Refused with every limit fitting: the store splits no call from an advance (Redis Cluster, where
            # the split would span two slots). Asking again on every call would only cost the caller.
            self.declined = decision.verdict.allowed
            return None
        key = _Key(hold.run_id, hold.model, hold.day)
        advance = _Advance(request.hold_id, size[0], size[1], time.monotonic(), decision.verdict, decision.counters)
        with self._lock:
            if key in self._open:  # another thread took one meanwhile: one open per key
                self._close(key)
            self._open[key] = advance
            self._watch()
            return self._drawn(advance, hold, started_at)

    def close_all(self) -> None:
        """Give back what is left of every open advance (at exit, before fork, when idle)."""
        with self._lock:
            for key in list(self._open):
                self._close(key)

    def _close(self, key: _Key) -> None:
        advance = self._open.pop(key)
        self._land(Settle(advance.hold_id, "close", drawn=advance.left_over()))

    def _forget(self) -> None:
        """In a forked child: the parent's advances are the parent's to draw from and to give back."""
        self._lock = threading.Lock()  # another thread of the parent may have held it at the fork
        self._open.clear()
        self._closer = None

    def _watch(self) -> None:
        """Start the thread that gives back idle advances (once per process, under the lock)."""
        if self._closer is not None and self._closer.is_alive():
            return
        self._closer = threading.Thread(target=self._close_idle, name="quotawrap-advances", daemon=True)
        self._closer.start()

    def _close_idle(self) -> None:
        while True:
            time.sleep(ADVANCE_S / 2)
            now = time.monotonic()
            with self._lock:
                for key, advance in list(self._open.items()):
                    if now - advance.taken_at > ADVANCE_S:
                        self._close(key)


_all: weakref.WeakSet[Advances] = weakref.WeakSet()


def _close_every_advance() -> None:
    for advances in list(_all):
        advances.close_all()


def _forget_in_child() -> None:
    for advances in list(_all):
        advances._forget()


# Before every settler's queue lands at exit (atexit, a multiprocessing child's finalizers) and before fork, so
# the closes land with them and a forked child starts with no advance.
before_flush_all(_close_every_advance)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
