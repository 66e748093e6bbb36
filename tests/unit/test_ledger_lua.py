"""The Lua mirrors of the ledger's rules equal their Python originals, on generated cases.

lua/lib.lua's ``blocking`` must be ``quota.verdict`` (on limits in ``quota.ordered``'s order, budgets' scopes
among them, whose unit ``charge`` tells as ``quota.charge`` does) and
its ``never_blocking`` ``quota.never_fits``; its ``hold_step`` / ``hold_follow`` must be ``holds.step`` /
``holds.follow``, its ``line_ahead`` / ``line_crowded`` / ``line_decide`` the waiting lines' rule
of ``ledger/lines.py``, and its ``day_refused`` the Beijing day of ``quota.beijing_day``. Each check
runs the library itself through real ``EVAL`` on a private redis-server, a thousand cases per
call, against the Python functions on the same seeded cases.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from quotawrap.core.budgets import budget_scope, parse_budget
from quotawrap.core.quota import DAY_S, Counters, Limit, beijing_day, charge, never_fits, ordered, verdict
from quotawrap.ledger import holds, lines
from quotawrap.ledger.redis.client import lua_file
from quotawrap.ledger.redis.keys import day_start
from tests.redis_server import session_url

pytestmark = pytest.mark.redis

BATCH = 1000
CASES = 6000
RUN_SCOPES = ("run", "run_cost")
# Budget scopes as core.budgets.budget_scope names them: one counting tokens, one micro-CNY (issue 33).
BUDGET_SCOPES = (
    budget_scope(parse_budget("team=search:200k/day"), "2026-08-13"),
    budget_scope(parse_budget("*:cny300/month"), "2026-08"),
)
SCOPES = ("run", "model_day", "run_cost", *BUDGET_SCOPES)

# Appended to the library: ARGV[1] is a JSON list of cases; every number comes back as a decimal
# string (cjson would print 14 significant digits), a step that changes nothing as false.
_HARNESS = r"""
local out = {}
for i, c in ipairs(cjson.decode(ARGV[1])) do
  if c.check == 'verdict' then
    local limits = {}
    for j, l in ipairs(c.limits) do limits[j] = {l[1], l[2], l[3], l[4]} end
    out[i] = blocking(limits, c.run_only, c.run, c.md[1], c.md[2], c.reserve, c.reserve_cost, c.budgets)
  elseif c.check == 'step' then
    local r = {hold_step(c.state, c.event, c.reserved, c.charged, c.reserved_cost, c.charged_cost, c.usage, c.cost)}
    if r[1] == nil then
      out[i] = false
    else
      out[i] = {r[1], int(r[2]), int(r[3]), r[4], int(r[5]), int(r[6]), int(r[7]), int(r[8]), r[9]}
    end
  elseif c.check == 'never' then
    local limits = {}
    for j, l in ipairs(c.limits) do limits[j] = {l[1], l[2], l[3], l[4]} end
    out[i] = never_blocking(limits, false, c.run, c.md[1], c.reserve, c.reserve_cost, c.budgets)
  elseif c.check == 'crowded' then
    local limits = {}
    for j, l in ipairs(c.limits) do limits[j] = {l[1], l[2], l[3], l[4]} end
    out[i] = {line_crowded(limits, c.run, c.md[1], c.md[2], c.reserve, c.reserve_cost, c.budgets)}
  elseif c.check == 'charge' then
    out[i] = int(charge(c.scope, c.reserve, c.reserve_cost))
  elseif c.check == 'ahead' then
    local waiter, ticket = false, false
    if c.waiter ~= '' then waiter = c.waiter end
    if c.ticket > 0 then ticket = c.ticket end
    out[i] = line_ahead(c.entries, waiter, ticket, c.now)
  elseif c.check == 'day' then
    local refused = day_refused({day_start = c.day_start}, c.now)
    if refused == nil then out[i] = false else out[i] = refused end
  elseif c.check == 'decide' then
    out[i] = {line_decide(c.ahead_run, c.ahead_md, c.allowed, c.never, c.crowd_run, c.crowd_md, c.can_wait, c.enforce)}
  else
    local r = {hold_follow(c.state, c.reserved, c.charged, c.reserved_cost, c.charged_cost, c.target,
      c.new_charged, c.new_charged_cost)}
    if r[1] == nil then out[i] = false else out[i] = {int(r[1]), int(r[2]), int(r[3]), int(r[4])} end
  end
end
return cjson.encode(out)
"""


@pytest.fixture(scope="module")
def lua() -> Iterator[Any]:
    """Run a batch of cases through the library on a private server; returns the decoded answers."""
    import redis

    with session_url() as url:
        client = redis.Redis.from_url(url)
        script = client.register_script(lua_file("lib") + _HARNESS)

        def run(cases: Sequence[dict[str, Any]]) -> list[Any]:
            answers: list[Any] = []
            for start in range(0, len(cases), BATCH):
                answers.extend(json.loads(script(args=[json.dumps(cases[start : start + BATCH])])))
            return answers

        try:
            yield run
        finally:
            client.close()


def _amount(rng: random.Random) -> int:
    """Mostly small numbers (so caps bind often), sometimes large ones Lua must still add exactly."""
    return rng.choice((rng.randint(0, 50), rng.randint(0, 5000), rng.randint(0, 2**40)))


def _anomaly(rng: random.Random) -> int:
    """A usage or cost no real call has: at and past the bound holds.clamp keeps counters within."""
    bound = holds.MAX_CHARGE
    return rng.choice((bound, bound + 1, 2**53 + 2, 2**63 - 1, 2**63, 2**64, 10**30, -1, -(2**63)))


def _verdict_case(rng: random.Random) -> tuple[dict[str, Any], list[Limit], dict[str, Counters], bool]:
    counters = {scope: Counters(_amount(rng), _amount(rng)) for scope in SCOPES}
    reserve, reserve_cost = _amount(rng), _amount(rng)
    limits = []
    for i in range(rng.randint(0, 5)):
        scope = rng.choice(SCOPES)
        c = counters[scope]
        amount = charge(scope, reserve, reserve_cost)
        # caps at and around the edges: exactly fits, one over, wall at settled
        cap = rng.choice((c.settled, c.settled + c.in_flight + amount, _amount(rng))) + rng.randint(-1, 1)
        limits.append(Limit(f"limit-{i}", scope, max(cap, 0), rng.choice(("hold", "wall"))))  # type: ignore[arg-type]
    run_only = rng.random() < 0.25
    case = {
        "check": "verdict",
        "limits": [[lim.scope, lim.kind, lim.cap, lim.name] for lim in ordered(limits)],
        "run_only": run_only,
        "run": [
            counters["run"].settled,
            counters["run"].in_flight,
            counters["run_cost"].settled,
            counters["run_cost"].in_flight,
        ],
        "md": [counters["model_day"].settled, counters["model_day"].in_flight],
        "budgets": {scope: [counters[scope].settled, counters[scope].in_flight] for scope in BUDGET_SCOPES},
        "reserve": reserve,
        "reserve_cost": reserve_cost,
    }
    return case, limits, counters, run_only


def test_limit_check_is_quota_verdict(lua: Any) -> None:
    """blocking() names the same limit as quota.verdict (the Cluster run gate: verdict on the run scopes)."""
    rng = random.Random(11)
    generated = [_verdict_case(rng) for _ in range(CASES)]
    answers = lua([case for case, *_ in generated])
    refused = 0
    for (case, limits, counters, run_only), index in zip(generated, answers, strict=True):
        checked = [lim for lim in limits if lim.scope in RUN_SCOPES] if run_only else limits
        expected = verdict(checked, counters, case["reserve"], reserve_cost=case["reserve_cost"])
        got = ordered(limits)[index - 1] if index else None
        assert got == expected.blocking, case
        refused += index != 0
    assert CASES // 5 < refused < CASES * 4 // 5  # the generator reaches both answers often


def test_charge_is_quota_charge(lua: Any) -> None:
    """charge() adds a call's cost to the scopes that count money (the run's cost, a money budget), else its
    tokens, as quota.charge: what a budget's hold and its steps move in the budgets' slot."""
    rng = random.Random(16)
    cases = [
        {"check": "charge", "scope": rng.choice(SCOPES), "reserve": _amount(rng), "reserve_cost": _amount(rng)}
        for _ in range(CASES // 10)
    ]
    for case, answer in zip(cases, lua(cases), strict=True):
        assert int(answer) == charge(case["scope"], case["reserve"], case["reserve_cost"]), case


def _hold(rng: random.Random) -> dict[str, Any]:
    state = rng.choice(("held", "held", "unresolved", "settled", "released", "blocked"))
    reserved, reserved_cost = _amount(rng), _amount(rng)
    unresolved = state == "unresolved"
    return {
        "state": state,
        "reserved": reserved,
        "charged": reserved if unresolved else (_amount(rng) if state == "settled" else 0),
        "reserved_cost": reserved_cost,
        "charged_cost": reserved_cost if unresolved else 0,
    }


def test_hold_step_is_holds_step(lua: Any) -> None:
    """hold_step() moves a hold and its counters exactly as holds.step, for every state and event,
    and clamps an anomalous usage or cost (2^63, negative, ...) to the same bound with the same flag."""
    rng = random.Random(12)
    cases = []
    for _ in range(CASES):
        case = {"check": "step", "event": rng.choice(("settle", "settle", "release", "resolve")), **_hold(rng)}
        if rng.random() < 0.7:
            case["usage"] = rng.choice((_amount(rng), case["reserved"], case["reserved"] + 1, _anomaly(rng)))
        if rng.random() < 0.5:
            case["cost"] = rng.choice((_amount(rng), _amount(rng), _anomaly(rng)))
        cases.append(case)
    answers = lua(cases)
    moved = 0
    for case, answer in zip(cases, answers, strict=True):
        expected = holds.step(
            case["state"],
            case["event"],
            reserved=case["reserved"],
            charged=case["charged"],
            reserved_cost=case["reserved_cost"],
            charged_cost=case["charged_cost"],
            usage_total=case.get("usage"),
            cost=case.get("cost"),
        )
        if expected is None:
            assert answer is False, case
            continue
        moved += 1
        state, charged, charged_cost, overshoot, *deltas, clamped = answer
        got = (state, int(charged), int(charged_cost), overshoot, holds.Deltas(*map(int, deltas)), clamped)
        assert got == tuple(expected), case
    assert CASES // 5 < moved < CASES * 4 // 5


def test_hold_follow_is_holds_follow(lua: Any) -> None:
    """hold_follow() (the run slot's copy converging on its model-day) equals holds.follow."""
    rng = random.Random(13)
    cases = [
        {
            "check": "follow",
            **_hold(rng),
            "target": rng.choice(("unresolved", "settled", "released", "gone")),
            "new_charged": _amount(rng),
            "new_charged_cost": _amount(rng),
        }
        for _ in range(CASES)
    ]
    for case, answer in zip(cases, lua(cases), strict=True):
        expected = holds.follow(
            case["state"],
            case["reserved"],
            case["charged"],
            case["reserved_cost"],
            case["charged_cost"],
            case["target"],
            case["new_charged"],
            case["new_charged_cost"],
        )
        assert (answer is False) if expected is None else holds.Deltas(*map(int, answer)) == expected, case


def test_never_blocking_is_quota_never_fits(lua: Any) -> None:
    """never_blocking() (blocking() with nothing in flight) names the same limit as quota.never_fits."""
    rng = random.Random(14)
    generated = [_verdict_case(rng) for _ in range(CASES)]
    answers = lua([{**case, "check": "never"} for case, *_ in generated])
    never = 0
    for (case, limits, counters, _), index in zip(generated, answers, strict=True):
        expected = never_fits(limits, counters, case["reserve"], reserve_cost=case["reserve_cost"])
        assert (ordered(limits)[index - 1] if index else None) == expected, case
        never += index != 0
    assert CASES // 10 < never < CASES * 9 // 10


def test_line_crowded_is_lines_crowded(lua: Any) -> None:
    """line_crowded() marks the same lines as lines.crowded (the lines a waiter at the head joins)."""
    rng = random.Random(15)
    generated = [_verdict_case(rng) for _ in range(CASES)]
    answers = lua([{**case, "check": "crowded"} for case, *_ in generated])
    marked = 0
    for (case, limits, counters, _), (run, md) in zip(generated, answers, strict=True):
        expected = lines.crowded(limits, counters, case["reserve"], reserve_cost=case["reserve_cost"])
        got = tuple(name for name, on in (("run", run), ("model_day", md)) if on)
        assert got == expected, case
        marked += bool(got)
    assert CASES // 10 < marked < CASES * 9 // 10


def _waiter(rng: random.Random) -> str:
    return rng.choice(("", *(f"{n:032x}" for n in range(6))))


def test_line_ahead_is_lines_ahead(lua: Any) -> None:
    """line_ahead() counts the same live waiters ahead as lines.ahead: tickets, ties broken by waiter id,
    leases run out, a call without a ticket or without a waiter id, and the call itself in line."""
    rng = random.Random(16)
    cases = []
    for _ in range(CASES):
        now = rng.choice((1_000.0, 1_000.5))
        entries = []
        for _ in range(rng.randint(0, 6)):
            waiter = _waiter(rng) or "f" * 32
            entries.append([rng.randint(1, 8), waiter, now + rng.choice((-1.0, 0.0, 0.25, 5.0))])
        cases.append(
            {
                "check": "ahead",
                "entries": entries,
                "waiter": _waiter(rng),
                "ticket": rng.choice((0, rng.randint(1, 8))),
                "now": now,
            }
        )
    answers = lua(cases)
    counted = 0
    for case, answer in zip(cases, answers, strict=True):
        entries = [lines.Entry(t, w, u) for t, w, u in case["entries"]]
        expected = lines.ahead(entries, case["waiter"] or None, case["ticket"] or None, case["now"])
        assert answer == expected, case
        counted += expected > 0
    assert CASES // 5 < counted < CASES * 4 // 5


def test_line_decide_is_lines_decide(lua: Any) -> None:
    """line_decide() gives the same outcome and joins the same lines as lines.decide, on every input."""
    rng = random.Random(17)
    cases = [
        {
            "check": "decide",
            "ahead_run": rng.choice((0, 0, 1, 3)),
            "ahead_md": rng.choice((0, 0, 1, 3)),
            "allowed": rng.random() < 0.5,
            "never": rng.random() < 0.3,
            "crowd_run": rng.random() < 0.5,
            "crowd_md": rng.random() < 0.5,
            "can_wait": rng.random() < 0.6,
            "enforce": rng.random() < 0.9,
        }
        for _ in range(CASES)
    ]
    seen = set()
    for case, (outcome, join_run, join_md) in zip(cases, lua(cases), strict=True):
        crowd = tuple(name for name, on in (("run", case["crowd_run"]), ("model_day", case["crowd_md"])) if on)
        expected = lines.decide(
            {"run": case["ahead_run"], "model_day": case["ahead_md"]},
            allowed=case["allowed"],
            never=case["never"],
            crowd=crowd,
            can_wait=case["can_wait"],
            enforce=case["enforce"],
        )
        joined = tuple(name for name, on in (("run", join_run), ("model_day", join_md)) if on)
        assert (outcome, joined) == tuple(expected), case
        seen.add(outcome)
    assert seen == {"take", "refuse", "queued", "wait", "line_refused"}


def test_day_refused_is_the_beijing_day(lua: Any) -> None:
    """day_refused() lets a call through exactly when the server's time (TIME: whole microseconds) falls in the
    Beijing day it names (quota.beijing_day, by keys.day_start); otherwise it answers -4 and that time."""
    rng = random.Random(19)
    cases = []
    for _ in range(CASES):
        day = beijing_day(rng.uniform(0, 4_102_444_800))  # 1970 to 2100
        start = day_start(day)
        edge = rng.choice((start, start + int(DAY_S)))
        micros = rng.choice(
            (
                edge * 1_000_000 + rng.randint(-2, 2),  # a microsecond either side of a midnight
                edge * 1_000_000 + rng.randint(-2_000_000, 2_000_000),
                (start + rng.randint(-3 * 86_400, 4 * 86_400)) * 1_000_000 + rng.randint(0, 999_999),
            )
        )
        cases.append({"check": "day", "day": day, "day_start": start, "now": micros / 1_000_000})
    outcomes = set()
    for case, refused in zip(cases, lua(cases), strict=True):
        inside = beijing_day(case["now"]) == case["day"]
        assert (refused is False) == inside, case
        if refused is not False:
            assert refused[0] == -4 and abs(float(refused[1]) - case["now"]) < 1e-6, (case, refused)
        outcomes.add(inside)
    assert outcomes == {True, False}
