"""quotawrap.core.budgets: the spec's grammar, the periods in Beijing time, which calls a budget matches, and
the limits a call is checked against (table tests; the stores' enforcement is tested in test_ledger_budgets)."""

from __future__ import annotations

from datetime import datetime

import pytest

from quotawrap.core.budgets import (
    PERIODS,
    Budget,
    applicable,
    budget_limits,
    budget_scope,
    parse_budget,
    period_end,
    period_key,
    uses_in,
)
from quotawrap.core.errors import ConfigError
from quotawrap.core.quota import BEIJING, Counters, counts_cost, verdict


def bj(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: float = 0.0) -> float:
    """A Beijing wall-clock time as a Unix timestamp."""
    whole = int(second)
    micro = round((second - whole) * 1e6)
    return datetime(year, month, day, hour, minute, whole, micro, tzinfo=BEIJING).timestamp()


@pytest.mark.parametrize(
    ("spec", "match", "amount", "unit", "period", "soft"),
    [
        ("team=search:200000/day", (("team", "search"),), 200_000, "tokens", "day", False),
        ("user=ana,project=x:500k/week", (("project", "x"), ("user", "ana")), 500_000, "tokens", "week", False),
        ("model=deepseek-v4*:2M/day", (("model", "deepseek-v4*"),), 2_000_000, "tokens", "day", False),
        ("*:¥300/month", (), 300_000_000, "cny", "month", False),
        ("*:￥0.5/hour", (), 500_000, "cny", "hour", False),
        ("*:cny300/month", (), 300_000_000, "cny", "month", False),
        ("*:300cny/month", (), 300_000_000, "cny", "month", False),
        ("*:300CNY/month", (), 300_000_000, "cny", "month", False),
        ("team=search:200k/day,soft", (("team", "search"),), 200_000, "tokens", "day", True),
        ("team=search:1.5m/run", (("team", "search"),), 1_500_000, "tokens", "run", False),
        ("team=search:200_000/hour", (("team", "search"),), 200_000, "tokens", "hour", False),
        (" key=ab12* : 10k / week , soft ", (("key", "ab12*"),), 10_000, "tokens", "week", True),
        ("ticket=QW:5:1000/day", (("ticket", "QW:5"),), 1_000, "tokens", "day", False),
        ("team=a:0/day", (("team", "a"),), 0, "tokens", "day", False),
    ],
)
def test_spec_parses(
    spec: str, match: tuple[tuple[str, str], ...], amount: int, unit: str, period: str, soft: bool
) -> None:
    budget = parse_budget(spec)
    assert (budget.match, budget.amount, budget.unit, budget.period, budget.soft) == (match, amount, unit, period, soft)
    assert parse_budget(budget.spec) == budget  # the canonical spec reads back as the same budget


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("team=search", "SELECTOR:AMOUNT/PERIOD"),
        (":100/day", "SELECTOR:AMOUNT/PERIOD"),
        ("team=search:100", "SELECTOR:AMOUNT/PERIOD"),
        ("team=search:/day", "SELECTOR:AMOUNT/PERIOD"),
        ("team=search:100/fortnight", "the period must be one of run, hour, day, week, month"),
        ("team=search:100/day,hard", "only 'soft' may follow"),
        ("team=search:ten/day", "is no amount"),
        ("team=search:1.5/day", "whole number of tokens"),
        ("team=search:-5/day", "is no amount"),
        ("team:100/day", "is not NAME=VALUE"),
        ("te am=x:100/day", "is not NAME=VALUE"),
        ("team=:100/day", "is not NAME=VALUE"),
        ("team=a,team=b:100/day", "team is named twice"),
        ("team=a b:100/day", "must not hold spaces"),
        ("*:¥-3/day", "is no amount"),
    ],
)
def test_bad_spec_is_one_line_naming_the_form(spec: str, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_budget(spec)
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_id_names_selector_period_unit_and_run_not_amount_or_softness() -> None:
    assert parse_budget("b=2,a=1:100/day").id == parse_budget("a=1,b=2:5k/day,soft").id
    assert parse_budget("a=1:100/day").id != parse_budget("a=1:100/week").id
    assert parse_budget("a=1:100/day").id != parse_budget("a=1:¥100/day").id
    assert parse_budget("a=1:100/day").id != parse_budget("a=1:100/day", run_id="r1").id


@pytest.mark.parametrize(
    ("period", "at", "key", "ends"),
    [
        ("run", bj(2026, 8, 13, 12), "r1", None),
        # hours: Beijing hours, whatever UTC says (00:xx Beijing is 16:xx UTC the day before)
        ("hour", bj(2026, 8, 13, 0), "2026-08-13T00", bj(2026, 8, 13, 1)),
        ("hour", bj(2026, 8, 13, 0, 59, 59.999), "2026-08-13T00", bj(2026, 8, 13, 1)),
        ("hour", bj(2026, 12, 31, 23, 30), "2026-12-31T23", bj(2027, 1, 1)),
        # days: Beijing midnight
        ("day", bj(2026, 8, 13), "2026-08-13", bj(2026, 8, 14)),
        ("day", bj(2026, 8, 13, 23, 59, 59.999), "2026-08-13", bj(2026, 8, 14)),
        ("day", bj(2026, 8, 14), "2026-08-14", bj(2026, 8, 15)),
        ("day", bj(2026, 2, 28, 12), "2026-02-28", bj(2026, 3, 1)),
        # ISO weeks start on Monday; across a year end the week belongs to the year of its Thursday
        ("week", bj(2026, 8, 10), "2026-W33", bj(2026, 8, 17)),  # a Monday
        ("week", bj(2026, 8, 16, 23, 59, 59), "2026-W33", bj(2026, 8, 17)),  # the Sunday after
        ("week", bj(2026, 12, 31, 12), "2026-W53", bj(2027, 1, 4)),  # 2026 has 53 ISO weeks
        ("week", bj(2027, 1, 3, 23), "2026-W53", bj(2027, 1, 4)),  # Sunday 3 Jan 2027: still 2026's week 53
        ("week", bj(2027, 1, 4), "2027-W01", bj(2027, 1, 11)),
        ("week", bj(2024, 12, 30), "2025-W01", bj(2025, 1, 6)),  # Monday 30 Dec 2024: 2025's first week
        # months: calendar months, of 28, 29, 30 and 31 days
        ("month", bj(2026, 1, 31, 23, 59), "2026-01", bj(2026, 2, 1)),
        ("month", bj(2026, 2, 1), "2026-02", bj(2026, 3, 1)),
        ("month", bj(2028, 2, 29, 12), "2028-02", bj(2028, 3, 1)),
        ("month", bj(2026, 4, 30, 23), "2026-04", bj(2026, 5, 1)),
        ("month", bj(2026, 12, 31, 23, 59, 59), "2026-12", bj(2027, 1, 1)),
        ("month", bj(2027, 1, 1), "2027-01", bj(2027, 2, 1)),
    ],
)
def test_periods_in_beijing_time(period: str, at: float, key: str, ends: float | None) -> None:
    assert period_key(period, at, "r1") == key  # type: ignore[arg-type]
    assert period_end(period, at) == ends  # type: ignore[arg-type]
    if ends is not None:  # the next period starts exactly at the end, with another key
        assert period_key(period, ends, "r1") != key  # type: ignore[arg-type]
        assert period_key(period, ends - 0.001, "r1") == key  # type: ignore[arg-type]


def test_every_period_is_tested() -> None:
    assert set(PERIODS) == {"run", "hour", "day", "week", "month"}


@pytest.mark.parametrize(
    ("spec", "tags", "model", "key", "run", "matches"),
    [
        ("*:1/day", {}, "m", None, "r", True),
        ("team=search:1/day", {"team": "search"}, "m", None, "r", True),
        ("team=search:1/day", {"team": "ads"}, "m", None, "r", False),
        ("team=search:1/day", {}, "m", None, "r", False),
        ("user=ana,project=x:1/day", {"user": "ana", "project": "x"}, "m", None, "r", True),
        ("user=ana,project=x:1/day", {"user": "ana", "project": "y"}, "m", None, "r", False),
        ("model=deepseek-v4*:1/day", {}, "deepseek-v4-flash", None, "r", True),
        ("model=deepseek-v4*:1/day", {}, "deepseek-v3", None, "r", False),
        ("model=deepseek-v4*:1/day", {"model": "deepseek-v4"}, "other", None, "r", False),  # model is the call's
        ("key=abc*:1/day", {}, "m", "abcdef", "r", True),
        ("key=abc*:1/day", {}, "m", None, "r", False),
        ("team=Search:1/day", {"team": "search"}, "m", None, "r", False),  # case counts
    ],
)
def test_matching(spec: str, tags: dict[str, str], model: str, key: str | None, run: str, matches: bool) -> None:
    assert parse_budget(spec).matches(tags, model, key, run) is matches


def test_matching_for_a_run_and_for_any_key() -> None:
    budget = parse_budget("team=a,model=m*,key=k1:1/day")
    assert budget.matches_any_key({"team": "a"}, "m1", "r") and not budget.matches_any_key({"team": "a"}, "x", "r")
    assert budget.may_match({"team": "a"}, "r") and not budget.may_match({"team": "b"}, "r")
    assert not budget.may_match({}, "r")


def test_a_runs_own_budget_matches_that_run_alone() -> None:
    budget = parse_budget("*:100/day", run_id="r1")
    assert budget.matches({}, "m", None, "r1")
    assert not budget.matches({}, "m", None, "r2")


def test_limits_refuse_past_a_hard_budget_and_never_past_a_soft_one() -> None:
    now = bj(2026, 8, 13, 12)
    hard = parse_budget("team=search:1000/day")
    soft = parse_budget("team=search:10/hour,soft")
    money = parse_budget("*:¥1/month")
    found = applicable([hard, soft, money, parse_budget("team=ads:1/day")], {"team": "search"}, "m", None, "r")
    assert found == sorted([hard, soft, money], key=lambda b: b.id)
    limits, scopes = budget_limits(found, now, "r")
    assert [limit.scope for limit in limits] == [
        budget_scope(b, period_key(b.period, now, "r")) for b in found if not b.soft
    ]
    assert len(scopes) == 3
    hard_scope = budget_scope(hard, "2026-08-13")
    money_scope = budget_scope(money, "2026-08")
    assert counts_cost(money_scope) and not counts_cost(hard_scope) and counts_cost("run_cost")
    counters = {hard_scope: Counters(600, 300), money_scope: Counters(500_000, 0)}
    assert verdict(limits, counters, 100, reserve_cost=500_000).allowed  # 600+300+100 = 1000 fits; ¥1 fits
    refused = verdict(limits, counters, 101, reserve_cost=0)
    assert refused.blocking is not None and refused.blocking.scope == hard_scope
    assert "quotawrap budget set 'team=search:NEW/day'" in refused.blocking.detail
    assert "resets 2026-08-14 00:00 Beijing time" in refused.blocking.detail
    by_cost = verdict(limits, counters, 0, reserve_cost=500_001)
    assert by_cost.blocking is not None and by_cost.blocking.scope == money_scope


def test_uses() -> None:
    now = bj(2026, 8, 13, 12)
    budget = parse_budget("team=search:1000/day,soft")
    scope = budget_scope(budget, "2026-08-13")
    (use,) = uses_in([budget], now, "r", {scope: Counters(700, 200)})
    assert (use.used, use.in_flight, use.left, use.resets_at) == (700, 200, 100, bj(2026, 8, 14))
    assert use.as_json()["left"] == 100 and "left 100" in use.line()
    (over,) = uses_in([budget], now, "r", {scope: Counters(1200, 0)})
    assert over.left == 0 and over.fraction == 1.2
    assert use.numbers() == "700 / 1,000 tokens, +200 in flight" and use.label == "budget team=search/day"


def test_record_is_hashable_and_frozen() -> None:
    budget = Budget((("team", "a"),), 5, "tokens", "day")
    assert {budget: 1}[parse_budget("team=a:5/day")] == 1
