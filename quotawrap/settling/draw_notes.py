"""Notes of the calls a guarded process drew from an advance, and their settles, in a file its wrapper reads.

A call is drawn from an advance (admission/advances.py) only once its wrapper would learn of it even if the
process were killed the moment after: then each call in flight gets a row of its own and what the process did
not draw is released, never charged to nobody. A datagram said so: a send per drawn call, and the relay's
receive and decode of it (twice the datagrams per call), for a note its call's settle, carrying the same split,
nearly always makes moot within milliseconds.

A note is now a slot of a file the process maps (``mmap``, shared): written in place, and read by the wrapper only
when it closes (:meth:`~quotawrap.settling.handoff.Relay.close`). A slot still noted is a call whose settle may never
have come: its draw lands then. The split is idempotent, so a note read after its settle landed lands as nothing.

The call's settle is then written into the same slot (:meth:`DrawNotes.settle`), beside its note, and the wrapper
takes it from there (:func:`settled_slots`) when the process closes the advance, on a sync, or within
``handoff.COLLECT_EVERY_S``, and frees the slot once it has landed: a drawn call's settle costs no datagram
(its send on the caller's path, and the relay's receive and decode of each, which share the cores with the
agent), and a process killed after
a call still has that call landed exactly. A settle that does not fit, or a process whose wrapper has stopped
collecting (the file's first byte), goes as a datagram instead.

One file per process, ``draws-<pid>-<random>`` in the run's private directory (0600, never through a symlink,
made under a dot name and renamed once whole); a forked child opens its own. Slot 0 is the file's header: whether
the wrapper still collects, and how many slots were ever used (the wrapper reads no further). Every other slot is
:data:`SLOT_BYTES`: its first byte says what it holds (:data:`NOTED`, :data:`SETTLED`) and is written last; the
note (its length, then the marshalled draw: the settle relay's ``encode``, passed in) follows it, the settle (its
length, then its datagram, without the draw the note carries) starts at :data:`_SETTLE_AT`. The pages are the
kernel's, so what was written survives a SIGKILL. With no free slot, or a note too long for one, the call is not
drawn (it reserves alone).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable

TYPE_CHECKING = False
if TYPE_CHECKING:
    import mmap

    from ..ledger.base import Settle
    from ..support.events import BoundEvent

Encode = Callable[["Settle"], bytes]  # handoff.encode: a note is a draw as its datagram would carry it
Decode = Callable[[bytes], "tuple[Settle, BoundEvent | None]"]  # handoff.decode

__all__ = [
    "NOTED",
    "SETTLED",
    "SLOTS",
    "SLOT_BYTES",
    "DrawNotes",
    "free_slot",
    "note_files",
    "read_notes",
    "read_settled",
    "settled_slots",
    "slots_used",
    "stop_collecting",
]

SLOT_BYTES = 512  # a draw's note is ~150 bytes (two hold ids, the endpoint, the key's fingerprint, two times)
SLOTS = 4096  # the header and calls of one process drawn and not yet landed at once; a 2 MiB sparse file
NOTED, SETTLED = 1, 2  # a slot's first byte: its note is written; its settle too (0: free)
_SETTLE_AT = 256  # where a slot's settle starts (its length, then the datagram)
_COLLECTED_NO_MORE = 0  # header byte: set once the wrapper no longer collects settles from the file
_USED_AT = 1  # header bytes 1-2: slots ever used, header included (the wrapper reads no further)
_USE_FIRST = 64  # slots used before the process looks for slots its wrapper freed (kept few: fewer pages read)
_PREFIX = "draws-"


class DrawNotes:
    """This process's notes, in ``directory`` (the run's). Thread-safe; a forked child writes a file of its own."""

    def __init__(self, directory: str, encode: Encode) -> None:
        self._directory = directory
        self._encode = encode
        self._lock = threading.Lock()
        self._pid = -1
        self._map: mmap.mmap | None = None
        self._free: list[int] = []  # slots known free, the lowest last
        self._used = 1  # slots ever used, the header included
        self._slots: dict[str, int] = {}  # hold id -> its slot, while only its note is written
        _all.add(self)

    def _after_fork(self) -> None:
        """In a forked child: another thread of the parent may have held the lock at the fork (a write)."""
        self._lock = threading.Lock()

    def write(self, draw: Settle) -> bool:
        """Note ``draw`` (a Settle of event draw); True once it is in the shared file."""
        data = self._encode(draw)
        if len(data) > _SETTLE_AT - 3:
            return False
        with self._lock:
            notes = self._opened()
            slot = None if notes is None else self._free_slot(notes)
            if notes is None or slot is None:
                return False
            start = slot * SLOT_BYTES
            notes[start + 3 : start + 3 + len(data)] = data
            notes[start + 1 : start + 3] = len(data).to_bytes(2, "little")
            notes[start] = NOTED  # last: a slot read noted is whole
            self._slots[draw.hold_id] = slot
        return True

    def _free_slot(self, notes: mmap.mmap) -> int | None:
        """A slot to write (under the lock): one known free, else one of those the wrapper freed, else a new one."""
        if not self._free and self._used >= _USE_FIRST:
            states = notes[0 : self._used * SLOT_BYTES : SLOT_BYTES]
            taken = set(self._slots.values())
            self._free = [slot for slot in range(self._used - 1, 0, -1) if not states[slot] and slot not in taken]
        if self._free:
            return self._free.pop()
        if self._used >= SLOTS:
            return None
        self._used += 1
        notes[_USED_AT : _USED_AT + 2] = self._used.to_bytes(2, "little")  # before the slot's byte: read with it
        return self._used - 1

    def settle(self, hold_id: str, data: bytes) -> bool:
        """Write the call's settle (its datagram, without its draw) beside its note; True once the wrapper will
        collect it from there. No lock: the slot is the call's alone until its wrapper frees it."""
        notes = self._map
        if len(data) > SLOT_BYTES - _SETTLE_AT - 2 or notes is None or notes[_COLLECTED_NO_MORE]:
            return False
        slot = self._slots.get(hold_id)
        if slot is None or self._pid != os.getpid():  # a forked child: the slot is the parent's
            return False
        del self._slots[hold_id]  # from here on the slot is the wrapper's to free
        start = slot * SLOT_BYTES
        notes[start + _SETTLE_AT + 2 : start + _SETTLE_AT + 2 + len(data)] = data
        notes[start + _SETTLE_AT : start + _SETTLE_AT + 2] = len(data).to_bytes(2, "little")
        notes[start] = SETTLED  # last: a slot read settled is whole
        # The wrapper stopped collecting meanwhile: it may have missed this one. It goes as a datagram too (or
        # lands in this process); the wrapper lands what its close reads once more, and landing twice is exact.
        return not notes[_COLLECTED_NO_MORE]

    def clear(self, hold_id: str) -> None:
        """The call's settle went as a datagram and is in the wrapper's hands, or landed: its note is moot. No
        lock: each step is one operation the GIL makes whole, and a slot is free only once its byte is cleared
        (the next look for freed slots finds it)."""
        slot = self._slots.pop(hold_id, None)
        notes = self._map
        if slot is None or notes is None or self._pid != os.getpid():  # a forked child: the slot is the parent's
            return
        notes[slot * SLOT_BYTES] = 0

    def clearing(self, hold_id: str, then: Callable[[], None] | None) -> Callable[[], None]:
        """A ``landed`` callback that clears the call's note, then calls ``then``."""

        def landed() -> None:
            self.clear(hold_id)
            if then is not None:
                then()

        return landed

    def _opened(self) -> mmap.mmap | None:
        """This process's file, mapped (opened on first use, and again in a forked child); None if it cannot be."""
        if self._pid == os.getpid():
            return self._map
        import mmap

        self._pid = os.getpid()
        self._map, self._free, self._slots, self._used = None, [], {}, 1  # a parent's slots are the parent's
        name = f"{_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        # Renamed into place once whole: a notes file the wrapper finds short it never collects from, and this
        # process's drawn calls would stay in flight to the run's end (every call near a cap waiting for them).
        staged = os.path.join(self._directory, f".{name}")
        try:
            fd = os.open(
                staged,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                0o600,
            )
        except OSError:
            return None
        notes = None
        try:
            os.ftruncate(fd, SLOTS * SLOT_BYTES)
            notes = mmap.mmap(fd, SLOTS * SLOT_BYTES)
            notes[_USED_AT : _USED_AT + 2] = self._used.to_bytes(2, "little")
            os.rename(staged, os.path.join(self._directory, name))
        except (OSError, ValueError):
            if notes is not None:
                notes.close()
            with contextlib.suppress(OSError):
                os.unlink(staged)
            return None
        finally:
            os.close(fd)
        self._map = notes
        return notes


_all: weakref.WeakSet[DrawNotes] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for notes in list(_all):
        notes._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def note_files(directory: str) -> list[str]:
    """The names of the notes files in ``directory``, oldest process first; [] when there is no directory."""
    try:
        return sorted(name for name in os.listdir(directory) if name.startswith(_PREFIX))
    except OSError:
        return []


def slots_used(notes: bytes | mmap.mmap) -> int:
    """How many slots of a notes file were ever used (the header's count, bounded by the file)."""
    return min(int.from_bytes(notes[_USED_AT : _USED_AT + 2], "little"), len(notes) // SLOT_BYTES)


def settled_slots(notes: bytes | mmap.mmap) -> list[int]:
    """The slots of ``notes`` that hold a settle (read one with :func:`read_settled`)."""
    states = notes[0 : slots_used(notes) * SLOT_BYTES : SLOT_BYTES]
    found = []
    slot = states.find(SETTLED, 1)
    while slot > 0:
        found.append(slot)
        slot = states.find(SETTLED, slot + 1)
    return found


def free_slot(notes: mmap.mmap, slot: int) -> None:
    """The wrapper has landed the slot's settle: its process may write the slot again."""
    notes[slot * SLOT_BYTES] = 0


def stop_collecting(notes: mmap.mmap) -> None:
    """The wrapper collects no more settles from this file: its process sends them as datagrams (or lands them)."""
    notes[_COLLECTED_NO_MORE] = 1


def _field(notes: bytes | mmap.mmap, at: int, most: int) -> bytes | None:
    length = int.from_bytes(notes[at : at + 2], "little")
    return None if length > most else notes[at + 2 : at + 2 + length]


def _noted(notes: bytes | mmap.mmap, slot: int, decode: Decode) -> Settle | None:
    data = _field(notes, slot * SLOT_BYTES + 1, _SETTLE_AT - 3)
    try:
        draw = None if data is None else decode(data)[0]
    except Exception:
        return None
    return draw if draw is not None and draw.event == "draw" and draw.drawn is not None else None


def read_settled(notes: bytes | mmap.mmap, slot: int, decode: Decode) -> tuple[Settle, BoundEvent | None] | None:
    """The settle in ``slot`` with its draw from the note beside it, and the bound event riding with it; None
    for a slot that does not read whole."""
    draw = _noted(notes, slot, decode)
    data = _field(notes, slot * SLOT_BYTES + _SETTLE_AT, SLOT_BYTES - _SETTLE_AT - 2)
    try:
        settle, bound = (None, None) if data is None or draw is None else decode(data)
    except Exception:
        return None
    if settle is None or draw is None or settle.hold_id != draw.hold_id or settle.event not in ("settle", "release"):
        return None
    return settle._replace(drawn=draw.drawn), bound


def read_notes(directory: str, decode: Decode) -> tuple[list[Settle], bool]:
    """What the slots still set in ``directory`` hold: the settles written in them (a wrapper that landed one
    already lands it as nothing), then the draws noted of calls whose settle never came; and whether every slot
    read was whole (a set slot that does not decode makes it False: the wrapper then charges what is left of
    the advances whole)."""
    settles: list[Settle] = []
    draws: list[Settle] = []
    whole = True
    for name in note_files(directory):
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                data = os.read(fd, SLOTS * SLOT_BYTES)
            finally:
                os.close(fd)
        except OSError:
            whole = False
            continue
        for slot in range(1, slots_used(data)):
            state = data[slot * SLOT_BYTES]
            if not state:
                continue
            if state == NOTED and (draw := _noted(data, slot, decode)) is not None:
                draws.append(draw)
            elif state == SETTLED and (settled := read_settled(data, slot, decode)) is not None:
                settles.append(settled[0])
            else:  # torn, or not a state quotawrap writes
                whole = False
    return settles + draws, whole
