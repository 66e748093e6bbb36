"""The guard keys every call by the model it is (quotawrap.core.identity), over a real SQLite ledger."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.core.identity import UNMAPPED
from quotawrap.core.quota import Counters, beijing_day
from quotawrap.ledger import model_day_key
from quotawrap.ledger.endpoint_ids import PROBE_WAIT_S, EndpointIds
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from quotawrap.settling.call import GuardedCall
from quotawrap.wrapper.summary import read_unguarded

BASE = "http://127.0.0.1:9/api/v3"
URL = f"{BASE}/chat/completions"
RUN = "identity-unit"
JSON = {"content-type": "application/json"}
EP_A, EP_B = "ep-20250101123456-abcde", "ep-20250202123456-fghij"
FLASH = "deepseek-v4-flash-260425"


def body(model: str, max_tokens: int = 100) -> bytes:
    request = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return json.dumps({**request, "thinking": {"type": "disabled"}}).encode()  # holds max_tokens, no more


def answer(total: int, model: str | None = FLASH) -> bytes:
    usage = {"prompt_tokens": 10, "completion_tokens": total - 10, "total_tokens": total}
    return json.dumps({"model": model, "choices": [{"message": {"content": "ok"}}], "usage": usage}).encode()


def respond(call: GuardedCall, payload: bytes, status: int = 200) -> None:
    call.response_started(status, JSON)
    call.feed(payload)
    call.finish()


@pytest.fixture
def ledger(tmp_path: Path) -> SQLiteLedger:
    return SQLiteLedger(tmp_path / "ledger.sqlite3")


@pytest.fixture
def make_guard(ledger: SQLiteLedger) -> Callable[..., Guard]:
    def make(configured: Mapping[str, str] | None = None, **changes: Any) -> Guard:
        guard = Guard(Settings(**{"base_url": (BASE,), "run_id": RUN, "wait": 0, **changes}), ledger)
        guard.endpoint_ids = EndpointIds(lambda: guard.ledger, lambda: dict(configured or {}))
        return guard

    return make


def md(ledger: SQLiteLedger, model: str) -> Counters:
    key = model_day_key(model, beijing_day(time.time()))
    return ledger.counters([key])[key]


def begin(guard: Guard, model: str, max_tokens: int = 100) -> GuardedCall:
    call = guard.begin("POST", URL, JSON, body(model, max_tokens))
    assert call is not None
    return call


class TestSpellings:
    def test_spellings_of_a_model_are_held_and_settled_as_it(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """Case and whitespace around the model string do not make another model-day, nor another report row."""
        guard = make_guard()
        for spelling in ("DeepSeek-V4-Flash-260425", f" {FLASH}\n", FLASH):
            respond(begin(guard, spelling), answer(50))
        assert md(ledger, FLASH) == Counters(150, 0)
        assert set(ledger.run_totals(RUN).models) == {FLASH}


class TestMappedEndpoints:
    def test_a_configured_endpoint_is_its_model_from_its_first_call(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """An endpoint in [endpoints] is held as its model, priced as its model, and counted in its day."""
        guard = make_guard({EP_A: FLASH})
        call = begin(guard, EP_A)
        assert call.model == FLASH and md(ledger, FLASH).in_flight > 100 and md(ledger, UNMAPPED) == Counters()
        respond(call, answer(60))
        assert md(ledger, FLASH) == Counters(60, 0)
        record = ledger.call_records()[0]
        assert record.model == FLASH and record.charged_cost == guard.books.actual_cost(FLASH, _usage(60))

    def test_an_endpoint_moved_to_another_version_lands_where_ark_billed_it(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """A mapped endpoint answered by another model: the call settles on the model that answered, and the
        endpoint is that model from then on, here and in the ledger."""
        guard = make_guard({EP_A: FLASH})
        newer = "deepseek-v4-flash-260731"
        respond(begin(guard, EP_A), answer(70, newer))
        assert md(ledger, newer) == Counters(70, 0) and md(ledger, FLASH) == Counters(0, 0)
        assert ledger.endpoint_models() == {EP_A: newer}
        assert begin(guard, EP_A).model == newer


class TestUnmappedEndpoints:
    def test_its_first_answer_maps_it_and_moves_the_call_to_its_model(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """An endpoint nobody mapped is held as UNMAPPED (against every model's day) until its answer names the
        model: the call is then settled on that model, and the pair is in the ledger for every process."""
        guard = make_guard(daily_cap=10_000)
        call = begin(guard, EP_A)
        held = md(ledger, UNMAPPED).in_flight
        assert call.model == UNMAPPED and held > 100
        respond(call, answer(80))
        assert md(ledger, UNMAPPED) == Counters(0, 0) and md(ledger, FLASH) == Counters(80, 0)
        assert ledger.endpoint_models() == {EP_A: FLASH}
        totals = ledger.run_totals(RUN).models
        assert totals[FLASH].calls == 1 and totals[FLASH].settled_tokens == 80
        assert UNMAPPED not in totals or totals[UNMAPPED].calls == 0  # handed over: no call of its own
        fresh = make_guard()  # another process: the ledger's pair
        assert begin(fresh, EP_A).model == FLASH

    def test_it_is_refused_when_a_model_has_no_room_for_it(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """Any model may be the endpoint's: a model whose day has no room for the call refuses it (429 naming the
        model and how to map the endpoint), and it leaves a refused call's row and nothing held."""
        guard = make_guard(daily_cap=1_000, usage_wall=1_000)
        respond(begin(guard, FLASH, max_tokens=900), answer(990))
        call = begin(guard, EP_A, max_tokens=100)
        assert call.blocked is not None and call.blocked.status == 429
        message = json.loads(call.blocked.body)["error"]["message"]
        assert f"call to {FLASH} would exceed the daily_cap" in message and "[endpoints]" in message
        assert md(ledger, UNMAPPED) == Counters(0, 0)
        totals = ledger.run_totals(RUN).models
        assert totals[UNMAPPED].blocked_calls == 1 and totals[UNMAPPED].calls == 0
        # the model that has room is not in the way once the full one is out of --model's reach
        filtered = make_guard(daily_cap=1_000, usage_wall=1_000, model=("doubao",))
        assert begin(filtered, EP_B, max_tokens=100).blocked is None

    def test_it_waits_while_only_calls_in_flight_are_in_the_way(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """A model's calls in flight leave no room for it now, but will: it keeps its hold (its place) and goes out
        once they settle, within --wait; the model's own new calls count it meanwhile."""
        guard = make_guard(daily_cap=1_000, usage_wall=1_000, wait=60)
        flash = begin(guard, FLASH, max_tokens=850)  # with its input and the call below: past 1,000
        steps = guard.admission("POST", URL, JSON, body(EP_A, max_tokens=150))
        assert isinstance(next(steps), float)  # waits, holding
        assert md(ledger, UNMAPPED).in_flight > 150
        respond(flash, answer(100))
        with pytest.raises(StopIteration) as done:
            while True:
                next(steps)
        waited = done.value.value
        assert isinstance(waited, GuardedCall) and waited.blocked is None and waited.model == UNMAPPED
        respond(waited, answer(120))
        assert md(ledger, FLASH) == Counters(220, 0) and md(ledger, UNMAPPED) == Counters(0, 0)

    def test_an_answer_that_names_no_model_stays_against_every_model(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """Whose tokens they were is never told: they are charged as UNMAPPED, which every model's day counts."""
        guard = make_guard(daily_cap=1_000, usage_wall=1_000)
        respond(begin(guard, EP_A), answer(300, model=None))
        assert md(ledger, UNMAPPED) == Counters(300, 0) and ledger.endpoint_models() == {}
        assert begin(guard, FLASH, max_tokens=700).blocked is not None  # 300 + its input + 700 > 1,000
        assert begin(guard, FLASH, max_tokens=600).blocked is None

    def test_a_second_call_waits_for_the_first_answer(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """In one process, only the first call to an unmapped endpoint goes out; the next waits for its answer
        and goes as the model it names."""
        guard = make_guard()
        first = begin(guard, EP_A)
        steps = guard.admission("POST", URL, JSON, body(EP_A))
        assert isinstance(next(steps), float)  # a pause: waiting
        respond(first, answer(40))
        with pytest.raises(StopIteration) as done:
            while True:
                next(steps)
        second = done.value.value
        assert isinstance(second, GuardedCall) and second.model == FLASH and second.blocked is None

    def test_a_call_of_another_process_waits_for_the_first_answer_too(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """The first call out to an unmapped endpoint holds the ledger's lease: a call of another process (or
        host) waits for its answer rather than going out unmapped too."""
        first = begin(make_guard(), EP_A)
        steps = make_guard().admission("POST", URL, JSON, body(EP_A))  # another process's guard
        assert isinstance(next(steps), float)
        respond(first, answer(40))
        with pytest.raises(StopIteration) as done:
            while True:
                next(steps)
        assert done.value.value.model == FLASH and md(ledger, UNMAPPED) == Counters(0, 0)

    def test_a_first_call_refused_lets_the_next_go(self, make_guard: Callable[..., Guard]) -> None:
        """A refused first call is no call out: the next one to the endpoint is not kept waiting."""
        guard = make_guard(cap_tokens=10)
        assert begin(guard, EP_A).blocked is not None
        assert guard.endpoint_ids.probe(EP_A)


class TestModelFilter:
    def test_the_filter_matches_the_model_an_endpoint_is(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger, tmp_path: Path, capsys: Any
    ) -> None:
        """--model deepseek-v4 guards an endpoint mapped to deepseek-v4-*; one mapped elsewhere goes out
        unguarded, said once on stderr and recorded per model for the summary."""
        log = tmp_path / "unguarded.jsonl"
        guard = make_guard(
            {EP_A: FLASH, EP_B: "doubao-seed-1-6-250615"}, model=("DeepSeek-V4",), unguarded_log=str(log)
        )
        assert begin(guard, EP_A).model == FLASH
        for _ in range(3):
            assert guard.begin("POST", URL, JSON, body(EP_B)) is None
        assert read_unguarded(log, "model-filter") == {"doubao-seed-1-6-250615": 3}
        assert read_unguarded(log) == {}  # none of them was --fail-open's
        warned = capsys.readouterr().err
        assert warned.count("does not name doubao-seed-1-6-250615: its calls go out UNGUARDED") == 1


def test_a_probe_out_too_long_lets_the_next_go(ledger: SQLiteLedger) -> None:
    """A first call whose answer is never read keeps no one waiting past PROBE_WAIT_S, in its process or another;
    its end then lets go of nothing but its own lease."""
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    mine = EndpointIds(lambda: ledger, lambda: {}, clock=clock, wall=clock)
    theirs = EndpointIds(lambda: ledger, lambda: {}, clock=clock, wall=clock)
    first = mine.probe(EP_A)
    assert first is not None and mine.probe(EP_A) is None and theirs.probe(EP_A) is None
    assert mine.probe(EP_B) is not None  # another endpoint is another lease
    now[0] += PROBE_WAIT_S
    second = theirs.probe(EP_A)
    assert second is not None and mine.probe(EP_A) is None
    mine.probed(EP_A, first)  # the stale one ends: the lease stays the second's
    assert mine.probe(EP_A) is None
    theirs.probed(EP_A, second)
    assert mine.probe(EP_A) is not None


def _usage(total: int) -> Any:
    from quotawrap.core.usage import Usage

    return Usage(prompt_tokens=10, completion_tokens=total - 10, total_tokens=total)
