"""Draw notes (settling/draw_notes.py): slots of a shared file, written by a guarded process, read by its wrapper.

Real files, real mmap, a real fork and a real SIGKILL: what a killed process wrote is what the wrapper reads.
"""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from quotawrap.core.usage import Usage
from quotawrap.ledger.base import Drawn, Settle
from quotawrap.settling.draw_notes import (
    SLOT_BYTES,
    SLOTS,
    DrawNotes,
    free_slot,
    note_files,
    read_notes,
    read_settled,
    settled_slots,
    slots_used,
    stop_collecting,
)
from quotawrap.settling.handoff import decode, encode


def _draw(hold_id: str, key: str | None = "sha256:0123456789abcdef") -> Settle:
    return Settle(hold_id, "draw", drawn=Drawn("advance-1", 1_000, 50, "chat", key, 1.5, 2.5))


def test_a_note_is_read_back_exactly_until_cleared(tmp_path: Path) -> None:
    notes = DrawNotes(str(tmp_path), encode)
    assert notes.write(_draw("a")) and notes.write(_draw("b", None))
    assert read_notes(str(tmp_path), decode) == ([_draw("a"), _draw("b", None)], True)
    notes.clear("a")
    notes.clear("a")  # twice: nothing more
    assert read_notes(str(tmp_path), decode) == ([_draw("b", None)], True)
    (path,) = tmp_path.iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.name.startswith(f"draws-{os.getpid()}-")


def test_a_cleared_slot_is_used_again_and_a_full_file_draws_nothing(tmp_path: Path) -> None:
    notes = DrawNotes(str(tmp_path), encode)
    assert all(notes.write(_draw(f"call-{i}")) for i in range(SLOTS - 1))  # slot 0 is the file's header
    assert not notes.write(_draw("one-more"))  # no free slot: the call reserves alone
    notes.clear("call-7")
    assert notes.write(_draw("one-more"))
    draws, whole = read_notes(str(tmp_path), decode)
    assert whole and len(draws) == SLOTS - 1 and "one-more" in {d.hold_id for d in draws}


def test_a_note_too_long_for_a_slot_is_not_written(tmp_path: Path) -> None:
    notes = DrawNotes(str(tmp_path), encode)
    assert not notes.write(_draw("a", "k" * 300))
    assert read_notes(str(tmp_path), decode) == ([], True)


def test_what_a_killed_process_noted_is_read(tmp_path: Path) -> None:
    """The pages are the kernel's: a note survives its writer's SIGKILL."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        DrawNotes(str(tmp_path), encode).write(_draw("in-flight"))
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert read_notes(str(tmp_path), decode) == ([_draw("in-flight")], True)


def test_a_forked_child_notes_in_a_file_of_its_own(tmp_path: Path) -> None:
    """A parent's slots are the parent's to clear: a child clearing its own never touches them."""
    notes = DrawNotes(str(tmp_path), encode)
    assert notes.write(_draw("parent's"))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        notes.clear("parent's")  # not the child's: nothing
        ok = notes.write(_draw("child's"))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    draws, whole = read_notes(str(tmp_path), decode)
    assert whole and sorted(d.hold_id for d in draws) == ["child's", "parent's"]
    assert len(list(tmp_path.iterdir())) == 2


def test_a_fork_while_another_thread_writes_leaves_the_child_free_to_write(tmp_path: Path) -> None:
    """A thread of the parent holds the notes' lock at the fork (mid-write): the child's own lock is free."""
    notes = DrawNotes(str(tmp_path), encode)
    with notes._lock:  # as a write in another thread would, at the moment of the fork
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            signal.alarm(10)  # a lock inherited held would hang here: fail, not hang the suite
            os._exit(0 if notes.write(_draw("child's")) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_symlink_among_the_notes_is_not_followed_and_the_read_is_not_whole(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    DrawNotes(str(target), encode).write(_draw("planted"))
    (planted,) = target.iterdir()
    notes_dir = tmp_path / "run"
    notes_dir.mkdir()
    (notes_dir / "draws-1-0000").symlink_to(planted)
    assert read_notes(str(notes_dir), decode) == ([], False)


def test_no_directory_means_no_notes(tmp_path: Path) -> None:
    assert read_notes(str(tmp_path / "gone"), decode) == ([], True)
    assert not DrawNotes(str(tmp_path / "gone"), encode).write(_draw("a"))  # cannot note: not drawn


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x01\x03\x00abc",  # a note that does not decode
        b"\x01\xff\xff",  # a note's length past its room
        b"\x02" + bytes(255) + b"\x01\x00x",  # settled, with no note beside the settle
    ],
)
def test_a_torn_slot_makes_the_read_not_whole(tmp_path: Path, garbage: bytes) -> None:
    header = b"\x00" + (2).to_bytes(2, "little")
    (tmp_path / "draws-9-ffff").write_bytes(header.ljust(SLOT_BYTES, b"\x00") + garbage.ljust(SLOT_BYTES, b"\x00"))
    assert read_notes(str(tmp_path), decode) == ([], False)


def _settle(hold_id: str) -> Settle:
    return Settle(hold_id, "settle", Usage(10, 5, 15), 0.25, 42, None, _draw(hold_id).drawn)


def test_a_settle_is_written_beside_its_note_and_read_with_its_draw(tmp_path: Path) -> None:
    """The wrapper reads the settle with the draw its note carries (the settle is written without it), and what
    was read of a slot still settled at close lands: a settle lands before the notes of calls still in flight."""
    notes = DrawNotes(str(tmp_path), encode)
    assert notes.write(_draw("a")) and notes.write(_draw("b"))
    assert notes.settle("a", encode(_settle("a"), ("m", 64, 1, "added", False), with_draw=False))
    assert not notes.settle("a", encode(_settle("a"), with_draw=False))  # once: the slot is the wrapper's now
    assert not notes.settle("unknown", encode(_settle("unknown"), with_draw=False))
    assert not notes.settle("b", b"x" * SLOT_BYTES)  # too long: it goes as a datagram, its note stays
    (name,) = note_files(str(tmp_path))
    mapped = (tmp_path / name).read_bytes()
    assert settled_slots(mapped) == [1]
    assert read_settled(mapped, 1, decode) == (_settle("a"), ("m", 64, 1, "added", False))
    assert read_notes(str(tmp_path), decode) == ([_settle("a"), _draw("b")], True)


def test_slots_the_wrapper_freed_are_written_again(tmp_path: Path) -> None:
    """The process looks for the slots its wrapper freed once it has used a few: a steady flow of calls keeps
    to the first pages of its file, and a settled slot not yet freed is never written over."""
    import mmap

    notes = DrawNotes(str(tmp_path), encode)
    (name,) = note_files(str(tmp_path)) if notes.write(_draw("first")) else ()
    with open(tmp_path / name, "r+b") as file:
        wrapper_view = mmap.mmap(file.fileno(), 0)
    assert notes.settle("first", encode(_settle("first"), with_draw=False))  # settled, never freed
    for i in range(1000):
        assert notes.write(_draw(f"c{i}")) and notes.settle(f"c{i}", encode(_settle(f"c{i}"), with_draw=False))
        for slot in settled_slots(wrapper_view):
            if slot != 1:
                free_slot(wrapper_view, slot)
    assert slots_used(wrapper_view) <= 66
    assert settled_slots(wrapper_view) == [1]
    assert read_notes(str(tmp_path), decode) == ([_settle("first")], True)
    stop_collecting(wrapper_view)
    assert notes.write(_draw("late")) and not notes.settle("late", encode(_settle("late"), with_draw=False))


def test_what_a_killed_process_settled_is_read(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        notes = DrawNotes(str(tmp_path), encode)
        notes.write(_draw("done"))
        notes.settle("done", encode(_settle("done"), with_draw=False))
        notes.write(_draw("in-flight"))
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert read_notes(str(tmp_path), decode) == ([_settle("done"), _draw("in-flight")], True)
