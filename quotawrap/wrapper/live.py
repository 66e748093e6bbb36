"""The live view: while the child runs, how close each guarded model is to the limit that binds it.

Settled tokens are solid blocks, open reservations (in flight) shaded ones, so a call refused
at 87% settled explains itself: settled + in flight is what the guard checks, and the bar
shows both (the post-mortem's lesson: showing half the state makes correct behaviour look
like a bug)::

    deepseek-v4  1.21M / 1.95M ██████▒░░░ 62% (+34k in flight)

The percent is settled / limit (what was spent); the bar adds the in-flight share. A model's
line is drawn against whichever of its limits has the least headroom: its daily limit, or the
run's cap (then named, and the numbers are the run's), which also has a line of its own::

    run          12.4k / 20k ██████▒▒░░ 62% (+5.1k in flight)
    deepseek-v4  12.4k / 20k ██████▒▒░░ 62% of run cap (+5.1k in flight)

On a terminal the lines are pinned to the bottom rows (a scroll region, as ``apt`` does), so
the child's own output, which shares the terminal, scrolls above them and is never overwritten.
Elsewhere (CI logs) only crossings of the ``--alert-at`` percents of a limit (50/80/100 by default) are
logged, as plain lines: one per look at the ledger, naming the highest percent passed since the last.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TextIO

from ..config.settings import Settings
from ..core import quota
from ..core.budgets import BudgetUse
from ..core.records import Record
from ..core.thresholds import crossed, highest, parse_thresholds
from ..ledger import Ledger, model_day_key, run_key
from ..ledger.base import ledger_clock
from ..ledger.budgets import run_budget_uses
from ..support.events import EventsTail, RunEvents
from ..support.log import printable

__all__ = [
    "DAILY_LIMIT",
    "FREE",
    "RUN_CAP",
    "RUN_LABEL",
    "SHADED",
    "SOLID",
    "BottomBlock",
    "Gauge",
    "LiveView",
    "Reading",
    "bar",
    "block_lines",
    "day_limit",
    "human",
    "percent",
    "read_gauges",
    "render_line",
    "tightest",
    "wait_line",
    "warning_line",
]

SOLID, SHADED, FREE = "█", "▒", "░"
DAILY_LIMIT = "daily limit"
RUN_CAP = "run cap"
RUN_LABEL = "run"
BAR_WIDTH = 10


# -- pure rendering ------------------------------------------------------------------------------


def bar(settled: int, in_flight: int, limit: int, width: int = BAR_WIDTH) -> str:
    """``width`` cells: settled solid, in flight shaded, the rest free; never longer than the limit.

    Cells are rounded down, so a full bar means the limit is reached; an in-flight amount too
    small for a cell of its own still gets one while there is room, or the reason for a block
    would be invisible.
    """
    settled, in_flight = max(0, settled), max(0, in_flight)
    if limit <= 0:  # nothing fits: any use at all fills the bar
        solid = width if settled else 0
        shaded = width - solid if in_flight else 0
    else:
        solid = min(width, settled * width // limit)
        shaded = 0
        if in_flight:
            filled = min(width, (settled + in_flight) * width // limit)
            shaded = max(filled - solid, 1 if solid < width else 0)
    return SOLID * solid + SHADED * shaded + FREE * (width - solid - shaded)


def _three_digits(value: float) -> str:
    decimals = 0 if value >= 100 else 1 if value >= 10 else 2
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def human(n: int) -> str:
    """Three significant digits with a k/M/B suffix: 950, 34k, 1.21M."""
    if n < 0:
        return "-" + human(-n)
    if n < 1000:
        return str(n)
    for scale, suffix in ((1e3, "k"), (1e6, "M"), (1e9, "B")):
        text = _three_digits(n / scale)
        # 999_999 rounds to "1000k": say "1M" instead
        if float(text) < 1000 or suffix == "B":
            return text + suffix
    raise AssertionError("unreachable")  # pragma: no cover


def percent(settled: int, limit: int) -> int:
    """Settled as a whole percent of the limit, rounded down (99.9% is not yet 100%)."""
    if limit <= 0:
        return 100 if settled > 0 else 0
    return max(0, settled) * 100 // limit


def fraction(settled: int, limit: int) -> float:
    if limit <= 0:
        return math.inf if settled > 0 else 0.0
    return settled / limit


def render_line(model: str, settled: int, in_flight: int, limit: int, limit_name: str) -> str:
    """``deepseek-v4  1.21M / 1.95M ██████▒░░░ 62% (+34k in flight)``.

    ``limit_name`` is shown ("62% of run cap") when the line's limit is not the one its label
    implies; pass "" for a model's own daily limit and for the run line's cap.
    """
    text = f"{model}  {human(settled)} / {human(limit)} {bar(settled, in_flight, limit)} {percent(settled, limit)}%"
    if limit_name:
        text += f" of {limit_name}"
    if in_flight > 0:
        text += f" (+{human(in_flight)} in flight)"
    return text


def warning_line(label: str, threshold: float, gauge: Gauge) -> str:
    """``quotawrap: deepseek-v4 at 80% of daily limit (1.56M / 1.95M, +34k in flight)``."""
    numbers = f"{human(gauge.settled)} / {human(gauge.limit)}"
    if gauge.in_flight > 0:
        numbers += f", +{human(gauge.in_flight)} in flight"
    return f"quotawrap: {printable(label)} at {round(threshold * 100)}% of {gauge.limit_name} ({numbers})"


# -- which numbers a line shows ------------------------------------------------------------------


class Gauge(Record, frozen=True):
    """One limit and the counters it is checked against."""

    settled: int
    in_flight: int
    limit: int
    limit_name: str  # DAILY_LIMIT or RUN_CAP

    @property
    def headroom(self) -> int:
        """Tokens the next call may still reserve under this limit."""
        return self.limit - self.settled - self.in_flight

    @property
    def fraction(self) -> float:
        return fraction(self.settled, self.limit)


class Reading(Record, frozen=True):
    """One poll of the ledger: the run cap (if any) and each model's daily limit, for this run's models, and the
    budgets its calls may count against."""

    run: Gauge | None
    models: dict[str, Gauge]
    budgets: tuple[BudgetUse, ...] = ()


def day_limit(snapshot: quota.Snapshot | None, settings: quota.QuotaSettings, day: str) -> int:
    """A model's daily limit as the guard sees it: the effective limit or the usage wall, whichever is lower.

    (The balance wall, "evicted once used" for a pool already below it, is no amount to draw a
    bar against; ``quotawrap status`` explains it.)
    """
    limits = quota.model_day_limits(snapshot, settings, today=day)
    return min(limit.cap for limit in limits if limit.name != "balance_wall")


def tightest(day: Gauge, run: Gauge | None) -> Gauge:
    """The limit closest to refusing a call: the least headroom (a tie goes to the model's own)."""
    return run if run is not None and run.headroom < day.headroom else day


def read_gauges(ledger: Ledger, settings: Settings, run_id: str, now: float) -> Reading:
    """The counters the guard decides on, for every model this run has called (blocked calls too)."""
    models = sorted(ledger.run_totals(run_id).models)
    day = quota.beijing_day(now)
    day_keys = [model_day_key(model, day) for model in models]
    counters = ledger.counters([run_key(run_id), *day_keys]) if models else {}
    run = None
    if settings.cap_tokens is not None and models:
        spent = counters[run_key(run_id)]
        run = Gauge(spent.settled, spent.in_flight, settings.cap_tokens, RUN_CAP)
    qsettings = settings.quota
    gauges = {
        model: Gauge(
            counters[key].settled,
            counters[key].in_flight,
            day_limit(ledger.snapshot(model), qsettings, day),
            DAILY_LIMIT,
        )
        for model, key in zip(models, day_keys, strict=True)
    }
    return Reading(run, gauges, tuple(run_budget_uses(ledger, now, run_id, settings.tag)))


def block_lines(reading: Reading) -> list[str]:
    """The run line (with --cap-tokens), then one line per model at its tightest limit."""
    rows: list[tuple[str, Gauge, str]] = []
    if reading.run is not None:
        rows.append((RUN_LABEL, reading.run, ""))
    for model, day in reading.models.items():
        shown = tightest(day, reading.run)
        rows.append((printable(model), shown, "" if shown is day else shown.limit_name))  # the program's words
    width = max((len(label) for label, _, _ in rows), default=0)
    return [
        render_line(label.ljust(width), gauge.settled, gauge.in_flight, gauge.limit, name)
        for label, gauge, name in rows
    ] + [printable(use.line()) for use in reading.budgets]


def wait_line(events: RunEvents) -> str | None:
    """``waiting  3 call(s) for room now; 21 waited, p50 0.07s, p99 0.17s``, or None when none ever waited."""
    if not events.waiting_now and not events.waits:
        return None
    text = f"waiting  {events.waiting_now} call(s) for room now"
    if events.waits:
        text += f"; {len(events.waits)} waited, p50 {events.wait_p50:.2f}s, p99 {events.wait_p99:.2f}s"
    return text


# -- the terminal --------------------------------------------------------------------------------

_SAVE, _RESTORE = "\x1b7", "\x1b8"  # DECSC / DECRC: cursor position (and attributes)
_INDEX = "\x1bD"  # IND: down one line, scrolling at the bottom margin, keeping the column
_RESET_MARGINS = "\x1b[r"
_MIN_CHILD_ROWS = 2


def _goto(row: int) -> str:
    return f"\x1b[{row};1H"


def _clear_line() -> str:
    return "\x1b[0m\x1b[2K"


class BottomBlock:
    """Escape sequences that pin lines to the bottom rows of a terminal, out of the child's way.

    The rows are taken out of the scroll region (DECSTBM), so whatever the child prints
    scrolls above them and is never overwritten; each redraw saves the child's cursor, paints
    the rows and puts the cursor back. Pure: it returns text, the caller writes it.
    """

    def __init__(self) -> None:
        self.reserved = 0  # bottom rows taken from the scroll region
        self._rows = 0  # terminal height the region was set for

    def frame(self, lines: Sequence[str], columns: int, rows: int) -> str:
        """Draw ``lines`` in the reserved rows, taking more rows first if needed."""
        keep = min(len(lines), rows - _MIN_CHILD_ROWS)
        if keep <= 0:
            return ""
        out: list[str] = []
        if self.reserved and rows != self._rows:
            # Resized: the old rows moved with the reflow, so clearing them by number could wipe
            # the child's text; leave them to scroll away and take the bottom rows afresh.
            out.append(_SAVE + _RESET_MARGINS + _RESTORE)
            self.reserved = 0
        if keep > self.reserved:
            grow = keep - self.reserved
            # Scroll the child's text up by the rows we take, then come back to the same
            # place in it: its cursor stays inside the smaller region, its column untouched.
            out.append(
                _INDEX * grow
                + f"\x1b[{grow}A"
                + _SAVE
                + f"\x1b[1;{rows - keep}r"  # moves the cursor home, hence the save/restore
                + _RESTORE
            )
            self.reserved, self._rows = keep, rows
        out.append(_SAVE)
        top = rows - self.reserved + 1
        for index in range(self.reserved):
            text = lines[index] if index < len(lines) else ""
            out.append(_goto(top + index) + _clear_line() + text[: max(0, columns - 1)])
        out.append(_RESTORE)
        return "".join(out)

    def _clear_reserved(self, rows: int) -> str:
        top = rows - self.reserved + 1
        return _SAVE + "".join(_goto(top + i) + _clear_line() for i in range(self.reserved)) + _RESTORE

    def release(self) -> str:
        """Give the rows back: blank them and let the whole screen scroll again."""
        if not self.reserved:
            return ""
        out = self._clear_reserved(self._rows) + _SAVE + _RESET_MARGINS + _RESTORE
        self.reserved = 0
        return out


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (ValueError, OSError):  # closed
        return False


def _terminal_size(stream: TextIO) -> tuple[int, int]:
    """(columns, rows); (0, 0) when unknown, which draws nothing."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return 0, 0
    return size.columns, size.lines


class LiveView:
    """Polls the ledger on a daemon thread while the child runs; a context manager (start/stop).

    TTY: the block of lines pinned at the bottom, redrawn each poll; threshold warnings are
    printed as ordinary lines above it; ``stop()`` gives the rows back and prints the final
    lines once. Not a TTY: only the threshold warnings.
    """

    def __init__(
        self,
        ledger: Ledger,
        settings: Settings,
        run_id: str,
        stream: TextIO | None = None,
        interval_s: float = 0.2,
        clock: Callable[[], float] | None = None,
        *,
        terminal_size: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self._ledger = ledger
        self._settings = settings
        self._run_id = run_id
        self._stream = sys.stderr if stream is None else stream  # bound late: tests swap sys.stderr
        self._interval_s = interval_s
        self._clock = clock or ledger_clock(ledger)  # the ledger's: on Redis the server's day, whatever this host's
        self._tty = _is_terminal(self._stream)
        self._size = terminal_size or (lambda: _terminal_size(self._stream))
        self._block = BottomBlock()
        self._fractions: dict[tuple[str, str], float] = {}  # (label, limit name) -> last settled fraction
        self._thresholds = parse_thresholds(settings.alert_at)
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._events = EventsTail(settings.events_log)

    @property
    def is_terminal(self) -> bool:
        return self._tty

    def start(self) -> None:
        if self._thread is not None or self._stopped:
            return
        self._thread = threading.Thread(target=self._loop, name="quotawrap-live", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Last poll (the final settled numbers), then the final lines once; idempotent."""
        if self._stopped:
            return
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()
        with self._lock:
            self._stopped = True
            if self._tty:
                final = "".join(line + "\n" for line in self._lines)
                self._write(self._block.release() + final)

    def __enter__(self) -> LiveView:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _loop(self) -> None:
        while True:
            self.poll()
            if self._stopping.wait(self._interval_s):
                return

    def poll(self) -> None:
        """Read the ledger once; log crossed thresholds; redraw the block on a terminal."""
        try:
            reading = read_gauges(self._ledger, self._settings, self._run_id, self._clock())
        except Exception:
            return  # a view never fails the run; the guard reports ledger trouble to the child
        warnings = self._crossings(reading)
        lines = block_lines(reading)
        waiting = wait_line(self._events.poll())
        if waiting is not None:
            lines.append(waiting)
        with self._lock:
            if self._stopped:
                return
            text = "".join(line + "\n" for line in warnings)
            if self._tty:
                self._lines = lines
                columns, rows = self._size()
                text += self._block.frame(lines, columns, rows)
            self._write(text)

    def _crossings(self, reading: Reading) -> list[str]:
        gauges = [(RUN_LABEL, reading.run)] if reading.run is not None else []
        gauges += list(reading.models.items())
        warnings = []
        for label, gauge in gauges:
            key = (label, gauge.limit_name)
            now = gauge.fraction
            # one line per reading: a poll that finds 50% and 80% both passed says 80% (the higher implies the lower)
            top = highest(crossed(self._fractions.get(key, 0.0), now, self._thresholds))
            if top is not None:
                warnings.append(warning_line(label, top, gauge))
            self._fractions[key] = now  # a drop (new day, bigger pool) re-arms the thresholds
        for use in reading.budgets:  # a soft budget's alert: it refuses nothing, so this is where it is heard
            key = (use.budget.id, use.period)  # a token and a money budget may share a label
            top = highest(crossed(self._fractions.get(key, 0.0), use.fraction, self._thresholds))
            if top is not None:
                warnings.append(f"quotawrap: {printable(use.label)} at {round(top * 100)}% ({use.numbers()})")
            self._fractions[key] = use.fraction
        return warnings

    def _write(self, text: str) -> None:
        if not text:
            return
        try:
            self._stream.write(text)  # one write: the child's output cannot land inside a frame
            self._stream.flush()
        except (OSError, ValueError):
            pass
