"""The Lua mirrors of the ledger's rules equal their Python originals, on generated cases.

lua/lib.lua's ``blocking`` must be ``quota.verdict`` (on limits in ``quota.ordered``'s order),
and its ``hold_step`` / ``hold_follow`` must be ``holds.step`` / ``holds.follow``. Each check
runs the library itself through real ``EVAL`` on a private redis-server, a thousand cases per
call, against the Python functions on the same seeded cases.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from quotawrap.ledger import holds
from quotawrap.ledger.redis.client import lua_file
from quotawrap.quota import Counters, Limit, ordered, verdict
from tests.redis_server import session_url

pytestmark = pytest.mark.redis

BATCH = 1000
CASES = 6000
RUN_SCOPES = ("run", "run_cost")

# Appended to the library: ARGV[1] is a JSON list of cases; every number comes back as a decimal
# string (cjson would print 14 significant digits), a step that changes nothing as false.
_HARNESS = r"""
local out = {}
for i, c in ipairs(cjson.decode(ARGV[1])) do
  if c.check == 'verdict' then
    local limits = {}
    for j, l in ipairs(c.limits) do limits[j] = {l[1], l[2], l[3], l[4]} end
    out[i] = blocking(limits, c.run_only, c.run, c.md[1], c.md[2], c.reserve, c.reserve_cost)
  elseif c.check == 'step' then
    local r = {hold_step(c.state, c.event, c.reserved, c.charged, c.reserved_cost, c.charged_cost, c.usage, c.cost)}
    if r[1] == nil then
      out[i] = false
    else
      out[i] = {r[1], int(r[2]), int(r[3]), r[4], int(r[5]), int(r[6]), int(r[7]), int(r[8]), r[9]}
    end
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
    counters = {scope: Counters(_amount(rng), _amount(rng)) for scope in ("run", "model_day", "run_cost")}
    reserve, reserve_cost = _amount(rng), _amount(rng)
    limits = []
    for i in range(rng.randint(0, 5)):
        scope = rng.choice(("run", "model_day", "run_cost"))
        c = counters[scope]
        amount = reserve_cost if scope == "run_cost" else reserve
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
