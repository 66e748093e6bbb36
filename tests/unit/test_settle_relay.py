"""A guarded child's settles handed to its wrapper (settling/handoff.py): landed exactly, in order, never
dropped (a send the wrapper does not take lands in the child), and all in before the wrapper closes."""

from __future__ import annotations

import json
import marshal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from quotawrap.core.quota import Counters
from quotawrap.core.usage import Usage
from quotawrap.ledger import Ledger, open_ledger
from quotawrap.ledger.base import Settle
from quotawrap.settling.handoff import (
    COLLECT_EVERY_S,
    LINGER_S,
    Relay,
    Sender,
    decode,
    encode,
    relay_path,
)
from quotawrap.settling.settler import Settler
from quotawrap.support.events import EventLog, RoomSignal, read_events
from tests.unit.test_ledger_contract import limits, rc, request, usage


class Recording:
    """A ledger stand-in that records each batch; refuses the first ``failures`` batches."""

    def __init__(self, failures: int = 0) -> None:
        self.batches: list[list[Settle]] = []
        self.failures = failures
        self.gate = threading.Event()
        self.gate.set()

    def settle_many(self, settles: Sequence[Settle]) -> None:
        self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise OSError("store away")
        self.batches.append(list(settles))

    @property
    def landed(self) -> list[str]:
        return [s.hold_id for batch in self.batches for s in batch]


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[Ledger]:
    opened = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    try:
        yield opened
    finally:
        opened.close()


def _relay(tmp_path: Path, ledger: object, warnings: list[str] | None = None, events: EventLog | None = None) -> Relay:
    sink = warnings if warnings is not None else []
    return Relay(relay_path(str(tmp_path)), lambda: cast(Ledger, ledger), sink.append, events)


def _relay_and_slots(tmp_path: Path, ledger: Recording, events: EventLog | None = None) -> tuple[Relay, Sender, Any]:
    """A relay, and a sender whose drawn calls' settles are written in a notes file of the run directory."""
    from quotawrap.settling.draw_notes import DrawNotes

    relay = _relay(tmp_path, ledger, events=events)
    sender, notes = Sender(relay.path), DrawNotes(str(tmp_path), encode)
    sender.notes = notes
    return relay, sender, notes


def test_a_settle_survives_the_datagram_exactly() -> None:
    full = Usage(10, 20, 30, reasoning_tokens=5, cached_tokens=2, images=1, actions=(("web", 2),))
    for settle in (
        Settle("h1", "settle", full, 0.25, 1234, "too many tokens"),
        Settle("h2", "release"),
        Settle("h3", "settle", None, 0.1, 0),
    ):
        assert decode(encode(settle)) == (settle, None)
    bound = ("m", 64, 77, "replaced", True)
    assert decode(encode(Settle("h4", "release"), bound)) == (Settle("h4", "release"), bound)
    older = encode(Settle("h4", "release"), ("m", 4096, 77))  # type: ignore[arg-type]  # an older child's
    assert decode(older) == (Settle("h4", "release"), ("m", 4096, 77, "added", False))
    six = marshal.dumps(marshal.loads(encode(Settle("h5", "settle", full, 0.5, 9)))[:6])  # an older child's
    assert decode(six) == (Settle("h5", "settle", full, 0.5, 9), None)
    with pytest.raises((ValueError, TypeError, EOFError)):
        decode(b"not marshal")


def test_the_bound_events_that_come_with_settles_are_recorded_by_the_wrapper(tmp_path: Path) -> None:
    """A bounded call's event rides with its settle: the wrapper writes it to the run's events log (the child
    wrote none), with the child's pid; the settle lands as without it."""
    ledger = Recording()
    log = tmp_path / "events.jsonl"
    relay = Relay(relay_path(str(tmp_path)), lambda: cast(Ledger, ledger), [].append, EventLog(str(log)))
    sender = Sender(relay.path)
    assert sender.send(Settle("h1", "settle", usage(10), 0.1, 0), ("m", 64, 4242, "replaced", True))
    assert sender.send(Settle("h2", "settle", usage(10), 0.1, 0))  # not bounded: no event
    assert sender.send(Settle("h3", "release"), ("n", 512, 4243, "added", False))
    assert sender.send(Settle("h4", "release"), ("n", 512, 4244))  # type: ignore[arg-type]  # an older child's
    relay.close()
    assert ledger.landed == ["h1", "h2", "h3", "h4"]
    events = read_events(log)
    assert events.bounded_calls == 3
    assert events.bounded_by_model == {"m": 1, "n": 2}
    assert (events.bounds, events.cut, events.cut_by_model) == ({"replaced": 1, "added": 2}, {"replaced": 1}, {"m": 1})
    assert [json.loads(line)["pid"] for line in log.read_text().splitlines()] == [4242, 4243, 4244]


def test_a_bound_event_the_wrapper_does_not_take_is_recorded_by_the_child(sqlite: Ledger, tmp_path: Path) -> None:
    """No wrapper socket: Settler.submit says so, and the guard writes the bound event itself."""
    settler = Settler(lambda: sqlite, relay=Sender(str(tmp_path / "gone.sock")))
    hold = sqlite.reserve(request(400), limits(run_cap=10_000)).hold_id
    assert not settler.submit(Settle(hold, "settle", usage(40), 0.1, 0), None, ("m", 64, 1, "added", False))
    assert settler.flush(5)
    relay = _relay(tmp_path, Recording())
    try:
        bound = ("m", 64, 1, "added", False)
        assert Settler(lambda: sqlite, relay=Sender(relay.path)).submit(Settle("h", "release"), None, bound)
    finally:
        relay.close()


def test_the_wrapper_lands_every_settle_received_before_close_returns(tmp_path: Path) -> None:
    """Sent while the ledger is stuck: close() still lands each one the socket took, in order, before it
    returns; the socket refuses the rest at once (its queue is short), which the child then lands itself."""
    ledger = Recording()
    ledger.gate.clear()  # the relay's thread blocks in its first batch
    relay = _relay(tmp_path, ledger)
    sender = Sender(relay.path)
    taken = [f"h{i}" for i in range(50) if sender.send(Settle(f"h{i}", "settle", usage(i), 0.1, 0))]
    assert len(taken) >= 2
    threading.Timer(0.05, ledger.gate.set).start()
    relay.close()
    assert ledger.landed == taken
    assert not sender.send(Settle("late", "release"))  # the socket is gone: the child lands it itself


def test_a_batch_the_store_refused_is_landed_later(tmp_path: Path) -> None:
    ledger = Recording(failures=2)
    warnings: list[str] = []
    relay = _relay(tmp_path, ledger, warnings)
    assert Sender(relay.path).send(Settle("h1", "release"))
    relay.close()
    assert ledger.landed == ["h1"]
    assert len(warnings) == 1 and "retrying" in warnings[0]


def test_a_relayed_settle_keeps_its_hold_whole_until_the_wrapper_lands_it(sqlite: Ledger, tmp_path: Path) -> None:
    """Sent and not landed: a reserve that fits the truth but not the hold is refused; landed: exact."""
    relay = _relay(tmp_path, sqlite)
    blocked = Recording()
    blocked.gate.clear()
    relay._ledger = lambda: cast(Ledger, blocked)  # test-only: hold the landing back
    cap = limits(run_cap=1200)
    hold = sqlite.reserve(request(1000), cap).hold_id
    assert Sender(relay.path).send(Settle(hold, "settle", usage(100), 0.1, 0))
    assert not sqlite.reserve(request(500), cap).held  # 1,000 still in flight
    relay._ledger = lambda: sqlite
    blocked.gate.set()
    relay.close()
    assert rc(sqlite) == Counters(100, 0)
    assert sqlite.reserve(request(500), cap).held


def test_the_child_lands_what_the_wrapper_does_not_take(sqlite: Ledger, tmp_path: Path) -> None:
    """No wrapper socket: the settle lands through the child's own settler, and its record runs once."""
    records: list[str] = []
    settler = Settler(lambda: sqlite, relay=Sender(str(tmp_path / "gone.sock")))
    hold = sqlite.reserve(request(400), limits(run_cap=10_000)).hold_id
    settler.submit(Settle(hold, "settle", usage(40), 0.1, 0), lambda: records.append("landed"))
    assert settler.flush(5)
    assert rc(sqlite) == Counters(40, 0)
    assert records == ["landed"]


def test_while_a_call_of_the_process_waits_its_settles_land_in_the_process(sqlite: Ledger, tmp_path: Path) -> None:
    """relay_now() False (a head waiter naps on this process's room signal): the settle lands here,
    so its landing wakes that waiter; True: it goes to the wrapper and the record runs at once."""
    ledger = Recording()
    relay = _relay(tmp_path, ledger)
    watched = [True]
    records: list[str] = []
    settler = Settler(lambda: sqlite, relay=Sender(relay.path), relay_now=lambda: not watched[0])
    hold = sqlite.reserve(request(400), limits(run_cap=10_000)).hold_id
    settler.submit(Settle(hold, "settle", usage(40), 0.1, 0), lambda: records.append("here"))
    assert settler.flush(5)
    assert rc(sqlite) == Counters(40, 0) and records == ["here"]
    watched[0] = False
    settler.submit(Settle("h-relayed", "release"), lambda: records.append("relayed"))
    assert settler.pending == 0 and records == ["here", "relayed"]
    relay.close()
    assert ledger.landed == ["h-relayed"]


def test_a_napping_head_waiter_keeps_the_settles_in_the_process() -> None:
    signal = RoomSignal()
    assert signal.unwatched()
    napping = threading.Thread(target=signal.nap, args=(5.0,))
    napping.start()
    try:
        for _ in range(500):
            if not signal.unwatched():
                break
            threading.Event().wait(0.01)
        assert not signal.unwatched()
    finally:
        signal.room_freed()
        napping.join()
    assert signal.unwatched()


def test_sync_returns_once_the_wrapper_has_landed_what_was_sent_before(tmp_path: Path) -> None:
    """Guard.flush under a wrapper: not before the settles sent earlier have landed (a timeout says so)."""
    ledger = Recording()
    ledger.gate.clear()
    relay = _relay(tmp_path, ledger)
    sender = Sender(relay.path)
    assert sender.send(Settle("h1", "release"))
    assert not sender.sync(0.2)  # the ledger is stuck: not landed, and sync says so
    ledger.gate.set()
    assert sender.sync(10)
    assert ledger.landed == ["h1"]
    relay.close()
    assert sender.sync(1)  # the wrapper gone: it landed what it took before it closed


def _send_steadily(sender: Sender, count: int, apart: float) -> list[str]:
    """``count`` releases ``apart`` seconds apart, as a sequential agent's calls end; their hold ids."""
    sent = []
    for i in range(count):
        assert sender.send(Settle(f"h{i}", "release"))
        sent.append(f"h{i}")
        threading.Event().wait(apart)
    return sent


def test_settles_that_come_steadily_land_in_order_while_they_come(tmp_path: Path) -> None:
    """A child's settles a few per LINGER_S apart (calls that reserve alone, e.g. near a cap): each wakes the
    relay, which lands them as they come (other processes' waiters see the room), every one, in order."""
    ledger = Recording()
    relay = _relay(tmp_path, ledger)
    sender = Sender(relay.path)
    sent = _send_steadily(sender, 40, LINGER_S / 2)
    assert ledger.landed, "nothing landed while the settles kept coming"
    relay.close()
    assert ledger.landed == sent


def test_the_notes_of_calls_whose_settle_never_came_land_at_close(tmp_path: Path) -> None:
    """A call drawn from an advance is noted in a slot of a file of the run directory before it is sent
    (quotawrap.settling.draw_notes); its settle carries the same split, and the note is cleared once the settle is in
    the wrapper's socket. The relay does no work per note: when it closes, it lands the notes still set, after
    the settles it received (a note cleared too late, its process killed in between, lands as nothing: the
    split is idempotent). A close of the advance lands as it comes."""
    from quotawrap.ledger.base import Drawn
    from quotawrap.settling.draw_notes import DrawNotes

    ledger = Recording()
    relay = _relay(tmp_path, ledger)
    sender, notes = Sender(relay.path), DrawNotes(str(tmp_path), encode)
    drawn = Drawn("adv", 100, 10, "chat", None, 1.0, 2.0)
    for call in ("settles", "in-flight", "cleared-late"):
        assert notes.write(Settle(call, "draw", drawn=drawn))
    assert sender.send(Settle("settles", "settle", usage(10), 0.1, 1, None, drawn))
    notes.clear("settles")
    assert sender.send(Settle("cleared-late", "release", drawn=drawn))
    assert sender.send(Settle("adv", "close", drawn=Drawn("adv", 800, 80, "advance", None, 0.0, 0.0)))
    assert decode(encode(Settle("settles", "settle", usage(10), 0.1, 1, None, drawn)))[0].drawn == drawn
    assert relay.close() is True
    landed = [(s.hold_id, s.event) for batch in ledger.batches for s in batch]
    assert landed == [
        ("settles", "settle"),
        ("cleared-late", "release"),
        ("adv", "close"),
        ("in-flight", "draw"),
        ("cleared-late", "draw"),
    ]


def test_a_note_that_cannot_be_read_whole_says_so_at_close(tmp_path: Path) -> None:
    """A torn or foreign note: the relay cannot be sure it landed every draw, so close() says False and the
    wrapper charges what is left of the advances whole (never short)."""
    from quotawrap.settling.draw_notes import SLOT_BYTES, SLOTS

    relay = _relay(tmp_path, Recording())
    torn = bytearray(SLOTS * SLOT_BYTES)
    torn[1:3] = (2).to_bytes(2, "little")  # the header: slot 1 was used
    start = SLOT_BYTES
    torn[start], torn[start + 1 : start + 3], torn[start + 3 : start + 6] = 1, (3).to_bytes(2, "little"), b"\xff" * 3
    (tmp_path / "draws-1-abcd").write_bytes(bytes(torn))
    assert relay.close() is False


def test_close_says_whether_everything_received_has_landed(tmp_path: Path) -> None:
    """The wrapper releases a dead process's advances only when every draw landed (resolve_run's
    release_advances): close() says False while the store refuses what it received."""
    from quotawrap.ledger.base import Drawn

    ledger = Recording(failures=10**6)
    relay = _relay(tmp_path, ledger)
    assert Sender(relay.path).send(Settle("in-flight", "draw", drawn=Drawn("adv", 100, 10, "chat", None, 1.0, 2.0)))
    assert relay.close(timeout=0.3) is False
    (tmp_path / "other").mkdir()
    assert _relay(tmp_path / "other", Recording()).close() is True


def test_a_drawn_calls_settle_is_collected_from_its_slot_and_the_slot_freed(tmp_path: Path) -> None:
    """A drawn call's settle is written beside its note, no datagram sent: the relay collects it (with the bound
    event riding with it) and frees the slot once it has landed, for its process to write again. A sync lands it
    at once; a settle of a process the relay no longer collects from goes as a datagram."""
    from quotawrap.ledger.base import Drawn
    from quotawrap.settling.draw_notes import SLOT_BYTES, note_files

    ledger = Recording()
    relay, sender, notes = _relay_and_slots(tmp_path, ledger, EventLog(str(tmp_path / "events.jsonl")))
    sent: list[Any] = []
    sender._sock = sent  # type: ignore[assignment]  # test-only: a datagram would fail here (a list has no sendto)
    drawn = Drawn("adv", 100, 10, "chat", None, 1.0, 2.0)
    settle = Settle("call-1", "settle", usage(10), 0.1, 7, None, drawn)
    assert notes.write(Settle("call-1", "draw", drawn=drawn))
    assert sender.send(settle, ("m", 64, 1, "added", True)) and sender.unsynced == 1
    assert sender.sync(5.0)  # its own datagram: the settle written before it has landed by the answer
    assert ledger.landed == ["call-1"] and ledger.batches[0][0] == settle
    (name,) = note_files(str(tmp_path))
    data = (tmp_path / name).read_bytes()
    assert data[SLOT_BYTES] == 0  # freed: its process may write it again
    assert notes.write(Settle("call-2", "draw", drawn=drawn))
    relay.close()
    assert read_events(tmp_path / "events.jsonl").bounded_by_model == {"m": 1}
    assert not notes.settle("call-2", encode(settle, with_draw=False))  # closed: it goes as a datagram


def test_settles_in_slots_that_come_steadily_land_in_order_and_reuse_few_slots(tmp_path: Path) -> None:
    """A sequential agent's drawn calls: each settle is collected while the flow goes on, every one lands once,
    and the process, finding the slots its wrapper freed, keeps to the first few pages of its file."""
    from quotawrap.ledger.base import Drawn
    from quotawrap.settling.draw_notes import note_files, slots_used

    ledger = Recording()
    relay, sender, notes = _relay_and_slots(tmp_path, ledger)
    drawn = Drawn("adv", 100, 10, "chat", None, 1.0, 2.0)
    sent = []
    for i in range(300):
        assert notes.write(Settle(f"c{i}", "draw", drawn=drawn))
        assert sender.send(Settle(f"c{i}", "release", drawn=drawn))
        sent.append(f"c{i}")
        threading.Event().wait(LINGER_S / 4)
    assert ledger.landed, "nothing landed while the settles kept coming"
    assert relay.close()
    assert sorted(ledger.landed) == sorted(sent)  # each once; a look takes slots in their order, not the sends'
    (name,) = note_files(str(tmp_path))
    assert slots_used((tmp_path / name).read_bytes()) < 300  # slots freed were written again


def test_a_settle_written_in_a_slot_by_a_killed_process_lands_exactly_at_close(tmp_path: Path) -> None:
    """SIGKILLed right after its call settled: the settle is in the slot (the kernel's pages), and the wrapper
    lands it exactly, with its draw, instead of charging the call whole."""
    import os
    import signal

    from quotawrap.ledger.base import Drawn
    from quotawrap.settling.draw_notes import DrawNotes

    ledger = Recording()
    ledger.gate.clear()  # nothing lands before close(): the settle is still in its slot when the process dies
    relay = _relay(tmp_path, ledger)
    drawn = Drawn("adv", 100, 10, "chat", None, 1.0, 2.0)
    settle = Settle("killed", "settle", usage(10), 0.1, 7, None, drawn)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        sender, notes = Sender(relay.path), DrawNotes(str(tmp_path), encode)
        sender.notes = notes
        notes.write(Settle("killed", "draw", drawn=drawn))
        sender.send(settle)
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    ledger.gate.set()
    assert relay.close() is True
    assert settle in [s for batch in ledger.batches for s in batch]
    assert all(s.event != "draw" for batch in ledger.batches for s in batch)  # its note made moot by the settle


def _drawn_in_slot(notes: Any, sender: Sender, hold_id: str) -> Settle:
    """A call drawn from advance ``adv`` and settled: its note, then its settle, written in its slot."""
    from quotawrap.ledger.base import Drawn

    drawn = Drawn("adv", 100, 10, "chat", None, 1.0, 2.0)
    assert notes.write(Settle(hold_id, "draw", drawn=drawn))
    settle = Settle(hold_id, "settle", usage(10), 0.1, 7, None, drawn)
    assert sender.send(settle)
    return settle


def test_settles_in_slots_are_taken_when_their_advance_closes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay need not look in the slots on a timer: it takes them when the process closes the advance they
    were drawn from (its datagram), and lands them with the close."""
    from quotawrap.ledger.base import Drawn
    from quotawrap.settling import handoff

    monkeypatch.setattr(handoff, "COLLECT_EVERY_S", 3600.0)  # no look on the timer during this test
    ledger = Recording()
    relay, sender, notes = _relay_and_slots(tmp_path, ledger)
    try:
        settles = [_drawn_in_slot(notes, sender, f"call-{i}") for i in range(3)]
        started = time.monotonic()
        assert sender.send(Settle("adv", "close", drawn=Drawn("adv", 70, 7, "advance", None, 0.0, 0.0)))
        while len(ledger.landed) < 4 and time.monotonic() - started < 5:
            time.sleep(0.001)
        assert sorted(ledger.landed) == ["adv", "call-0", "call-1", "call-2"]
        assert [s for batch in ledger.batches for s in batch if s.event == "settle"] == settles
    finally:
        relay.close()


def test_a_sync_takes_the_settles_written_in_slots_before_it_while_datagrams_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settles come steadily as datagrams; one written in a slot just before a sync has landed when the sync is
    answered."""
    from quotawrap.settling import handoff

    monkeypatch.setattr(handoff, "COLLECT_EVERY_S", 3600.0)  # no look on the timer during this test
    ledger = Recording()
    relay, sender, notes = _relay_and_slots(tmp_path, ledger)
    try:
        for i in range(20):  # as datagrams: releases of calls not drawn
            assert sender.send(Settle(f"h{i}", "release"))
            threading.Event().wait(LINGER_S / 3)
        in_slot = _drawn_in_slot(notes, sender, "drawn")
        assert sender.sync(5.0)
        assert in_slot in [s for batch in ledger.batches for s in batch]
    finally:
        relay.close()


def test_with_nothing_else_coming_a_settle_in_a_slot_lands_within_a_look(tmp_path: Path) -> None:

    ledger = Recording()
    relay, sender, notes = _relay_and_slots(tmp_path, ledger)
    try:
        _drawn_in_slot(notes, sender, "alone")
        started = time.monotonic()
        while not ledger.landed and time.monotonic() - started < 30 * COLLECT_EVERY_S:
            time.sleep(0.005)
        assert ledger.landed == ["alone"]
    finally:
        relay.close()


def test_a_notes_file_the_relay_looks_for_while_its_process_makes_it_is_collected_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay looks for new notes files (here: on a sync) while a process is making its own, between creating
    it and sizing it: the settles that process then writes in its slots are still collected while the run goes on.
    A file seen short was never looked in again, its drawn calls stayed in flight to the run's end, and the
    calls of two wrappers near their cap all waited for them (--wait): neither run ended."""
    import os

    from quotawrap.settling.draw_notes import SLOT_BYTES, SLOTS, note_files

    ledger = Recording()
    relay, sender, notes = _relay_and_slots(tmp_path, ledger)
    sized = os.ftruncate
    seen_short: list[str] = []

    def looked_for_meanwhile(fd: int, length: int) -> None:
        assert sender.sync(5.0)  # a sync has the relay look for new files before it answers
        seen_short.extend(n for n in note_files(str(tmp_path)) if (tmp_path / n).stat().st_size != SLOTS * SLOT_BYTES)
        sized(fd, length)

    monkeypatch.setattr(os, "ftruncate", looked_for_meanwhile)
    try:
        settle = _drawn_in_slot(notes, sender, "drawn-first")
        monkeypatch.undo()
        assert sender.sync(5.0)
        assert [s for batch in ledger.batches for s in batch] == [settle]
        assert seen_short == []  # the file is in the run directory only once whole
    finally:
        relay.close()
