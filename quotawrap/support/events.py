"""Waiting for room: the process's wake-up on settles, and the run's record of waits and bounds.

A call that does not fit only because of holds in flight waits instead of being refused,
first come, first served across threads, processes, runs and hosts: the order is kept in the ledger
itself (ledger/lines.py has the rule, admission/call.py the wait). What this module adds is the wake-up of
this process's head waiters when one of its calls settles (:class:`RoomSignal`), and the record:

The children record each wait and each bounded call as a JSON line in the run's events log
(``QUOTAWRAP_EVENTS_LOG``), which the wrapper reads for the live view, the summary and ``status``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import weakref
from collections.abc import Collection, Iterable, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from ..core.records import Record
from .log import warn

__all__ = [
    "BoundEvent",
    "EventLog",
    "EventsTail",
    "QueuedPause",
    "RoomSignal",
    "RunEvents",
    "percentile",
    "read_events",
    "recent_logs",
    "summarize",
    "wait_id",
    "waiting_now",
]


# A call the guard bounded: (model, the bound it set, the pid of the process that made the call, how it set it:
# "added" to a request that set no bound or "replaced" its max_tokens, and whether the call was cut short there).
BoundEvent = tuple[str, int, int, str, bool]


class QueuedPause(float):
    """The pause of a call queued behind others (admission/call.py): a settle in this process does not end it
    early, as it cannot make that call the head of its line; it only polls to learn when it is."""


class RoomSignal:
    """Wakes this process's waiting calls at the head of their lines when one of its calls settles."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._napping = 0  # head waiters in a pause now

    def nap(self, seconds: float) -> None:
        """Sleep ``seconds``; a settle in this process ends the pause early, unless it is a QueuedPause."""
        if isinstance(seconds, QueuedPause):
            time.sleep(seconds)
            return
        with self._cond:
            self._napping += 1
            try:
                self._cond.wait(seconds)
            finally:
                self._napping -= 1

    def unwatched(self) -> bool:
        """No call of this process waits for a settle of its own to wake it (a read without a lock:
        a waiter that starts its pause just after finds out by its next poll)."""
        return self._napping == 0

    def room_freed(self) -> None:
        if self._napping == 0:  # every settle asks; a waiter that starts its pause just after polls (unwatched)
            return
        with self._cond:
            self._cond.notify_all()


class EventLog:
    """Appends the run's events (``wait``/``waited``/``bound``) as JSON lines; never raises.

    The file stays open between lines: a bounded call writes one, and opening the file anew
    cost more than the rest of the line's work, on every such call. Before each line the
    descriptor is checked to be still this file's (a program may close every descriptor and
    reuse the number): if not, or the file was removed, it is opened again.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._warned = False
        self._fd: int | None = None
        self._ident = (0, 0)  # (st_dev, st_ino) of the file self._fd was opened on
        self._closer: weakref.finalize[[int, tuple[int, int]], EventLog] | None = None
        self._open_lock = threading.Lock()
        self._last_bound: tuple[BoundEvent, bytes] | None = None

    def write(self, event: dict[str, Any]) -> None:
        if self.path:
            self._append(_line(event))

    def bounds(self, events: Iterable[BoundEvent]) -> None:
        """The ``bound`` events, a line per bounded call, in one write. The wrapper records its children's as
        their settles arrive (settling/handoff.py), a child its own that go no such way (settling/sink.py). Most lines
        are alike, so the last one is kept encoded."""
        if not self.path:
            return
        lines = []
        last = self._last_bound
        for event in events:
            if last is None or last[0] != event:
                model, bound, pid, how, cut = event
                line = {"ev": "bound", "model": model, "bound": bound, "pid": pid, "how": how, "cut": cut}
                last = self._last_bound = (event, _line(line))
            lines.append(last[1])
        if lines:
            self._append(b"".join(lines))

    def _append(self, line: bytes) -> None:
        try:
            fd = self._fd
            if fd is None or _opened_on(fd) != self._ident:  # the first line, or no longer our file
                fd = self._reopen(fd)
            os.write(fd, line)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                warn(f"cannot record waits and bounds in {self.path}: {exc}")

    def _reopen(self, seen: int | None) -> int:
        assert self.path is not None
        with self._open_lock:
            if self._fd is not None and self._fd != seen:  # another thread reopened it meanwhile
                return self._fd
            if self._closer is not None:
                self._closer()  # closes the old descriptor if it is still ours, once
                self._fd = self._closer = None
            target = Path(self.path)
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            stat = os.fstat(fd)
            self._fd, self._ident = fd, (stat.st_dev, stat.st_ino)
            self._closer = weakref.finalize(self, _close_if_ours, fd, self._ident)
            return fd


def _line(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


def _opened_on(fd: int) -> tuple[int, int] | None:
    """The file a descriptor is open on, None when it is closed or that file was removed."""
    try:
        stat = os.fstat(fd)
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino) if stat.st_nlink > 0 else None


def _close_if_ours(fd: int, ident: tuple[int, int]) -> None:
    try:
        stat = os.fstat(fd)
    except OSError:
        return  # closed already
    if (stat.st_dev, stat.st_ino) == ident:
        os.close(fd)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered) / 100)) - 1]


class RunEvents(Record):
    """What a run's events log says: waits (finished and still open), bounded calls, superseded refusals."""

    waits: list[float] = field(default_factory=list)  # seconds each finished wait took
    waiting_now: int = 0
    admitted_after_wait: int = 0
    refused_after_wait: int = 0
    bounded_calls: int = 0  # sent with a whole-output bound the guard set (either way below)
    superseded_blocks: int = 0  # refused attempts of calls that waited on and were admitted
    bounded_by_model: dict[str, int] = field(default_factory=dict)
    superseded_by_model: dict[str, int] = field(default_factory=dict)
    # per how the guard set the bound ("added", "replaced"): calls, and those of them cut short at it
    bounds: dict[str, int] = field(default_factory=dict)
    cut: dict[str, int] = field(default_factory=dict)
    replaced_by_model: dict[str, int] = field(default_factory=dict)
    cut_by_model: dict[str, int] = field(default_factory=dict)

    @property
    def wait_p50(self) -> float | None:
        return percentile(self.waits, 50)

    @property
    def wait_p99(self) -> float | None:
        return percentile(self.waits, 99)

    def as_dict(self) -> dict[str, Any]:
        return {
            "waited_calls": len(self.waits),
            "waiting_now": self.waiting_now,
            "admitted_after_wait": self.admitted_after_wait,
            "refused_after_wait": self.refused_after_wait,
            "wait_p50_s": None if self.wait_p50 is None else round(self.wait_p50, 3),
            "wait_p99_s": None if self.wait_p99 is None else round(self.wait_p99, 3),
            "bounded_calls": self.bounded_calls,
            "superseded_blocks": self.superseded_blocks,
        }


class EventsTail:
    """Reads a run's events log incrementally (the live view polls it several times a second)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""
        self._open: set[str] = set()
        self.events = RunEvents()

    def feed(self, lines: Iterable[str]) -> RunEvents:
        events = self.events
        for line in lines:
            try:
                event = json.loads(line)
                kind = event["ev"]
            except (ValueError, KeyError, TypeError):
                continue
            model = str(event.get("model"))
            if kind == "wait":
                self._open.add(str(event.get("id")))
            elif kind == "waited":
                self._open.discard(str(event.get("id")))
                events.waits.append(float(event.get("waited_s", 0.0)))
                if event.get("outcome") == "admitted":
                    events.admitted_after_wait += 1
                else:
                    events.refused_after_wait += 1
                self._supersede(model, int(event.get("superseded", 0)))
            elif kind == "superseded":
                self._supersede(model, int(event.get("n", 0)))
            elif kind == "bound":
                how = str(event.get("how") or "added")  # a line of an older quotawrap: it only ever added
                events.bounded_calls += 1
                _count(events.bounded_by_model, model)
                _count(events.bounds, how)
                if how == "replaced":
                    _count(events.replaced_by_model, model)
                if event.get("cut") is True:
                    _count(events.cut, how)
                    _count(events.cut_by_model, model)
        events.waiting_now = len(self._open)
        return events

    def _supersede(self, model: str, count: int) -> None:
        self.events.superseded_blocks += count
        self.events.superseded_by_model[model] = self.events.superseded_by_model.get(model, 0) + count

    def poll(self) -> RunEvents:
        """Take in what was appended since the last poll; a missing or unreadable log reads as no events."""
        if not self._path:
            return self.events
        try:
            with open(self._path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except OSError:
            return self.events
        self._offset += len(data)
        data = self._partial + data
        complete, _, self._partial = data.rpartition(b"\n")
        return self.feed(complete.decode("utf-8", errors="replace").splitlines())


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def summarize(lines: Iterable[str]) -> RunEvents:
    """Pure: the events log's lines as totals (unreadable lines are skipped)."""
    return EventsTail(None).feed(lines)


def recent_logs(
    directory: str | os.PathLike[str], max_age_s: float, *, runs: Collection[str] | None = None
) -> Iterable[tuple[str, list[Any]]]:
    """(run id, its events) of each events log in ``directory`` written to within ``max_age_s``;
    lines that are not JSON are skipped, and so is a log that cannot be read.

    ``runs``: only the logs of these runs (a store's: the directory holds the logs of every store's runs on
    this host)."""
    now = time.time()
    try:
        paths = sorted(
            p
            for p in Path(directory).glob("*.jsonl")
            if (runs is None or p.stem in runs) and now - p.stat().st_mtime < max_age_s
        )
    except OSError:
        return
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        yield path.stem, events


def waiting_now(
    directory: str | os.PathLike[str], *, max_age_s: float = 86_400.0, runs: Collection[str] | None = None
) -> dict[str, int]:
    """Per model, calls waiting for room right now in any run whose events log is in ``directory`` (of
    ``runs`` alone, when given).

    A wait counts while its process lives (a killed child's last wait is not left waiting forever).
    """
    from .processes import pid_alive

    counts: dict[str, int] = {}
    for _run_id, events in recent_logs(directory, max_age_s, runs=runs):
        open_waits: dict[str, tuple[str, int]] = {}
        for event in events:
            try:
                if event["ev"] == "wait":
                    open_waits[str(event["id"])] = (str(event["model"]), int(event["pid"]))
                elif event["ev"] == "waited":
                    open_waits.pop(str(event["id"]), None)
            except (ValueError, KeyError, TypeError):
                continue
        for model, pid in open_waits.values():
            if pid_alive(pid):
                counts[model] = counts.get(model, 0) + 1
    return counts


def read_events(path: str | os.PathLike[str] | None) -> RunEvents:
    return EventsTail(path).poll()


def wait_id() -> str:
    return f"{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
