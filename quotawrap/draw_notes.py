"""Notes of the calls a guarded process drew from an advance, in a file its wrapper reads when it closes.

A call is drawn from an advance (:mod:`quotawrap.advances`) only once its wrapper would learn of it even if the
process were killed the moment after: then each call in flight gets a row of its own and what the process did
not draw is released, never charged to nobody. A datagram said so: a send per drawn call, and the relay's
receive and decode of it (bench_guard_steps: 2.06 datagrams per call against 1.06, and ~125 µs more of the
relay's CPU per settle on a slow VM), for a note its call's settle, carrying the same split, nearly always makes
moot within milliseconds.

A note is now a slot of a file the process maps (``mmap``, shared): written in place, cleared once the
call's settle is in the wrapper's socket or landed, and read by the wrapper only when it closes
(:meth:`~quotawrap.settle_relay.Relay.close`). A slot still set is a call whose settle may never have come: its
draw lands then. The split is idempotent, so a note cleared too late (a kill between the settle's send and the
clear) lands as nothing.

One file per process, ``draws-<pid>-<random>`` in the run's private directory (0600, never through a symlink); a
forked child opens its own. A slot is :data:`SLOT_BYTES`: its first byte says it is set and is written last,
after the length and the marshalled draw (the settle relay's ``encode``, passed in). The pages are the kernel's,
so what was written survives a SIGKILL. With no free slot, or a note too long for one, the call is not drawn
(it reserves alone).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

TYPE_CHECKING = False
if TYPE_CHECKING:
    import mmap

    from .ledger.base import Settle
    from .waiting import BoundEvent

Encode = Callable[["Settle"], bytes]  # settle_relay.encode: a note is a draw as its datagram would carry it
Decode = Callable[[bytes], "tuple[Settle, BoundEvent | None]"]  # settle_relay.decode

__all__ = ["SLOTS", "SLOT_BYTES", "DrawNotes", "read_notes"]

SLOT_BYTES = 256  # a draw's note is ~150 bytes (two hold ids, the endpoint, the key's fingerprint, two times)
SLOTS = 4096  # calls of one process drawn and not yet settled at once; a 1 MiB sparse file
_PREFIX = "draws-"
_SET = 1


class DrawNotes:
    """This process's notes, in ``directory`` (the run's). Thread-safe; a forked child writes a file of its own."""

    def __init__(self, directory: str, encode: Encode) -> None:
        self._directory = directory
        self._encode = encode
        self._lock = threading.Lock()
        self._pid = -1
        self._map: mmap.mmap | None = None
        self._free: list[int] = []
        self._slots: dict[str, int] = {}  # hold id -> its slot
        _all.add(self)

    def _after_fork(self) -> None:
        """In a forked child: another thread of the parent may have held the lock at the fork (a write)."""
        self._lock = threading.Lock()

    def write(self, draw: Settle) -> bool:
        """Note ``draw`` (a Settle of event draw); True once it is in the shared file."""
        data = self._encode(draw)
        if len(data) > SLOT_BYTES - 3:
            return False
        with self._lock:
            notes = self._opened()
            if notes is None or not self._free:
                return False
            slot = self._free.pop()
            start = slot * SLOT_BYTES
            notes[start + 3 : start + 3 + len(data)] = data
            notes[start + 1 : start + 3] = len(data).to_bytes(2, "little")
            notes[start] = _SET  # last: a slot read set is whole
            self._slots[draw.hold_id] = slot
        return True

    def clear(self, hold_id: str) -> None:
        """The call's settle is in the wrapper's hands or landed: its note is moot. No lock: each step is one
        operation the GIL makes whole, and a slot is free only once its byte is cleared."""
        slot = self._slots.pop(hold_id, None)
        notes = self._map
        if slot is None or notes is None or self._pid != os.getpid():  # a forked child: the slot is the parent's
            return
        notes[slot * SLOT_BYTES] = 0
        self._free.append(slot)

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
        self._map, self._free, self._slots = None, [], {}  # a parent's slots are the parent's to clear
        name = f"{_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        try:
            fd = os.open(
                os.path.join(self._directory, name),
                os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                0o600,
            )
        except OSError:
            return None
        try:
            os.ftruncate(fd, SLOTS * SLOT_BYTES)
            self._map = mmap.mmap(fd, SLOTS * SLOT_BYTES)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        self._free = list(range(SLOTS - 1, -1, -1))  # the first slots first: the fewest pages touched
        return self._map


_all: weakref.WeakSet[DrawNotes] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for notes in list(_all):
        notes._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def read_notes(directory: str, decode: Decode) -> tuple[list[Settle], bool]:
    """The draws noted in ``directory`` and still set, and whether every note read was whole (a set slot that
    does not decode as a draw makes it False: the wrapper then charges what is left of the advances whole)."""
    draws: list[Settle] = []
    whole = True
    try:
        names = sorted(name for name in os.listdir(directory) if name.startswith(_PREFIX))
    except OSError:
        return draws, True  # no directory, no notes
    for name in names:
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                data = os.read(fd, SLOTS * SLOT_BYTES)
            finally:
                os.close(fd)
        except OSError:
            whole = False
            continue
        for start in range(0, len(data) - SLOT_BYTES + 1, SLOT_BYTES):
            if data[start] != _SET:
                continue
            length = int.from_bytes(data[start + 1 : start + 3], "little")
            if length > SLOT_BYTES - 3:  # never written so: not a note
                whole = False
                continue
            try:
                settle, _ = decode(data[start + 3 : start + 3 + length])
            except Exception:
                whole = False
                continue
            if settle.event != "draw" or settle.drawn is None:
                whole = False
                continue
            draws.append(settle)
    return draws, whole
