"""How much a model thinks, learned from its settled calls in a real SQLite ledger."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from quotawrap.admission.allowance import AllowanceBook, model_reasoning
from quotawrap.core.errors import StoreError
from quotawrap.core.estimate import MAX_OUTPUT_TOKENS
from quotawrap.core.usage import Usage
from quotawrap.ledger import Ledger
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from tests.conftest import hold_request

MODEL = "deepseek-v4-flash"


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SQLiteLedger]:
    store = SQLiteLedger(tmp_path / "ledger.sqlite3")
    yield store
    store.close()


def _settle(ledger: SQLiteLedger, reasoning: int, *, model: str = MODEL, endpoint: str = "chat") -> None:
    hold = hold_request(model, endpoint=endpoint, reserve=100_000)
    decision = ledger.reserve(hold, lambda _snapshot: [])
    output = reasoning + 100
    ledger.settle(decision.hold_id, Usage(10, output, 10 + output, reasoning_tokens=reasoning))


class TestAllowanceBook:
    def test_no_history(self, ledger: SQLiteLedger) -> None:
        """A model never settled has nothing learned: the guard falls back to the seed's reserve."""
        assert AllowanceBook(lambda: ledger).reasoning(MODEL) is None

    def test_learns_from_the_ledger(self, ledger: SQLiteLedger) -> None:
        """The largest reasoning of a few settled calls, per model; embeddings say nothing."""
        for reasoning in (1_000, 12_000, 30_000):
            _settle(ledger, reasoning)
        _settle(ledger, 60_000, model="other-model")
        _settle(ledger, 0, endpoint="embeddings")
        assert AllowanceBook(lambda: ledger).reasoning(MODEL) == 30_000
        assert model_reasoning(ledger.call_records()) == {MODEL: 30_000, "other-model": 60_000}

    def test_a_call_our_bound_cut_teaches_twice_the_bound(self, ledger: SQLiteLedger) -> None:
        """An output that reached the bound says the model wanted more: it counts as twice the bound."""
        _settle(ledger, 0)
        book = AllowanceBook(lambda: ledger)
        assert book.reasoning(MODEL) == 0
        book.observe(MODEL, 4_000, 4_096, bound=4_096)
        assert book.reasoning(MODEL) == 8_192
        book.observe(MODEL, 40_000, 40_000, bound=40_000)
        assert book.reasoning(MODEL) == MAX_OUTPUT_TOKENS

    def test_this_process_learns_before_the_next_read(self, ledger: SQLiteLedger) -> None:
        """Calls settled here count at once, without waiting for the 30 s re-read of the ledger."""
        book = AllowanceBook(lambda: ledger)
        assert book.reasoning(MODEL) is None
        book.observe(MODEL, 9_000, 9_050, bound=20_000)
        assert book.reasoning(MODEL) == 9_000


class _PausedReads:
    """The real ledger, whose reads of a model's history pause until ``release`` is set (a slow store)."""

    def __init__(self, ledger: SQLiteLedger, fail_first: bool = False) -> None:
        self.ledger = ledger
        self.started, self.release = threading.Event(), threading.Event()
        self.reads = 0
        self.fail_first = fail_first

    def reasoning_history(self, model: str, *, since: float, limit: int) -> list[int]:
        self.reads += 1
        self.started.set()
        assert self.release.wait(60)
        if self.fail_first and self.reads == 1:
            raise StoreError("the store went away", store="sqlite:///gone")
        return self.ledger.reasoning_history(model, since=since, limit=limit)


def _burst(book: AllowanceBook, paused: _PausedReads, callers: int) -> dict[int, int | str | None]:
    """``callers`` threads ask at once, all while the first one's read of the ledger is under way."""
    results: dict[int, int | str | None] = {}

    def ask(n: int) -> None:
        try:
            results[n] = book.reasoning(MODEL)
        except StoreError:
            results[n] = "failed"

    first = threading.Thread(target=ask, args=(0,))
    first.start()
    assert paused.started.wait(60)
    others = [threading.Thread(target=ask, args=(n,)) for n in range(1, callers)]
    for thread in others:
        thread.start()
    asked = time.monotonic() + 0.5  # they ask now, while the read is paused (answering them meanwhile was the bug)
    for thread in others:
        thread.join(max(0.0, asked - time.monotonic()))
    paused.release.set()
    for thread in (first, *others):
        thread.join(60)
    return results


class TestFirstRead:
    def test_concurrent_first_callers_wait_for_the_one_read(self, ledger: SQLiteLedger) -> None:
        """Threads asking while a model's first read of the ledger is under way get the history it finds (one
        read for all), not "no history", which reserved the no-history bound for a whole burst."""
        for reasoning in (2_000, 12_000):
            _settle(ledger, reasoning)
        paused = _PausedReads(ledger)
        book = AllowanceBook(lambda: cast(Ledger, paused))
        assert _burst(book, paused, 20) == dict.fromkeys(range(20), 12_000)
        assert paused.reads == 1

    def test_a_refresh_under_way_keeps_the_history_read_before(self, ledger: SQLiteLedger) -> None:
        """Once a model has history, a re-read does not hold anyone up: the others plan with what was read."""
        _settle(ledger, 5_000)
        paused = _PausedReads(ledger)
        clock = [1_000.0]
        book = AllowanceBook(lambda: cast(Ledger, paused), clock=lambda: clock[0], refresh_s=30.0)
        paused.release.set()
        assert book.reasoning(MODEL) == 5_000
        paused.release.clear()
        paused.started.clear()
        _settle(ledger, 9_000)
        clock[0] += 31  # the refresh is due
        results: list[int | None] = []
        reader = threading.Thread(target=lambda: results.append(book.reasoning(MODEL)))
        reader.start()
        assert paused.started.wait(60)
        assert book.reasoning(MODEL) == 5_000  # answered at once, from the history read before
        paused.release.set()
        reader.join(60)
        assert results == [9_000] and book.reasoning(MODEL) == 9_000

    def test_a_failed_first_read_is_tried_again(self, ledger: SQLiteLedger) -> None:
        """The read's error reaches its caller; the callers that waited for it go on without history, and the
        next call reads again."""
        _settle(ledger, 7_000)
        paused = _PausedReads(ledger, fail_first=True)
        book = AllowanceBook(lambda: cast(Ledger, paused))
        results = _burst(book, paused, 5)
        assert results[0] == "failed" and {results[n] for n in range(1, 5)} == {None}
        assert book.reasoning(MODEL) == 7_000
        assert paused.reads == 2


def test_the_known_p99_never_falls_below_the_truth_and_catches_up(ledger: SQLiteLedger) -> None:
    """The p99 is kept between settles that cannot raise it: read after each settle it is at or above
    the exact p99 of the window, a larger value shows at once, and within 64 settles it is exact again."""
    import random

    from quotawrap.admission.allowance import HISTORY_CALLS
    from quotawrap.core.estimate import learned_allowance

    def truth() -> int | None:
        return learned_allowance(seen[-HISTORY_CALLS:], floor=0)

    book = AllowanceBook(lambda: ledger, refresh_s=3600)
    rng = random.Random(7)
    seen: list[int] = []
    assert book.reasoning(MODEL) is None  # the ledger read (no history there)
    for i in range(2500):  # a heavy tail, then only small values: the p99 must come down
        value = rng.choice([0, 10, 100, 1000, rng.randrange(5000)]) if i < 1500 else rng.randrange(50)
        book.observe(MODEL, value, value, None)
        seen.append(value)
        known, exact = book.reasoning(MODEL), truth()
        assert known is not None and exact is not None and known >= exact
    for value in [7] * 64:  # small settles only: the high old figure is recomputed within 64
        book.observe(MODEL, value, value, None)
        seen.append(value)
    assert book.reasoning(MODEL) == truth() == 49
    for _ in range(11):  # each above the p99: counted at once, the 11th of 1,000 makes it the p99
        book.observe(MODEL, 4000, 4000, None)
        seen.append(4000)
        assert book.reasoning(MODEL) == truth()
    assert truth() == 4000
