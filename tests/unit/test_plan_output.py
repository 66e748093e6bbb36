"""What the guard sends and reserves, per request shape: never both output bounds, never more than the caller asked.

Ark refuses ``max_tokens`` beside ``max_completion_tokens`` (400 InvalidParameter, HKUDS/nanobot#2548); with
``max_tokens`` alone it bounds the answer and reasoning runs to the model's own ceiling (docs/82379/1449737).
The table runs real requests through ``Guard.begin`` over a real SQLite ledger and reads what would go out and
what the ledger holds; the generated cases hold ``admission.plan_output`` to the rules over every shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotawrap.admission.guard import Guard
from quotawrap.admission.room import plan_output
from quotawrap.config.settings import Settings
from quotawrap.core.estimate import MAX_OUTPUT_TOKENS, Estimate, EstimateSettings, unbounded_thinking
from quotawrap.core.model_limits import UNKNOWN_REASONING_CEILING, reasoning_ceiling
from quotawrap.core.output_bound import ADDED, REPLACED, read_bound_mark
from quotawrap.ledger import run_key
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from quotawrap.simulator import SimConfig
from quotawrap.simulator._contract import ArkError, check_chat

BASE = "http://127.0.0.1:9/api/v3"
RUN = "plan-output"
JSON = {"content-type": "application/json"}
SEED = "doubao-seed-1-6-251015"  # reasoning ceiling 32k (its model page)
UNKNOWN = "deepseek-v4-flash"  # not in the table: the largest documented ceiling
CEILING = 32_768
OFF = {"thinking": {"type": "disabled"}}


def _request(kind: str, model: str, extra: dict[str, Any]) -> dict[str, Any]:
    if kind == "responses":
        return {"model": model, "input": "how many colours has a rainbow?", **extra}
    return {"model": model, "messages": [{"role": "user", "content": "how many colours has a rainbow?"}], **extra}


def _sent(guard: Guard, ledger: SQLiteLedger, path: str, request: dict[str, Any]) -> tuple[dict[str, Any], int, str]:
    """What goes out for ``request``, what the ledger holds for it, and the hold's id; the hold is then released."""
    call = guard.begin("POST", f"{BASE}{path}", JSON, json.dumps(request).encode())
    assert call is not None and call.blocked is None, call and call.blocked
    body = json.loads(call.new_body) if call.new_body is not None else request
    held = ledger.counters([run_key(RUN)])[run_key(RUN)].in_flight
    hold_id = str(call.hold_id)
    call.failed(OSError("never sent"), sent=False)
    return body, held, hold_id


# (endpoint path, model, request fields, settings) -> (what the body gains/loses, output reserved)
_CHAT = "/chat/completions"
TABLE: list[tuple[str, str, str, dict[str, Any], dict[str, Any], dict[str, Any], int]] = [
    # id, path, model, request, settings, body changes (None value: the field goes), output reserved
    ("mct-set", _CHAT, SEED, {"max_completion_tokens": 500}, {}, {}, 500),
    ("mct-set-n2", _CHAT, SEED, {"max_completion_tokens": 500, "n": 2}, {}, {}, 1_000),
    ("caller-sends-both", _CHAT, SEED, {"max_completion_tokens": 500, "max_tokens": 64}, {}, {}, 500),
    ("thinking-off-max-tokens", _CHAT, SEED, {**OFF, "max_tokens": 100}, {}, {}, 100),
    ("thinking-off-default", _CHAT, SEED, OFF, {}, {}, 4_096),
    ("nothing-cold", _CHAT, SEED, {}, {}, {"max_completion_tokens": 8_192}, 8_192),
    ("thinking-on-cold", _CHAT, SEED, {"thinking": {"type": "enabled"}}, {}, {"max_completion_tokens": 8_192}, 8_192),
    ("thinking-auto-cold", _CHAT, SEED, {"thinking": {"type": "auto"}}, {}, {"max_completion_tokens": 8_192}, 8_192),
    ("max-tokens-ceiling", _CHAT, SEED, {"max_tokens": 64}, {}, {}, 64 + CEILING),
    ("max-tokens-ceiling-n2", _CHAT, SEED, {"max_tokens": 64, "n": 2}, {}, {}, 2 * (64 + CEILING)),
    ("max-tokens-unknown-model", _CHAT, UNKNOWN, {"max_tokens": 64}, {}, {}, 64 + UNKNOWN_REASONING_CEILING),
    ("max-tokens-learned-cold", _CHAT, SEED, {"max_tokens": 64}, {"reasoning_reserve": "learned"}, {}, 64 + 4_096),
    (
        "max-tokens-cut",
        _CHAT,
        SEED,
        {"max_tokens": 64},
        {"reasoning_reserve": "cut"},
        {"max_tokens": None, "max_completion_tokens": 64},
        64,
    ),
    (
        "max-tokens-cut-past-arks-range",
        _CHAT,
        SEED,
        {"max_tokens": 100_000},
        {"reasoning_reserve": "cut"},
        {"max_tokens": None, "max_completion_tokens": MAX_OUTPUT_TOKENS},
        MAX_OUTPUT_TOKENS,
    ),
    (
        "max-tokens-ceiling-never-fits",
        _CHAT,
        SEED,
        {"max_tokens": 64},
        {"cap_tokens": 20_000},
        {"max_tokens": None, "max_completion_tokens": 64},
        64,
    ),
    ("responses-nothing", "/responses", SEED, {}, {}, {"max_output_tokens": 8_192}, 8_192),
    ("responses-bounded", "/responses", SEED, {"max_output_tokens": 300}, {}, {}, 300),
    ("no-bound-max-tokens", _CHAT, SEED, {"max_tokens": 64}, {"bound": False}, {}, 64 + CEILING),
    ("no-bound-nothing", _CHAT, SEED, {}, {"bound": False}, {}, 4_096 + CEILING),
    ("watch-max-tokens", _CHAT, SEED, {"max_tokens": 64}, {"watch": True}, {}, 64 + CEILING),
    ("watch-nothing", _CHAT, SEED, {}, {"watch": True}, {}, 4_096 + CEILING),
    ("bot-nothing", "/bots/chat/completions", "bot-2025", {}, {}, {"max_completion_tokens": 8_192}, 8_192),
    (
        "bot-max-tokens-cut",
        "/bots/chat/completions",
        "bot-2025",
        {"max_tokens": 64},
        {"reasoning_reserve": "cut"},
        {"max_tokens": None, "max_completion_tokens": 64},
        64,
    ),
    ("batch-max-tokens", "/batch/chat/completions", SEED, {"max_tokens": 64}, {}, {}, 64 + CEILING),
    ("batch-nothing", "/batch/chat/completions", SEED, {}, {}, {"max_completion_tokens": 8_192}, 8_192),
    ("context-max-tokens", "/context/chat/completions", SEED, {"max_tokens": 64}, {}, {}, 64 + CEILING),
    (
        "context-max-tokens-cut",
        "/context/chat/completions",
        SEED,
        {"max_tokens": 64},
        {"reasoning_reserve": "cut"},
        {"max_tokens": None, "max_completion_tokens": 64},
        64,
    ),
]


@pytest.fixture
def ledger(tmp_path: Path) -> SQLiteLedger:
    return SQLiteLedger(tmp_path / "ledger.sqlite3")


class TestWhatTheGuardSends:
    @pytest.mark.parametrize(
        ("path", "model", "fields", "changes", "body_changes", "output"),
        [t[1:] for t in TABLE],
        ids=[t[0] for t in TABLE],
    )
    def test_table(
        self,
        ledger: SQLiteLedger,
        path: str,
        model: str,
        fields: dict[str, Any],
        changes: dict[str, Any],
        body_changes: dict[str, Any],
        output: int,
    ) -> None:
        """Per shape: the body that goes out (unchanged unless the table says) and input + output held."""
        guard = Guard(Settings(**{"base_url": (BASE,), "run_id": RUN, **changes}), ledger)
        kind = "responses" if path == "/responses" else "chat"
        request = _request(kind, model, fields)
        body, held, hold_id = _sent(guard, ledger, path, request)
        expected = {key: value for key, value in {**request, **body_changes}.items() if value is not None}
        assert body == expected
        assert not ("max_tokens" in body and "max_completion_tokens" in body) or body == request
        assert held == guard.estimate(kind, request).input_tokens + output
        mark = read_bound_mark(hold_id)  # the ledger's record says what the guard did
        if body == request:
            assert mark is None
        else:
            field = "max_output_tokens" if kind == "responses" else "max_completion_tokens"
            assert mark == (REPLACED if "max_tokens" in request else ADDED, body[field])

    def test_a_learned_model_is_bounded_at_the_default_answer_plus_its_p99(self, ledger: SQLiteLedger) -> None:
        """After settled calls the added bound is 4,096 + their p99 reasoning, and learned max_tokens calls
        reserve M + that p99."""
        from quotawrap.core.usage import Usage
        from tests.conftest import hold_request

        decision = ledger.reserve(hold_request(SEED, reserve=100_000), lambda _snapshot: [])
        ledger.settle(decision.hold_id, Usage(10, 6_100, 6_110, reasoning_tokens=6_000))
        guard = Guard(Settings(base_url=(BASE,), run_id=RUN, reasoning_reserve="learned"), ledger)
        body, _, _ = _sent(guard, ledger, _CHAT, _request("chat", SEED, {}))
        assert body["max_completion_tokens"] == 4_096 + 6_000
        request = _request("chat", SEED, {"max_tokens": 64})
        body, held, _ = _sent(guard, ledger, _CHAT, request)
        assert body == request and held == guard.estimate("chat", request).input_tokens + 64 + 6_000


_SETTINGS = EstimateSettings()


@st.composite
def _shapes(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["chat", "responses"]))
    request: dict[str, Any] = {"model": "m"}
    for name, values in (
        ("max_tokens" if kind == "chat" else "n", st.one_of(st.none(), st.integers(0, 300_000))),
        ("max_completion_tokens" if kind == "chat" else "max_output_tokens", st.integers(0, MAX_OUTPUT_TOKENS)),
        ("thinking", st.sampled_from([{"type": "enabled"}, {"type": "disabled"}, {"type": "auto"}])),
        ("n", st.integers(1, 4)),
    ):
        if kind == "responses" and name == "n":
            continue  # the Responses API has neither max_tokens nor n
        if draw(st.booleans()):
            request[name] = draw(values)
    return kind, request


@settings(max_examples=600)
@given(
    shape=_shapes(),
    boundable=st.booleans(),
    policy=st.sampled_from(["ceiling", "learned", "cut"]),
    ceiling=st.sampled_from([0, 1_000, 32_768, 65_536, 262_144]),
    reasoning=st.one_of(st.none(), st.integers(0, 400_000)),
    space=st.one_of(st.none(), st.integers(0, 3_000_000)),
    cap=st.one_of(st.none(), st.integers(0, 3_000_000)),
    input_tokens=st.integers(0, 50_000),
)
def test_no_planned_body_sends_both_bounds_or_asks_for_more(
    shape: tuple[str, dict[str, Any]],
    boundable: bool,
    policy: Any,
    ceiling: int,
    reasoning: int | None,
    space: int | None,
    cap: int | None,
    input_tokens: int,
) -> None:
    """Over every shape, policy, history and room: what goes out (``Admission.plan``'s gate, then ``plan_output``)
    never holds both bounds unless the caller sent both; a caller's max_tokens is never lengthened (a bound sent
    in its place is at most it); a bound the guard adds is within Ark's range and below the request's own worst
    case; and the hold covers the most the sent body can bill, save the ``learned`` policy's known overshoot."""
    kind, request = shape
    caller = dict(request)
    if not unbounded_thinking(kind, request):  # type: ignore[arg-type]  # Admission.plan's gate
        body, output, how = request, None, None
    else:
        plan = plan_output(
            kind,  # type: ignore[arg-type]
            request,
            Estimate(input_tokens, 0),
            _SETTINGS,
            boundable=boundable,
            policy=policy,
            ceiling=ceiling,
            reasoning=reasoning,
            token_space=lambda: space,
            token_cap=lambda: cap,
        )
        body, output, how = plan.body, plan.estimate.output_allowance, plan.how
        assert plan.estimate.input_tokens == input_tokens
        assert (plan.bound is None) is (how is None) is (body is request)
    assert request == caller  # the caller's request itself is never touched
    field = "max_completion_tokens" if kind == "chat" else "max_output_tokens"
    answer = request.get("max_tokens") or 0
    if body is not request:
        assert boundable
        assert "max_tokens" not in body  # never beside the bound
        assert {k: v for k, v in body.items() if k not in ("max_tokens", field)} == {
            k: v for k, v in request.items() if k not in ("max_tokens", field)
        }
        assert 1 <= body[field] <= MAX_OUTPUT_TOKENS
        if kind == "chat" and answer:
            assert how == REPLACED and body[field] == min(answer, MAX_OUTPUT_TOKENS)  # never longer
        else:
            assert how == ADDED and body[field] <= _SETTINGS.default_max_tokens + ceiling
    elif kind == "chat":
        both = "max_tokens" in request and field in request
        assert not ("max_tokens" in body and field in body) or both
    if kind == "chat" and _ark_accepts(request):  # what Ark takes from the caller it takes from the guard
        assert _ark_accepts(body), body
    if output is None:
        return
    choices = request.get("n", 1) if kind == "chat" else 1
    if body.get(field):
        billable = body[field] * choices
    else:  # max_tokens (or Ark's default) for the answer, and reasoning up to the model's ceiling
        billable = ((answer or _SETTINGS.default_max_tokens) + ceiling) * choices
    if not (boundable and policy == "learned" and answer and body is request):
        assert output >= billable


def _ark_accepts(body: dict[str, Any]) -> bool:
    """Whether the simulator's strict mode (Ark's validation rules, docs/ark-contract.md) takes this chat body."""
    try:
        check_chat(body, "deepseek-v3-2-251201", SimConfig())
    except ArkError:
        return False
    return True


def test_the_table_knows_the_models_it_names() -> None:
    """The table's models are the documented ceilings; anything else is the largest documented."""
    assert reasoning_ceiling(SEED) == CEILING
    assert reasoning_ceiling(UNKNOWN) == UNKNOWN_REASONING_CEILING == 262_144


def _answer(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return json.dumps({"choices": [{"message": {"content": "ok"}}], "usage": usage}).encode()


class TestWhatTheLedgerKeeps:
    def test_report_and_status_count_the_calls_the_guards_bound_cut_short(self, ledger: SQLiteLedger) -> None:
        """The hold id of a call the guard bounded says how and at what: `quotawrap report` (table, JSON, CSV)
        and `status` count those calls and the ones cut short there, after the run, from the ledger alone; a
        refused attempt refitted and asked again is still no blocked call."""
        from quotawrap.books.report import aggregate, render_csv, render_table
        from quotawrap.books.status import model_status, render_status

        guard = Guard(Settings(base_url=(BASE,), run_id=RUN, reasoning_reserve="cut"), ledger)
        for fields, completion in (({}, 8_192), ({}, 300), ({"max_tokens": 64}, 64), ({"max_tokens": 64}, 20)):
            call = guard.begin("POST", f"{BASE}{_CHAT}", JSON, json.dumps(_request("chat", SEED, fields)).encode())
            assert call is not None and call.blocked is None
            call.response_started(200, JSON)
            call.feed(_answer(20, completion))
            call.finish()
        own = _request("chat", SEED, {"max_completion_tokens": 100})  # bounded by the caller: not the guard's
        call = guard.begin("POST", f"{BASE}{_CHAT}", JSON, json.dumps(own).encode())
        assert call is not None
        call.response_started(200, JSON)
        call.feed(_answer(20, 100))
        call.finish()
        [row] = aggregate(ledger.call_records())
        assert (row["calls"], row["bounded_calls"], row["replaced_max_tokens_calls"], row["cut_by_bound_calls"]) == (
            5,
            4,
            2,
            2,
        )
        assert "4 call(s) sent with the guard's output bound, 2 of them cut short there" in render_table([row], "model")
        assert render_csv([row]).splitlines()[0].endswith("bounded_calls,replaced_max_tokens_calls,cut_by_bound_calls")
        [status] = model_status(ledger, guard.settings, guard.clock())
        assert (status["bounded_calls"], status["cut_by_bound_calls"]) == (4, 2)
        assert status["reasoning_ceiling"] == CEILING and status["reasoning_ceiling_known"]
        text = render_status([status])
        assert "today: 4 call(s) sent with the guard's output bound, 2 of them cut short there" in text
        assert "--reasoning-reserve cut" in text
