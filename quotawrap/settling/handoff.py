"""A guarded child's settles handed to its wrapper process, which lands them off the child's CPU.

Part of advances (admission/advances.py), with their draw notes, under their one switch (``--no-advances``): the
wrapper must learn of every draw. On its own, with each call reserving in the ledger, it did not pay for itself
(docs/benchmarks.md, "Each speed piece against its removal").

In the child a settle landed by its own settler thread still costs the caller: the thread shares the
GIL (and, on SQLite, the write lock) with the next call's reserve. The wrapper is idle while its
child runs, so the child sends each settle to it as one datagram on a Unix socket in the run's
private directory (``QUOTAWRAP_SETTLE_SOCKET``; a send is a copy and never blocks) and the
wrapper lands them in batches on its own ledger connection.

Sound as the in-process settler is: a settle sent and not yet landed has not touched its hold, so
the hold counts whole in flight. Nothing is dropped: a send the socket does not take at once (the
wrapper gone, its queue full) returns False and the child's own settler lands that settle. A child
killed after sending is landed anyway, and the wrapper lands all it received before it charges the
run's open holds (:meth:`Relay.close`). Datagrams are marshalled tuples of plain values (never
pickles): only this user can reach the socket (the run directory is 0700).

A call drawn from an advance (admission/advances.py) is noted in a slot of a file of the run directory before
it is sent (settling/draw_notes.py), and its settle is written into the same slot, where the relay takes it
(no datagram) when the advance's unused rest is given back (a datagram: a ``close``), on a sync, or within
COLLECT_EVERY_S, and frees the slot once it has landed. The settle carries the same split of its row from the
advance's; when it closes, the relay lands what the slots still hold, settles and the notes of calls whose settle
never came: then the advances of dead processes hold no call.

A call the guard bounded (``Plan.bound``) rides with its settle as a :data:`BoundEvent`, and the wrapper
writes the run's ``bound`` events: a line the child wrote for each such call was two more system calls
on the caller's path.
"""

from __future__ import annotations

import contextlib
import marshal
import math
import os
import threading
import time
from collections.abc import Callable

from ..support.files import SOCKET_VARIABLE, relay_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    import mmap
    import socket

    from ..ledger.base import Settle
    from ..ledger.interface import CallPath
    from ..support.events import BoundEvent, EventLog
    from .draw_notes import DrawNotes

# ``socket`` is imported where a socket is made, not here: the wrapper imports this module beside its
# child's start, where its import is a measurable cost (the child has it already, through its HTTP client).

__all__ = ["SOCKET_VARIABLE", "Relay", "Sender", "decode", "encode", "relay_path"]

MAX_BATCH = 256  # settles per ledger call, as the in-process settler
LINGER_S = 0.005  # once woken, gather this long: as the in-process settler, so other processes' waiters see no change
RETRY_MIN_S, RETRY_MAX_S = 0.05, 2.0
_RECEIVE_BYTES = 65536
_SYNC = b"\0sync "  # then the path to answer at; never a marshalled settle (which starts with a type code)
_EVENTS = ("settle", "release", "draw", "close")
# A drawn call's settle is written in its slot: the relay takes those when its process closes the advance (a
# datagram, every ADVANCE_CALLS calls or ADVANCE_S seconds), on a sync, at its own close, and at the latest this
# long after it was written (while no datagram comes). Looking on a timer of its own cost the wrapper more than
# receiving each settle did.
COLLECT_EVERY_S = 0.1
_BUFFER_BYTES = 4 << 20  # the wrapper's receive queue: thousands of settles while a batch lands


def encode(settle: Settle, bound: BoundEvent | None = None, *, with_draw: bool = True) -> bytes:
    """The settle's datagram; ``with_draw=False`` leaves its draw out (a settle written beside its note)."""
    usage = settle.usage
    fields = None
    if usage is not None:
        fields = (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens,
            usage.reasoning_tokens,
            usage.cached_tokens,
            usage.images,
            usage.actions,
        )
    drawn = settle.drawn
    return marshal.dumps(
        (
            settle.hold_id,
            settle.event,
            fields,
            settle.latency_s,
            settle.cost,
            settle.anomaly,
            bound,
            None if drawn is None or not with_draw else tuple(drawn),
        )
    )


def decode(data: bytes) -> tuple[Settle, BoundEvent | None]:
    """The settle of one datagram and the bound event riding with it; ValueError (or TypeError, EOFError)
    for anything else."""
    from ..core.usage import Usage
    from ..ledger.base import Drawn, Settle

    hold_id, event, fields, latency_s, cost, anomaly, *rest = marshal.loads(data)
    # A child of an older quotawrap sent six fields (before bound events) or seven (before advances).
    bound = rest[0] if rest else None
    drawn = rest[1] if len(rest) > 1 else None
    if not isinstance(hold_id, str) or event not in _EVENTS or (event in ("draw", "close") and not drawn):
        raise ValueError("not a settle")
    usage = None
    if fields is not None:
        prompt, completion, total, reasoning, cached, images, actions = fields
        usage = Usage(prompt, completion, total, reasoning, cached, images, tuple((str(n), int(k)) for n, k in actions))
    if bound is not None:
        # a child of an older quotawrap sent (model, bound, pid): it only ever added a bound, and said no cut
        model, limit, pid, how, cut = (*bound, "added", False) if len(bound) == 3 else bound
        bound = (str(model), int(limit), int(pid), str(how), cut is True)
    if drawn is not None:
        advance_id, reserved, reserved_cost, endpoint, key, started_at, expires_at = drawn
        drawn = Drawn(
            str(advance_id),
            int(reserved),
            int(reserved_cost),
            str(endpoint),
            None if key is None else str(key),
            float(started_at),
            float(expires_at),
        )
    return Settle(hold_id, event, usage, latency_s, cost, anomaly, drawn), bound


class Sender:
    """The child's end: one unconnected datagram socket, so a wrapper gone (its socket file removed)
    refuses the very next send instead of swallowing it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self.unsynced = 0  # sends since the last sync began: settles the wrapper may not have landed yet
        self.notes: DrawNotes | None = None  # where a drawn call's settle is written instead of sent

    def listening(self) -> bool:
        """Whether the wrapper's socket is there (it binds it once a process of the run opens the ledger)."""
        return os.path.exists(self.path)

    def send(self, settle: Settle, bound: BoundEvent | None = None) -> bool:
        """True once the wrapper's socket holds the settle (and ``bound``, which the wrapper then records);
        False (never raises, never blocks) otherwise. A drawn call's settle is written beside its note, where
        the wrapper collects it (settling/draw_notes.py)."""
        try:
            notes = self.notes
            if (
                notes is not None
                and settle.drawn is not None
                and settle.event in ("settle", "release")
                and notes.settle(settle.hold_id, encode(settle, bound, with_draw=False))
            ):
                self.unsynced += 1
                return True
            sock = self._sock
            if sock is None:
                import socket

                sock = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.setblocking(False)
            sock.sendto(encode(settle, bound), self.path)
        except Exception:  # never the caller's problem (a finalizing interpreter too): the child lands it
            return False
        self.unsynced += 1
        return True

    def sync(self, timeout: float) -> bool:
        """Wait until the wrapper has landed every settle this process sent before (``Guard.flush``):
        a request on the same queue, answered once what precedes it has landed. True too when the
        wrapper is gone (it landed what it took before it closed); False at the timeout."""
        import socket

        deadline = time.monotonic() + max(timeout, 0)
        self.unsynced = 0  # what is sent from here on is not covered by this sync: it counts again
        reply_path = f"{self.path}.sync-{os.getpid()}-{threading.get_ident()}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as reply:
            try:
                reply.bind(reply_path)
            except OSError:
                return False
            try:
                while True:
                    try:
                        reply.sendto(_SYNC + reply_path.encode(), self.path)
                        break
                    except BlockingIOError:  # the queue is full: it empties as the wrapper reads
                        if time.monotonic() >= deadline:
                            return False
                        time.sleep(0.001)
                    except OSError:  # the wrapper is gone, its socket with it
                        return True
                reply.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    reply.recv(16)
                except OSError:  # TimeoutError
                    return False
                return True
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(reply_path)


def sender_from_env() -> Sender | None:
    path = os.environ.get(SOCKET_VARIABLE)
    return Sender(path) if path else None


class Relay:
    """The wrapper's end: receives the child's settles and lands them on ``ledger``; one daemon thread."""

    def __init__(
        self, path: str, ledger: Callable[[], CallPath], warn: Callable[[str], None], events: EventLog | None = None
    ) -> None:
        import socket

        self.path = path
        self._events = events  # the run's events log: the bound events that come with the settles
        self._bounds: list[BoundEvent] = []
        self._ledger = ledger
        self._warn = warn
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):  # room for the bytes; the count is the kernel's qlen
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
        self._sock.bind(self.path)
        self._lock = threading.Lock()  # one batch lands at a time (the thread's, or close()'s)
        self._pending: list[Settle] = []  # received, not yet landed (gathered, or a batch the ledger refused)
        self._syncs: list[str] = []  # where to answer once the settles received before have landed
        self._failing = False
        self._closed = False
        self._stop = threading.Event()
        self.landed = 0
        # The notes files of the run's processes (settling/draw_notes.py), mapped: drawn calls' settles are collected
        # from their slots, which are freed once those settles have landed.
        self._directory = os.path.dirname(path)
        self._notes: dict[str, mmap.mmap] = {}
        self._done_with: set[str] = set()  # files of processes gone, read to the end
        self._collected: dict[tuple[str, int], mmap.mmap] = {}  # slots whose settle is pending
        self._looked_for_files = -math.inf
        self._collect_due = False  # a close or a sync came: look in the slots before landing
        self._collected_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="quotawrap-settle-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = RETRY_MIN_S
        while True:
            if not self._next(COLLECT_EVERY_S):  # no datagram: drawn calls' settles may wait in their slots
                with self._lock:
                    if self._closed:
                        return  # close() lands the rest
                    self._collect_due = True
                    if not self._drain():
                        continue
            self._linger()
            with self._lock:
                if self._closed:
                    return  # close() lands the rest
                self._drain()
                landed = self._land()
            while not landed and not self._stop.wait(backoff):  # the store is away: ask again later
                backoff = min(backoff * 2, RETRY_MAX_S)
                with self._lock:
                    self._drain()
                    landed = self._closed or self._land()
            backoff = RETRY_MIN_S

    def _next(self, timeout: float) -> int:
        """Wait up to ``timeout`` for one datagram; how many (0 or 1)."""
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(_RECEIVE_BYTES)
        except OSError:  # TimeoutError: none came
            return 0
        finally:
            self._sock.settimeout(None)
        with self._lock:
            self._take(data)
        return 1

    def _linger(self) -> None:
        """Gather for LINGER_S, reading on while datagrams come."""
        deadline = time.monotonic() + LINGER_S
        while (left := deadline - time.monotonic()) > 0 and not self._closed and self._next(left):
            pass

    def _take(self, data: bytes) -> None:
        if not data:  # close()'s wake-up call: nothing to decode (nor the settle's modules to import)
            return
        if data.startswith(_SYNC):
            self._syncs.append(data[len(_SYNC) :].decode(errors="replace"))
            self._collect_due = True
            self._looked_for_files = -math.inf  # the process may be new to the run: its file too is looked in
            return
        try:
            settle, bound = decode(data)
        except Exception:  # not ours: nothing to land (a settle is only ever sent whole)
            self._warn("ignored a malformed datagram on the settle socket")
            return
        if settle.event == "close":  # the advance's calls drawn and, most of them, settled in their slots
            self._collect_due = True
        self._pending.append(settle)
        if bound is not None:
            self._bounds.append(bound)

    def _collect(self) -> int:
        """Take the settles written in the notes' slots since the last look (under the lock); how many. New files
        (and processes gone) are looked for every COLLECT_EVERY_S, and on a sync."""
        from .draw_notes import read_settled, settled_slots

        self._collect_due = False
        now = self._collected_at = time.monotonic()
        if now - self._looked_for_files >= COLLECT_EVERY_S:
            self._look_for_files()
            self._looked_for_files = now
        count = 0
        for name, notes in self._notes.items():
            for slot in settled_slots(notes):
                if (name, slot) in self._collected:  # pending: freed once it has landed
                    continue
                settled = read_settled(notes, slot, decode)
                if settled is None:  # torn: close() reads it (or says so)
                    continue
                settle, bound = settled
                self._collected[name, slot] = notes
                self._pending.append(settle)
                if bound is not None:
                    self._bounds.append(bound)
                count += 1
        return count

    def _look_for_files(self) -> None:
        """Map the notes files of processes new to the run; forget those of processes gone, read to the end."""
        from .draw_notes import note_files, settled_slots

        for name in note_files(self._directory):
            if name not in self._notes and name not in self._done_with:
                notes = self._mapped(name)
                if notes is not None:
                    self._notes[name] = notes
        for name, notes in list(self._notes.items()):
            if not _alive(name) and all((name, slot) in self._collected for slot in settled_slots(notes)):
                self._done_with.add(name)  # its pending slots are freed all the same (self._collected)
                del self._notes[name]

    def _mapped(self, name: str) -> mmap.mmap | None:
        """A notes file, mapped to be read and its slots freed (never through a symlink); None if it is not one."""
        import mmap

        from .draw_notes import SLOT_BYTES, SLOTS

        try:
            fd = os.open(os.path.join(self._directory, name), os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            self._done_with.add(name)
            return None
        try:
            if os.fstat(fd).st_size != SLOTS * SLOT_BYTES:
                self._done_with.add(name)
                return None
            return mmap.mmap(fd, SLOTS * SLOT_BYTES)
        except (OSError, ValueError):
            self._done_with.add(name)
            return None
        finally:
            os.close(fd)

    def _drain(self) -> int:
        """Take what the socket and the notes' slots hold now, without waiting; how many settles and requests."""
        import socket

        count = 0
        while True:
            try:
                data = self._sock.recv(_RECEIVE_BYTES, socket.MSG_DONTWAIT)
            except OSError:  # BlockingIOError: empty
                break
            self._take(data)
            count += 1
        # After the datagrams: a settle written in its slot before a sync (or a close) was sent is taken with it.
        if self._collect_due or time.monotonic() - self._collected_at >= COLLECT_EVERY_S:
            count += self._collect()
        return count

    def _land(self) -> bool:
        if self._bounds:  # recorded whether or not the store takes the batch
            if self._events is not None:
                self._events.bounds(self._bounds)
            self._bounds = []
        while self._pending:
            batch = self._pending[:MAX_BATCH]
            try:
                self._ledger().settle_many(batch)
            except Exception as exc:  # kept, in order: settles are idempotent, a retry is exact
                if not self._failing:
                    self._warn(f"could not settle {len(batch)} call(s) yet: {exc}; retrying (holds count whole)")
                self._failing = True
                return False
            self._failing = False
            del self._pending[: len(batch)]
            self.landed += len(batch)
        self._free_collected()
        for path in self._syncs:  # all received before their requests has landed
            with contextlib.suppress(OSError):
                self._sock.sendto(b"ok", path)
        self._syncs.clear()
        return True

    def _free_collected(self) -> None:
        """The slots whose settles have landed: their processes may write them again."""
        from .draw_notes import free_slot

        for (_name, slot), notes in self._collected.items():
            free_slot(notes, slot)
        self._collected.clear()

    def close(self, timeout: float = 30.0) -> bool:
        """Land every settle received, and the draws noted of calls whose settle never came, before the run's
        open holds are charged: whether all landed, every note read. New sends fail from the moment the socket
        file is gone (the child's own settler lands those)."""
        import socket

        from .draw_notes import read_notes, stop_collecting

        with self._lock:
            self._closed = True
        self._stop.set()
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
            waker.setblocking(False)
            waker.sendto(b"", self.path)  # ends the thread's recv (a full queue wakes it anyway)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._thread.join(timeout=timeout)
        deadline = time.monotonic() + timeout
        with self._lock:
            self._look_for_files()
            for notes in self._notes.values():  # from now on a process sends its settles as datagrams
                stop_collecting(notes)
            self._collect_due = True
            self._drain()
            while not self._land() and time.monotonic() < deadline:
                time.sleep(RETRY_MIN_S)
            # Calls in flight when their process ended get rows of their own (after their settles, if they came),
            # and a settle written as collecting stopped lands (once more, as nothing, if it landed).
            noted, every_note_read = read_notes(self._directory, decode)
            self._pending.extend(noted)
            while not self._land() and time.monotonic() < deadline:
                time.sleep(RETRY_MIN_S)
            # What still could not land stays held in the ledger: resolve_run charges it whole.
            landed = not self._pending and every_note_read
            for notes in self._notes.values():
                notes.close()
            self._notes.clear()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        return landed


def _alive(name: str) -> bool:
    """Whether the process that writes the notes file ``name`` (``draws-<pid>-<random>``) is alive."""
    from ..support.processes import pid_alive

    try:
        return pid_alive(int(name.split("-")[1]))
    except (IndexError, ValueError):
        return False


def open_relay(
    path: str, ledger: Callable[[], CallPath], warn: Callable[[str], None], events: EventLog | None = None
) -> Relay | None:
    """The wrapper's relay at ``path``, or None (its children then settle in-process, as before)."""
    try:
        return Relay(path, ledger, warn, events)
    except OSError as exc:  # e.g. a directory path too long for a Unix socket
        warn(f"settles stay in the guarded processes (no settle socket: {exc})")
        return None
