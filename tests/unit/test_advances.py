"""Advances (quotawrap.admission.advances): room a process reserves ahead for its next calls, drawn without the ledger.

The sizing rule is a table; the ledger's side (a drawn call's row split from the advance's as its settle lands,
a close giving back what was not drawn) is checked on both ledgers, a real SQLite file and a real redis-server,
against the sum of what each call and the advance still hold, on generated orders of settles, replays and closes.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotawrap.admission.advances import ADVANCE_CALLS, ADVANCE_S, ROOM_SHARE, Advances, advance_size
from quotawrap.core.quota import Counters, Limit
from quotawrap.core.usage import Usage
from quotawrap.ledger import HoldRequest, Ledger, open_ledger
from quotawrap.ledger.base import ADVANCE, Drawn, ModelTotals, Settle
from quotawrap.ledger.redis import RedisLedger
from quotawrap.ledger.scopes import scope_keys
from quotawrap.ledger.sqlite.advances import LANDED_TOGETHER, drawn_runs
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from tests.redis_server import flushed, session_url
from tests.unit.test_ledger_sqlite import DAY, MODEL
from tests.unit.test_ledger_sqlite import _hold as sqlite_hold

RUN = "run-1"


def _hold(reserve: int = 100, reserve_cost: int = 10, **changes: object) -> HoldRequest:
    """test_ledger_sqlite's call (run-1, MODEL, DAY, chat), with a cost."""
    return sqlite_hold(reserve, reserve_cost=reserve_cost, **changes)


class _Told(list[Settle]):
    """The wrapper's socket, as Advances tells it of draws: takes each (True) until ``full``."""

    full = False

    def append(self, settle: Settle) -> bool:  # type: ignore[override]
        if self.full:
            return False
        super().append(settle)
        return True


class _Wired(NamedTuple):
    """Advances on a real SQLite ledger, with what they landed (closes) and told the wrapper (draws)."""

    ledger: SQLiteLedger
    advances: Advances
    landed: list[Settle]
    told: _Told


def _wired(tmp_path: Path) -> _Wired:
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite3")
    landed: list[Settle] = []
    told = _Told()
    return _Wired(ledger, Advances(lambda: ledger, landed.append, told.append), landed, told)


@pytest.fixture(scope="module")
def module_redis() -> Iterator[str]:
    with session_url() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def fresh_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Ledger]]:
    """Opens an empty ledger of the kind the test runs on (the SQLite file, the Redis database flushed)."""
    opened: list[Ledger] = []

    def fresh() -> Ledger:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / f'ledger{len(opened)}.sqlite3'}"
            opened.append(open_ledger(url))
        else:  # given this host's clock, it takes the calls' day (DAY, in May) as given: the server's would be today
            opened.append(RedisLedger(flushed(request.getfixturevalue("module_redis")), clock=time.time))
        return opened[-1]

    yield fresh
    for ledger in opened:
        ledger.close()


@pytest.fixture
def ledger(fresh_ledger: Callable[[], Ledger]) -> Ledger:
    return fresh_ledger()


def _daily(cap: int) -> list[Limit]:
    return [Limit("daily_cap", "model_day", cap)]


def _counters(settled: int = 0, in_flight: int = 0, cost_settled: int = 0) -> dict[str, Counters]:
    return {"model_day": Counters(settled, in_flight), "run_cost": Counters(cost_settled, 0)}


@pytest.mark.parametrize(
    ("limits", "counters", "reserve", "reserve_cost", "size"),
    [
        # room plenty: ADVANCE_CALLS calls' reserve, the cost scaled as the tokens
        (_daily(2_000_000), _counters(), 1_000, 50, (16_000, 800)),
        # no limit at all (a --watch-less run with no cap is never so, but the rule holds)
        ([], {}, 1_000, 50, (16_000, 800)),
        # 500k of room: beyond the call, 1/64 of it (7,812), its cost rounded up
        (_daily(2_000_000), _counters(1_500_000), 1_000, 50, (8_812, 441)),
        # in flight counts as spent
        (_daily(2_000_000), _counters(1_000_000, 500_000), 1_000, 50, (8_812, 441)),
        # 64k of room leaves exactly one more call: the smallest advance
        (_daily(2_000_000), _counters(1_936_000), 1_000, 50, (2_000, 100)),
        # less than one more call: the call reserves alone
        (_daily(2_000_000), _counters(1_936_001), 1_000, 50, None),
        # a soft-evict wall near: its room bounds the advance too (settled only)
        ([*_daily(2000000), Limit("usage_wall", "model_day", 1000000, "wall")], _counters(995_000), 100, 5, None),
        (
            [*_daily(2000000), Limit("usage_wall", "model_day", 1000000, "wall")],
            _counters(900_000),
            100,
            5,
            (1_600, 80),
        ),
        # the run's cost cap: beyond the call's cost, at most 1/64 of its room
        ([*_daily(2000000), Limit("cost_cap", "run_cost", 64000)], _counters(), 1_000, 50, (16_000, 800)),
        ([*_daily(2000000), Limit("cost_cap", "run_cost", 64000)], _counters(cost_settled=20_000), 1_000, 50, None),
        # nothing to reserve, or a cost below zero: no advance
        (_daily(2_000_000), _counters(), 0, 0, None),
        (_daily(2_000_000), _counters(), 10, -1, None),
        # a cap already passed
        (_daily(2_000_000), _counters(2_100_000), 1_000, 50, None),
    ],
)
def test_advance_size(
    limits: list[Limit], counters: dict[str, Counters], reserve: int, reserve_cost: int, size: tuple[int, int] | None
) -> None:
    assert advance_size(limits, counters, reserve, reserve_cost) == size


def test_the_size_constants_are_what_the_table_assumes() -> None:
    assert (ADVANCE_CALLS, ROOM_SHARE) == (16, 64)


def _no_limits(_snapshot: object) -> list[Limit]:
    return []


def _in_flight(ledger: Ledger) -> dict[str, Counters]:
    keys = scope_keys(RUN, MODEL, DAY)
    counters = ledger.counters(list(keys.values()))
    return {scope: counters[key] for scope, key in keys.items()}


def _take(ledger: Ledger, size: int, cost: int) -> str:
    advance = _hold(size, cost, endpoint=ADVANCE, advance=True)
    assert ledger.reserve(advance, _no_limits).held
    return advance.hold_id


def _drawn(advance_id: str, reserve: int, cost: int) -> Drawn:
    return Drawn(advance_id, reserve, cost, "chat", "fp", time.time(), time.time() + 3600)


def test_a_refused_advance_leaves_no_row(ledger: Ledger) -> None:
    """An advance the limits refuse is no call: no blocked row, nothing in any view."""
    advance = _hold(5_000, 0, endpoint=ADVANCE, advance=True)
    decision = ledger.reserve(advance, lambda _s: _daily(1_000))
    assert not decision.held and not decision.verdict.allowed
    assert ledger.call_records() == []
    assert ledger.run_totals(RUN).totals == ModelTotals()
    # a call refused alike is recorded, as before
    assert not ledger.reserve(_hold(5_000, 0), lambda _s: _daily(1_000)).held
    assert [record.state for record in ledger.call_records()] == ["blocked"]


def test_drawn_calls_settle_into_rows_of_their_own_and_the_advance_goes(ledger: Ledger) -> None:
    advance_id = _take(ledger, 1_000, 100)
    assert _in_flight(ledger)["model_day"] == Counters(0, 1_000)
    totals = ledger.run_totals(RUN).models[MODEL]
    assert (totals.calls, totals.reserved_open_tokens) == (0, 1_000)  # room held, no call yet
    first, second = _hold(300, 30), _hold(200, 20)
    ledger.settle_many(
        [
            Settle(first.hold_id, "settle", Usage(10, 20, 30), 0.1, 7, None, _drawn(advance_id, 300, 30)),
            Settle(second.hold_id, "release", drawn=_drawn(advance_id, 200, 20)),
        ]
    )
    # the advance still holds what no call drew: 500 tokens, 50 of cost
    assert _in_flight(ledger) == {"run": Counters(30, 500), "model_day": Counters(30, 500), "run_cost": Counters(7, 50)}
    records = {record.id: record for record in ledger.call_records()}
    assert (records[first.hold_id].state, records[first.hold_id].reserved, records[first.hold_id].charged) == (
        "settled",
        300,
        30,
    )
    assert records[first.hold_id].key_fingerprint == "fp" and records[first.hold_id].endpoint == "chat"
    assert records[second.hold_id].state == "released"
    left = Drawn(advance_id, 500, 50, ADVANCE, None, 0.0, 0.0)
    ledger.settle_many([Settle(advance_id, "close", drawn=left)])
    ledger.settle_many([Settle(advance_id, "close", drawn=left)])  # a close landed twice gives back once
    assert _in_flight(ledger)["model_day"] == Counters(30, 0)
    assert advance_id not in {record.id for record in ledger.call_records()}  # an advance is no call


def test_a_killed_process_advance_is_charged_whole_and_its_late_settles_count_once(ledger: Ledger) -> None:
    """What the wrapper does when its child died with an advance open: the rest of the advance (its calls in
    flight are in it) is charged as unresolved; a drawn call's settle landing after that splits nothing."""
    advance_id = _take(ledger, 1_000, 100)
    done = _hold(300, 30)
    ledger.settle_many([Settle(done.hold_id, "settle", Usage(10, 20, 30), 0.1, 7, None, _drawn(advance_id, 300, 30))])
    assert ledger.resolve_run(RUN) == 1
    assert _in_flight(ledger)["model_day"] == Counters(30 + 700, 0)
    late = _hold(200, 20)
    ledger.settle_many([Settle(late.hold_id, "settle", Usage(1, 2, 3), 0.1, 1, None, _drawn(advance_id, 200, 20))])
    assert _in_flight(ledger)["model_day"] == Counters(730, 0)
    assert late.hold_id not in {record.id for record in ledger.call_records()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    calls=st.lists(
        st.tuples(st.integers(1, 400), st.sampled_from(["settle", "release", "charge", "open"]), st.booleans()),
        max_size=8,
    ),
    close_at=st.integers(0, 16),
    seed=st.randoms(use_true_random=False),
    batched=st.booleans(),
)
def test_in_flight_is_the_advance_left_plus_its_calls_open(
    fresh_ledger: Callable[[], Ledger], calls: list[Any], close_at: int, seed: Any, batched: bool
) -> None:
    """On generated draws landed in any order, some twice, with the close anywhere among them, one by one or in
    one batch: in flight is what the open calls reserved plus, until the close, what no call drew; settled what
    the others were charged; each call landed counts once, and the advance, once empty, is gone."""
    ledger = fresh_ledger()
    size = sum(reserve for reserve, *_ in calls) + 50
    advance_id = _take(ledger, size, 0)
    settles, open_reserved, settled = [], 0, 0
    for reserve, end, twice in calls:
        hold = _hold(reserve, 0)
        drawn = _drawn(advance_id, reserve, 0)
        if end == "open":  # drawn, in flight: its settle has not landed (it stays in the advance)
            open_reserved += reserve
            continue
        usage = Usage(1, 2, 3) if end == "settle" else None
        event = "release" if end == "release" else "settle"
        settles += [Settle(hold.hold_id, event, usage, None, None, None, drawn)] * (2 if twice else 1)
        settled += {"settle": 3, "release": 0, "charge": reserve}[end]
    seed.shuffle(settles)
    close = Settle(advance_id, "close", drawn=Drawn(advance_id, 50, 0, ADVANCE, None, 0.0, 0.0))
    settles.insert(min(close_at, len(settles)), close)
    for batch in [settles] if batched else [[settle] for settle in settles]:
        ledger.settle_many(batch)
    assert _in_flight(ledger)["model_day"] == Counters(settled, open_reserved)
    assert _in_flight(ledger)["run"] == Counters(settled, open_reserved)
    totals = ledger.run_totals(RUN).totals
    landed = sum(1 for _, end, _ in calls if end != "open")
    assert (totals.calls, totals.reserved_open_tokens, totals.settled_tokens) == (landed, open_reserved, settled)
    assert (advance_id in {record.id for record in ledger.call_records()}) == (open_reserved > 0)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    calls=st.lists(
        st.tuples(
            st.integers(0, 1),  # the advance it was drawn from
            st.integers(1, 400),
            st.sampled_from(["settle", "release", "absurd"]),
            st.booleans(),  # its draw landed first (a row split into holds)
            st.booleans(),  # landed twice
        ),
        max_size=40,
    ),
    close_at=st.lists(st.integers(0, 80), min_size=2, max_size=2),
    seed=st.randoms(use_true_random=False),
)
def test_a_batch_of_drawn_settles_lands_as_its_settles_one_by_one(
    tmp_path_factory: pytest.TempPathFactory, calls: list[Any], close_at: list[int], seed: Any
) -> None:
    """SQLite lands a batch's drawn calls of one advance together (land_drawn: one read of the advance, one of
    the calls' rows, one give-up). On generated batches, drawn from two advances in any order, some drawn
    first, some twice, more than LANDED_TOGETHER of them, each advance's close anywhere among them: the rows,
    the counters and what is left of each advance are what landing each settle on its own leaves."""
    clock = lambda: 1_000.0  # noqa: E731 - both ledgers' rows end at the same moment
    sizes = [sum(reserve for which, reserve, *_ in calls if which == advance) + 50 for advance in (0, 1)]
    advances = [_hold(size, size // 10, endpoint=ADVANCE, advance=True) for size in sizes]
    draws, settles = [], []
    for which, reserve, end, draw_first, twice in calls:
        hold, drawn = _hold(reserve, reserve // 10), _drawn(advances[which].hold_id, reserve, reserve // 10)
        if draw_first:
            draws.append(Settle(hold.hold_id, "draw", drawn=drawn))
        usage = {"settle": Usage(10, 20, 30), "absurd": Usage(-1, 2**70, 2**70)}.get(end)
        event = "release" if end == "release" else "settle"
        settles += [Settle(hold.hold_id, event, usage, 0.25, reserve // 20, None, drawn)] * (2 if twice else 1)
    seed.shuffle(settles)
    for advance, at in zip(advances, close_at, strict=True):
        rest = Drawn(advance.hold_id, 50, 5, ADVANCE, None, 0.0, 0.0)
        settles.insert(min(at, len(settles)), Settle(advance.hold_id, "close", drawn=rest))
    books = []
    for batched in (False, True):
        ledger = SQLiteLedger(tmp_path_factory.mktemp("ledger") / "ledger.sqlite3", clock=clock)
        assert all(ledger.reserve(advance, _no_limits).held for advance in advances)
        if draws:
            ledger.settle_many(draws)
        for batch in [settles] if batched else [[settle] for settle in settles]:
            ledger.settle_many(batch)
        books.append((sorted(ledger.call_records(), key=lambda record: record.id), _in_flight(ledger)))
        ledger.close()
    assert books[0] == books[1]
    assert {call.id for call in books[0][0]} >= {settle.hold_id for settle in settles if settle.event != "close"}


def test_a_batch_longer_than_a_run_lands_every_call_of_its_advance(tmp_path: Path) -> None:
    """A relay's batch may hold more of one advance's calls than one run lands together (LANDED_TOGETHER): it
    lands them in runs of at most that many, every call once, and the advance, drawn whole, is gone."""
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite3")
    calls = 2 * LANDED_TOGETHER + 6
    advance_id = _take(ledger, 100 * calls, 0)
    drawn = _drawn(advance_id, 100, 0)
    settles = [Settle(_hold(100, 0).hold_id, "settle", Usage(1, 2, 3), None, None, None, drawn) for _ in range(calls)]
    assert [len(run) for run in drawn_runs(settles)] == [LANDED_TOGETHER, LANDED_TOGETHER, 6]
    ledger.settle_many(settles)
    assert _in_flight(ledger)["model_day"] == Counters(3 * calls, 0)
    assert {record.id for record in ledger.call_records()} == {settle.hold_id for settle in settles}
    ledger.close()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    reserve=st.integers(-5, 400),
    cost=st.integers(-5, 40),
    spare=st.sampled_from([0, 1, 300]),
    end=st.sampled_from(["settle", "release", "unknown", "absurd"]),
    later=st.sampled_from([None, "settle", "release"]),
)
def test_a_drawn_call_lands_alike_whether_its_draw_landed_first(
    tmp_path_factory: pytest.TempPathFactory, reserve: int, cost: int, spare: int, end: str, later: str | None
) -> None:
    """SQLite lands a drawn call's settle straight into calls when no row of it exists (land_drawn); with its
    draw landed first, the call's row is split into holds and the settle moves it (split_from_advance, then
    the step). On generated settles, the advance emptied or not, and a second settle after: the rows, the
    counters and what is left of the advance are the same either way."""
    clock = lambda: 1_000.0  # noqa: E731 - both ledgers' rows end at the same moment
    advance = _hold(max(reserve, 0) + spare, max(cost, 0) + spare, endpoint=ADVANCE, advance=True)
    hold, drawn = _hold(reserve, cost), _drawn(advance.hold_id, reserve, cost)
    usage = {"settle": Usage(10, 20, 30), "absurd": Usage(-1, 2**70, 2**70)}.get(end)
    event = "release" if end == "release" else "settle"
    books = []
    for draw_first in (False, True):
        ledger = SQLiteLedger(tmp_path_factory.mktemp("ledger") / "ledger.sqlite3", clock=clock)
        assert ledger.reserve(advance, _no_limits).held
        if draw_first:
            ledger.settle_many([Settle(hold.hold_id, "draw", drawn=drawn)])
        ledger.settle_many([Settle(hold.hold_id, event, usage, 0.25, cost + 1, "why", drawn)])
        if later is not None:  # the same call's settle again, or another end: the first one stands
            ledger.settle_many([Settle(hold.hold_id, later, Usage(1, 1, 2), None, 1, None, drawn)])
        books.append((ledger.call_records(), _in_flight(ledger)))
        ledger.close()
    assert books[0] == books[1]
    records, _ = books[0]
    assert any(record.id == hold.hold_id for record in records)
    assert (advance.hold_id in {record.id for record in records}) == (spare > 0)


def test_an_advance_the_limits_refuse_is_asked_for_again_later(tmp_path: Path) -> None:
    """Room short now is no reason to stop asking (only a store that refuses every advance is: see
    test_ledger_contract's Cluster case)."""
    wired = _wired(tmp_path)
    counters = _counters()
    assert wired.advances.take(_hold(100, 10), 0.0, lambda _s: _daily(1_000), [], counters) is None
    assert not wired.advances.declined
    assert wired.advances.take(_hold(100, 10), 0.0, _no_limits, [], counters) is not None


def test_advances_draw_until_what_is_left_does_not_cover_a_call(tmp_path: Path) -> None:
    wired = _wired(tmp_path)
    assert wired.advances.draw(_hold(100, 10), 0.0) is None  # none open
    taken = wired.advances.take(_hold(100, 10), 0.0, _no_limits, [], _counters())
    assert taken is not None and taken.held and taken.advance_id is not None
    assert _in_flight(wired.ledger)["model_day"] == Counters(0, 1_600)
    # a call that reserves nothing is never drawn: an advance emptied by its other calls and its close is gone,
    # and the settle of a call drawn from a gone advance splits nothing
    assert wired.advances.draw(_hold(0, 0), 0.0) is None
    drawn = [wired.advances.draw(_hold(100, 10), 0.0) for _ in range(ADVANCE_CALLS - 1)]
    assert all(d is not None and d.advance_id == taken.advance_id for d in drawn)
    assert wired.landed == []
    assert wired.advances.draw(_hold(100, 10), 0.0) is None  # spent: closed, giving back nothing
    nothing_left = Drawn(taken.advance_id, 0, 0, ADVANCE, None, 0.0, 0.0)
    assert wired.landed == [Settle(taken.advance_id, "close", drawn=nothing_left)]


def test_an_advance_older_than_its_time_is_given_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wired = _wired(tmp_path)
    clock = [1_000.0]
    monkeypatch.setattr("quotawrap.admission.advances.time.monotonic", lambda: clock[0])
    taken = wired.advances.take(_hold(100, 10), 0.0, _no_limits, [], _counters())
    assert taken is not None and wired.advances.draw(_hold(100, 10), 0.0) is not None
    clock[0] += ADVANCE_S + 0.01
    assert wired.advances.draw(_hold(100, 10), 0.0) is None
    assert [(s.hold_id, s.event, s.drawn and s.drawn.reserved) for s in wired.landed] == [
        (taken.advance_id, "close", 1_400)
    ]


def test_the_idle_closer_gives_back_an_advance_no_call_draws(tmp_path: Path) -> None:
    wired = _wired(tmp_path)
    taken = wired.advances.take(_hold(100, 10), 0.0, _no_limits, [], _counters())
    assert taken is not None
    deadline = time.monotonic() + 10 * ADVANCE_S
    while not wired.landed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(s.hold_id, s.event) for s in wired.landed] == [(taken.advance_id, "close")]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_starts_with_no_advance(tmp_path: Path) -> None:
    """Two processes never draw from one advance: the child forgets the parent's (the parent gives it back
    before the fork, with its settles)."""
    wired = _wired(tmp_path)
    assert wired.advances.take(_hold(100, 10), 0.0, _no_limits, [], _counters()) is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        os.write(write, b"none" if wired.advances.draw(_hold(100, 10), 0.0) is None else b"drew")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 16)
    os.waitpid(pid, 0)
    assert answer == b"none"
    assert [s.event for s in wired.landed] == ["close"]  # given back before the fork


def test_a_call_the_wrapper_cannot_be_told_of_is_not_drawn(tmp_path: Path) -> None:
    """The wrapper must know of every call in flight (it charges them if the process dies): a draw its socket
    does not take is undone, and the call reserves alone."""
    wired = _wired(tmp_path)
    taken = wired.advances.take(_hold(100, 10), 5.0, _no_limits, [], _counters())
    assert taken is not None
    (first,) = wired.told
    assert (first.event, first.drawn) == (
        "draw",
        Drawn(taken.advance_id, 100, 10, "chat", None, 5.0, first.drawn.expires_at),
    )
    wired.told.full = True
    assert wired.advances.draw(_hold(100, 10), 6.0) is None
    wired.told.full = False
    assert all(
        wired.advances.draw(_hold(100, 10), 7.0) is not None for _ in range(ADVANCE_CALLS - 1)
    )  # nothing was lost


def test_a_dead_process_advance_is_released_once_every_draw_landed(ledger: Ledger) -> None:
    """The wrapper's resolve after its relay landed everything: the calls drawn and still in flight are charged
    whole (rows of their own, split by their draws), what the dead process did not draw is released."""
    dead = subprocess_pid_that_exited()
    advance = _hold(1_000, 100, endpoint=ADVANCE, advance=True, pid=dead, host=socket.gethostname())
    assert ledger.reserve(advance, _no_limits).held
    in_flight, done = _hold(300, 30), _hold(200, 20)
    ledger.settle_many(
        [
            Settle(in_flight.hold_id, "draw", drawn=_drawn(advance.hold_id, 300, 30)),
            Settle(done.hold_id, "draw", drawn=_drawn(advance.hold_id, 200, 20)),
            Settle(done.hold_id, "settle", Usage(1, 2, 3), 0.1, 1, None, _drawn(advance.hold_id, 200, 20)),
        ]
    )
    assert _in_flight(ledger)["model_day"] == Counters(3, 800)
    assert ledger.resolve_run(RUN, release_advances=True) == 1
    assert _in_flight(ledger)["model_day"] == Counters(3 + 300, 0)
    states = {record.id: record.state for record in ledger.call_records()}
    assert states == {in_flight.hold_id: "unresolved", done.hold_id: "settled"}


def test_a_live_process_advance_is_charged_whole_even_so(ledger: Ledger) -> None:
    """A process of the run still alive may still draw from its advance: it is charged whole, never released."""
    _take(ledger, 1_000, 100)
    assert ledger.resolve_run(RUN, release_advances=True) == 1
    assert _in_flight(ledger)["model_day"] == Counters(1_000, 0)


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.parametrize(
    ("under_a_wrapper", "watch", "takes"), [(True, False, True), (True, True, False), (False, False, False)]
)
def test_only_a_guarded_child_under_a_wrapper_and_never_watch_takes_advances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, under_a_wrapper: bool, watch: bool, takes: bool
) -> None:
    """Advances need the wrapper (it is told of every draw) and change nothing a --watch run would see."""
    from quotawrap.admission.guard import Guard
    from quotawrap.config.settings import Settings
    from quotawrap.support.files import SOCKET_VARIABLE

    if under_a_wrapper:
        monkeypatch.setenv(SOCKET_VARIABLE, str(tmp_path / "settle.sock"))
    else:
        monkeypatch.delenv(SOCKET_VARIABLE, raising=False)
    guard = Guard(Settings(run_id=RUN, watch=watch), SQLiteLedger(tmp_path / "l.sqlite3"), background_settle=True)
    assert (guard.advances is not None) is takes


def test_every_advance_is_given_back_when_the_settles_land_at_exit(tmp_path: Path) -> None:
    """flush_all (atexit, a multiprocessing child's finalizers, before fork) closes the advances first, so their
    closes land with the settles."""
    from quotawrap.settling.settler import flush_all

    wired = _wired(tmp_path)
    taken = wired.advances.take(_hold(100, 10), 0.0, _no_limits, [], _counters())
    assert taken is not None and wired.landed == []
    flush_all(timeout=0, retry=False)
    assert [(s.hold_id, s.event) for s in wired.landed] == [(taken.advance_id, "close")]
    assert wired.advances.draw(_hold(100, 10), 0.0) is None  # none open any more
