"""How much a model thinks: learned from its settled calls, it sets the bound on calls that leave their output open.

A request that lets a model think and sets no bound of its own (neither ``max_tokens`` nor
``max_completion_tokens``; Responses: no ``max_output_tokens``) is sent by the guard with one at

    Ark's default answer (4,096) + the p99 of the model's reasoning tokens,

at least ``--thinking-floor`` and at most 65,536 and the request's own worst case (the default answer
plus the model's reasoning ceiling), so the provider stops the generation there
(``admission.plan_output``). The answer keeps its default room, and reasoning the room the model has
needed in 99 of 100 recent calls: too small starves thinking (the answer is cut, and billed), too large
only makes holds bigger. A model that never reasons keeps ``max(4,096, floor)``. Without history, the
default answer + the floor (8,192): small and exact; a cold call that reasons longer is cut, counted, and
teaches the lesson below. ``--reasoning-reserve learned`` also reserves the p99 beside a caller's
``max_tokens``.

A call cut by the guard's own bound shows reasoning up to the bound, which would keep the p99 from
ever growing past it; such a call counts here as twice its bound, so a model that needs more earns
it within a few calls (in this process; other processes learn it from their own cuts).

The history is read from the ledger once per model and process, then every 30 s; calls that ask while
a model's first read is under way wait for it (they would otherwise plan as if the model had none).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from ..core.estimate import MAX_OUTPUT_TOKENS, learned_allowance
from ..ledger import CallPath
from ..ledger.base import CallRecord
from ..ledger.reasoning import reasoning_samples

__all__ = ["HISTORY_CALLS", "HISTORY_S", "AllowanceBook", "model_reasoning"]

HISTORY_S = 86_400.0  # the last day: recent enough to be today's prompts, few enough rows to read every 30 s
HISTORY_CALLS = 1000  # per model, the most recent
_REFRESH_S = 30.0
# A settle that cannot raise the p99 keeps the figure computed before (see AllowanceBook.observe), but
# after this many such settles of a model its p99 is computed anew, so that it can come down.
_RECOMPUTE_EVERY = 64


def model_reasoning(records: Iterable[CallRecord]) -> dict[str, int]:
    """Per model with history, the p99 of its reasoning (what ``status`` shows)."""
    samples = reasoning_samples(records, HISTORY_CALLS)
    learned = {model: learned_allowance(values, floor=0) for model, values in samples.items()}
    return {model: value for model, value in learned.items() if value is not None}


class AllowanceBook:
    """Per model: ledger history (re-read every 30 s) plus what this process saw settle since."""

    def __init__(
        self,
        ledger: Callable[[], CallPath],
        *,
        clock: Callable[[], float] = time.time,
        refresh_s: float = _REFRESH_S,
    ) -> None:
        self._ledger = ledger
        self._clock = clock
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._read_at: dict[str, float] = {}  # per model: a process reads only the models it calls
        self._reading: dict[str, threading.Event] = {}  # per model, the read under way: set once it is done
        self._history: dict[str, list[int]] = {}
        self._recent: dict[str, deque[int]] = {}  # settled here since the last read of the ledger
        self._cut: dict[str, deque[int]] = {}  # lessons of calls our bound cut: kept, the ledger lacks them
        # per model, (p99, settles since): every bounded call asks, and the pick over ~1,000 values cost
        # more than the rest of planning its bound
        self._known: dict[str, tuple[int | None, int]] = {}

    def reasoning(self, model: str) -> int | None:
        """The p99 of the model's reasoning, or None when the model has no settled call anywhere yet."""
        self._refresh(model)
        with self._lock:
            known = self._known.get(model)
            if known is not None:
                return known[0]
            values = [*self._history.get(model, ()), *self._recent.get(model, ()), *self._cut.get(model, ())]
            learned = learned_allowance(values[-HISTORY_CALLS:], floor=0)
            self._known[model] = (learned, 0)
        return learned

    def observe(self, model: str, reasoning: int, output: int, bound: int | None) -> None:
        """A call of this process settled with ``output`` tokens out (``reasoning`` of them), under our ``bound``."""
        with self._lock:
            if bound is not None and output >= bound:
                value, kept = min(MAX_OUTPUT_TOKENS, 2 * bound), self._cut
            else:
                value, kept = reasoning, self._recent
            lessons = kept.get(model)
            if lessons is None:  # not setdefault: its default, a deque, would be built on every settle
                lessons = kept[model] = deque(maxlen=HISTORY_CALLS)
            lessons.append(value)
            # A value at or below the p99 (the window's k-th largest, k fixed once it holds 1,000 values)
            # cannot raise it, whichever old value it pushes out: the figure known stays at or above the
            # truth (a bound a little large, never a starved one) until it is computed anew.
            known = self._known.get(model)
            if known is not None and known[0] is not None and value <= known[0] and known[1] + 1 < _RECOMPUTE_EVERY:
                self._known[model] = (known[0], known[1] + 1)
            else:
                self._known.pop(model, None)

    def _refresh(self, model: str) -> None:
        """Read the model's history from the ledger when it is due: one read per model at a time. A call that
        asks while another's read is under way plans with the history read before it, or, when this is the
        model's first read, waits for it: planning as if the model had none would reserve the no-history
        bound for every call of a burst."""
        now = self._clock()
        with self._lock:
            read_at = self._read_at.get(model)
            if read_at is not None and now - read_at < self._refresh_s:
                return
            reading = self._reading.get(model)
            if reading is None:
                reading = self._reading[model] = threading.Event()
                first = None
            elif model in self._history:
                return  # a refresh under way: the history read before serves meanwhile
            else:
                first = reading
        if first is not None:
            first.wait()
            return
        try:
            history = self._ledger().reasoning_history(model, since=now - HISTORY_S, limit=HISTORY_CALLS)
        except BaseException:
            with self._lock:
                del self._reading[model]  # the next call reads again
            reading.set()
            raise
        with self._lock:
            self._history[model] = history
            self._recent.pop(model, None)  # the ledger has them now
            self._known.pop(model, None)
            self._read_at[model] = now
            del self._reading[model]
        reading.set()
