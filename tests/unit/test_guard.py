"""Guard's policy on its own, over a real SQLite ledger: hold, block, settle, release, charge, fail open."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.ledger import run_key
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from quotawrap.settling.call import GuardedCall
from quotawrap.support.events import read_events
from tests.redis_server import free_port

BASE = "http://127.0.0.1:9/api/v3"
URL = f"{BASE}/chat/completions"
RUN = "guard-unit"
JSON = {"content-type": "application/json"}


def body(model: str = "deepseek-v4-flash", max_tokens: int | None = 100) -> bytes:
    """A chat request; ``max_tokens=None``: one that sets no output bound (the guard adds its own)."""
    request: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    return json.dumps(request).encode()


def answer(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return json.dumps({"choices": [{"message": {"content": "ok"}}], "usage": usage}).encode()


def respond(call: GuardedCall, status: int, payload: bytes) -> None:
    """What an adapter does with a whole body: start, feed, finish."""
    call.response_started(status, JSON)
    call.feed(payload)
    call.finish()


@pytest.fixture
def ledger(tmp_path: Path) -> SQLiteLedger:
    return SQLiteLedger(tmp_path / "ledger.sqlite3")


@pytest.fixture
def make_guard(ledger: SQLiteLedger) -> Callable[..., Guard]:
    def make(**changes: Any) -> Guard:
        return Guard(Settings(**{"base_url": (BASE,), "run_id": RUN, **changes}), ledger)

    return make


def in_flight(ledger: SQLiteLedger) -> int:
    return ledger.counters([run_key(RUN)])[run_key(RUN)].in_flight


class TestNotOurs:
    def test_other_hosts_and_unmatched_models_pass_untouched(self, make_guard: Callable[..., Guard]) -> None:
        """A URL that is not guarded, or a model outside --model, gets None: sent as it is, nothing held."""
        guard = make_guard(model=("doubao-*",))
        assert guard.begin("POST", "http://example.com/v1/chat/completions", JSON, body()) is None
        assert guard.begin("POST", URL, JSON, body("deepseek-v4-flash")) is None
        assert guard.ledger.run_totals(RUN).totals.calls == 0


class TestLifecycle:
    def test_a_call_is_held_then_settled_at_its_usage(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """begin holds the pessimistic reserve; a 200 with usage settles exactly that usage."""
        guard = make_guard()
        call = guard.begin("POST", URL, JSON, body())
        assert call is not None and call.blocked is None
        assert in_flight(ledger) > 100  # input estimate + the 100-token allowance
        respond(call, 200, answer(12, 30))
        totals = ledger.run_totals(RUN).totals
        assert (totals.calls, totals.settled_tokens, in_flight(ledger)) == (1, 42, 0)
        assert totals.settled_cost > 0

    def test_a_call_over_the_run_cap_is_blocked_and_recorded(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """Over --cap-tokens: a 429 naming run_cap and how to raise it; recorded as blocked, nothing held."""
        guard = make_guard(cap_tokens=50)
        call = guard.begin("POST", URL, JSON, body(max_tokens=100))
        assert call is not None and call.blocked is not None
        assert call.blocked.status == 429
        message = json.loads(call.blocked.body)["error"]["message"]
        assert "run_cap" in message and "--cap-tokens" in message
        totals = ledger.run_totals(RUN).totals
        assert (totals.blocked_calls, totals.settled_tokens, in_flight(ledger)) == (1, 0, 0)

    def test_watch_holds_what_it_would_have_blocked(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """--watch: the same over-cap call is held and sent, and counted as would-block."""
        call = make_guard(cap_tokens=50, watch=True).begin("POST", URL, JSON, body(max_tokens=100))
        assert call is not None and call.blocked is None
        respond(call, 200, answer(5, 5))
        totals = ledger.run_totals(RUN).totals
        assert (totals.would_block_calls, totals.settled_tokens) == (1, 10)

    def test_a_provider_error_releases_the_hold(self, make_guard: Callable[..., Guard], ledger: SQLiteLedger) -> None:
        """A 400 with an error body was not billed: the hold is released, nothing charged."""
        call = make_guard().begin("POST", URL, JSON, body())
        assert call is not None
        respond(call, 400, json.dumps({"error": {"code": "InvalidParameter", "message": "no"}}).encode())
        totals = ledger.run_totals(RUN).totals
        assert (totals.released_calls, totals.settled_tokens, in_flight(ledger)) == (1, 0, 0)

    def test_an_answer_without_usage_is_charged_its_hold(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """A 200 that says nothing of usage is charged the whole reserve, as unresolved."""
        call = make_guard().begin("POST", URL, JSON, body())
        assert call is not None
        reserved = in_flight(ledger)
        respond(call, 200, b'{"choices": []}')
        totals = ledger.run_totals(RUN).totals
        assert (totals.unresolved_calls, totals.settled_tokens, in_flight(ledger)) == (1, reserved, 0)

    def test_a_request_that_failed_before_sending_is_released(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """A connection error before the request left: released; after it left: charged (outcome unknown)."""
        guard = make_guard()
        unsent = guard.begin("POST", URL, JSON, body())
        sent = guard.begin("POST", URL, JSON, body())
        assert unsent is not None and sent is not None
        reserved = in_flight(ledger) // 2
        unsent.failed(ConnectionError("refused"), sent=False)
        sent.failed(TimeoutError("read"), sent=True)
        totals = ledger.run_totals(RUN).totals
        assert (totals.released_calls, totals.unresolved_calls, totals.settled_tokens) == (1, 1, reserved)

    @pytest.mark.parametrize("background_settle", [False, True], ids=["settled-at-once", "settler-no-wrapper"])
    def test_a_bounded_call_records_its_bound_event_when_it_ends(
        self, ledger: SQLiteLedger, tmp_path: Path, background_settle: bool
    ) -> None:
        """No wrapper to hand it to: the guard writes the event itself, once per bounded call however it ends
        (settled, failed), with this process's pid, how the bound was set (added to a request with none, or in
        place of its max_tokens) and whether it cut the call short; a call that bounded itself has none."""
        log = tmp_path / "events.jsonl"
        settings = Settings(base_url=(BASE,), run_id=RUN, events_log=str(log), reasoning_reserve="cut")
        guard = Guard(settings, ledger, background_settle=background_settle)
        settled, failed = guard.begin("POST", URL, JSON, body(max_tokens=None)), guard.begin("POST", URL, JSON, body())
        assert settled is not None and failed is not None
        assert read_events(log).bounded_calls == 0  # recorded when the call ends, with its settle
        respond(settled, 200, answer(12, 8_192))  # stopped at the bound the guard added (cold: 4,096 + floor)
        failed.failed(ConnectionError("refused"), sent=False)
        own = guard.begin("POST", URL, JSON, bounded(64))
        assert own is not None
        respond(own, 200, answer(12, 30))
        events = read_events(log)
        assert (events.bounded_calls, events.bounded_by_model) == (2, {"deepseek-v4-flash": 2})
        assert (events.bounds, events.cut) == ({"added": 1, "replaced": 1}, {"added": 1})
        assert {json.loads(line)["pid"] for line in log.read_text().splitlines()} == {os.getpid()}
        assert guard.flush(5)


class TestFaultsAndPolicies:
    def store_down(self, tmp_path: Path) -> str:
        """A store that cannot be created: its directory is a regular file."""
        (tmp_path / "not-a-dir").write_text("x")
        return f"sqlite:///{tmp_path / 'not-a-dir' / 'ledger.sqlite3'}"

    def test_a_store_fault_refuses_with_503(self, tmp_path: Path) -> None:
        """The ledger cannot be opened: 503 naming the store and --fail-open; nothing is sent."""
        guard = Guard(Settings(base_url=(BASE,), run_id=RUN, store=self.store_down(tmp_path)))
        call = guard.begin("POST", URL, JSON, body())
        assert call is not None and call.blocked is not None and call.blocked.status == 503
        assert "--fail-open" in json.loads(call.blocked.body)["error"]["message"]

    def test_fail_open_lets_a_store_fault_through_and_records_it(self, tmp_path: Path) -> None:
        """--fail-open: the call goes out (None) and the unguarded log gets one line naming model and error."""
        log = tmp_path / "unguarded.jsonl"
        settings = Settings(
            base_url=(BASE,), run_id=RUN, store=self.store_down(tmp_path), fail_open=True, unguarded_log=str(log)
        )
        assert Guard(settings).begin("POST", URL, JSON, body()) is None
        (record,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert (record["run_id"], record["model"]) == (RUN, "deepseek-v4-flash") and "ledger" in record["error"]

    @pytest.mark.parametrize("fail_open", [False, True])
    def test_a_policy_refusal_is_400_even_under_fail_open(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger, tmp_path: Path, fail_open: bool
    ) -> None:
        """--unknown-price error on an unpriced model: 400 naming the policy, never 503, never sent."""
        log = tmp_path / "unguarded.jsonl"
        guard = make_guard(unknown_price="error", fail_open=fail_open, unguarded_log=str(log))
        call = guard.begin("POST", URL, JSON, body("house-unpriced"))
        assert call is not None and call.blocked is not None
        message = json.loads(call.blocked.body)["error"]["message"]
        assert call.blocked.status == 400 and "--unknown-price" in message and "ledger" not in message
        assert not log.exists() and in_flight(ledger) == 0

    @pytest.mark.parametrize(
        "store", ["redis://127.0.0.1:{port}/0?password=topsecret", "redis://:topsecret@127.0.0.1:{port}/0"]
    )
    def test_the_503_never_shows_the_store_password(self, store: str) -> None:
        """A Redis store that is down: the 503 the program reads names the store with its password hidden."""
        guard = Guard(Settings(base_url=(BASE,), run_id=RUN, store=store.format(port=free_port())))
        call = guard.begin("POST", URL, JSON, body())
        assert call is not None and call.blocked is not None and call.blocked.status == 503
        message = json.loads(call.blocked.body)["error"]["message"]
        assert "topsecret" not in message and "***" in message


def bounded(output: int) -> bytes:
    """A request whose whole output is bounded (max_completion_tokens): it reserves exactly input + that."""
    request = {"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({**request, "max_completion_tokens": output}).encode()


class TestWaitingInLine:
    """The guard's wait (admission/call.py) keeps a place in the ledger's line and gives it back however it ends."""

    def test_a_waiting_call_holds_a_place_and_leaves_it_when_cancelled(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        first = make_guard(cap_tokens=1_000).begin("POST", URL, JSON, bounded(800))
        assert first is not None and first.blocked is None
        waiter = make_guard(cap_tokens=1_000)
        steps = waiter.admission("POST", URL, JSON, bounded(500))
        pause = next(steps)  # it does not fit while the first call is in flight: it waits in line
        assert pause > 0 and ledger.waiting(waiter.clock()) == {"deepseek-v4-flash": 1}
        small = make_guard(cap_tokens=1_000, wait=0).begin("POST", URL, JSON, bounded(50))
        assert small is not None and small.blocked is not None  # it would fit, but must not pass the waiter
        assert b"wait for room before it" in small.blocked.body
        steps.close()  # a cancelled task, an exception in the caller: the place is given back at once
        assert ledger.waiting(waiter.clock()) == {}
        after = make_guard(cap_tokens=1_000, wait=0).begin("POST", URL, JSON, bounded(50))
        assert after is not None and after.blocked is None

    def test_the_waiter_is_admitted_when_room_frees_and_leaves_no_refused_row(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        first = make_guard(cap_tokens=1_000).begin("POST", URL, JSON, bounded(800))
        assert first is not None
        steps = make_guard(cap_tokens=1_000).admission("POST", URL, JSON, bounded(500))
        next(steps)
        respond(first, 200, answer(10, 10))
        admitted = None
        try:
            while True:
                steps.send(None)
        except StopIteration as done:
            admitted = done.value
        assert admitted is not None and admitted.blocked is None
        assert ledger.waiting(0.0) == {}
        totals = ledger.run_totals(RUN).totals
        assert (totals.calls, totals.blocked_calls) == (2, 0)


class TestRefittedAttempt:
    def test_a_refitted_attempt_is_no_blocked_call_in_the_report(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """A call whose bound was fitted to counters another process has since outgrown is refused once, refitted
        and admitted: `quotawrap report` counts no blocked call, as the run summary does (one rule for both)."""
        from quotawrap.books.report import aggregate

        mine = make_guard(cap_tokens=9_000, wait=0)
        first = mine.begin("POST", URL, JSON, body(max_tokens=None))
        assert first is not None and first.blocked is None
        respond(first, 200, answer(10, 10))  # this guard has seen the run's counters: nearly all room free
        other = make_guard(cap_tokens=9_000, wait=0).begin("POST", URL, JSON, body(max_tokens=None))
        assert other is not None and other.blocked is None
        respond(other, 200, answer(10, 4_990))  # another process settles most of the room meanwhile
        refitted = mine.begin("POST", URL, JSON, body(max_tokens=None))
        assert refitted is not None and refitted.blocked is None
        records = ledger.call_records(run_id=RUN)
        assert [r.state for r in records].count("blocked") == 1  # the attempt fitted to the old counters
        [row] = aggregate(records)
        assert (row["calls"], row["blocked_calls"]) == (3, 0)
        assert (row["bounded_calls"], row["replaced_max_tokens_calls"]) == (3, 0)  # the refit kept its mark

    def test_a_reserve_the_cap_can_no_longer_hold_is_sent_cut_rather_than_refused(
        self, make_guard: Callable[..., Guard], ledger: SQLiteLedger
    ) -> None:
        """A max_tokens call planned at max_tokens + the reasoning ceiling from counters another process has
        since outgrown: refused once, then, planned again, sent with its max_tokens as max_completion_tokens
        (the cap can never hold the ceiling now) instead of refused for good."""
        model = "doubao-seed-1-6-251015"  # reasoning ceiling 32,768
        mine = make_guard(cap_tokens=40_000, wait=0)
        first = mine.begin("POST", URL, JSON, body(model, max_tokens=64))
        assert first is not None and first.blocked is None and first.new_body is None  # 64 + 32,768 fits
        respond(first, 200, answer(10, 10))
        other = make_guard(cap_tokens=40_000, wait=0).begin("POST", URL, JSON, body(model, max_tokens=None))
        assert other is not None and other.blocked is None
        respond(other, 200, answer(10, 8_000))  # another process settles a fifth of the cap meanwhile
        late = mine.begin("POST", URL, JSON, body(model, max_tokens=64))
        assert late is not None and late.blocked is None
        assert late.new_body is not None
        sent = json.loads(late.new_body)
        assert "max_tokens" not in sent and sent["max_completion_tokens"] == 64
        records = ledger.call_records(run_id=RUN)
        assert [r.state for r in records].count("blocked") == 1  # the attempt planned from the old counters


class TestSpeedSwitches:
    """Each speed piece of a guarded child has a setting that takes it out (for measuring it against its
    removal, docs/benchmarks.md "Scale"); on, the default, the child under a wrapper has them all. Advances,
    their draw notes and the relay to the wrapper are one piece with one switch."""

    @pytest.mark.parametrize(
        ("setting", "settler", "relay", "advances"),
        [
            ({}, True, True, True),
            ({"QUOTAWRAP_ADVANCES": "0"}, True, False, False),  # the relay goes with the advances it carries
            ({"QUOTAWRAP_BACKGROUND_SETTLE": "0"}, False, False, False),  # the relay is the settler's way out
            ({"QUOTAWRAP_WATCH": "1"}, True, False, False),  # --watch reserves nothing ahead
        ],
        ids=["all-on", "no-advances", "no-background-settle", "watch"],
    )
    def test_a_switch_set_off_takes_its_piece_out(
        self,
        ledger: SQLiteLedger,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        setting: dict[str, str],
        settler: bool,
        relay: bool,
        advances: bool,
    ) -> None:
        from quotawrap.support.files import SOCKET_VARIABLE

        monkeypatch.setenv(SOCKET_VARIABLE, str(tmp_path / "settle.sock"))  # a guarded child under a wrapper
        guard = Guard(Settings.from_env({"QUOTAWRAP_RUN_ID": RUN, **setting}), ledger, background_settle=True)
        assert (guard.settler is not None) is settler
        assert (guard.settler is not None and guard.settler.relay is not None) is relay
        assert (guard.advances is not None) is advances
        assert guard.flush(5)
