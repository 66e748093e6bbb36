"""The consume task's pure planning: the gate's clamps, call sizing, stop conditions, --at."""

from __future__ import annotations

from datetime import datetime

import pytest

from quotawrap.consume.plan import (
    MIN_CALL_TOKENS,
    lease_name,
    next_call_tokens,
    parse_at,
    plan_model,
    render_plan,
    seconds_until,
    stop_reason,
)
from quotawrap.core import quota

DAY = "2026-08-13"
T = datetime(2026, 8, 13, 23, 20, tzinfo=quota.BEIJING).timestamp()
V6 = quota.QuotaSettings(balance_lag_s=0)
LAG_AWARE = quota.QuotaSettings()


def _snap(balance: int, usage: int, lagged: int | None = None, day: str = DAY) -> quota.Snapshot:
    return quota.Snapshot(balance, usage, usage if lagged is None else lagged, T - 60, day)


class TestPlanModel:
    def test_pool_clamp_is_b0_minus_buffer_minus_usage(self) -> None:
        """§9's clamp 2: b0_est - SMALL_BUFFER - usage, with in-flight holds counted as used."""
        plan = plan_model("m", _snap(600_000, 300_000), quota.Counters(300_000, 10_000), V6, DAY)
        assert plan.pool == 900_000
        assert plan.by_pool == 900_000 - 50_000 - 310_000
        assert plan.budget == plan.by_pool and plan.binding == "snapshot"

    def test_daily_cap_clamp_binds_a_big_pool(self) -> None:
        """§9's clamp 1: 2M - usage when the pool is larger (§4.2's B0 = 2,242,178)."""
        plan = plan_model("m", _snap(2_242_178 - 1_500_000, 1_500_000), quota.Counters(1_500_000), V6, DAY)
        assert plan.budget == 500_000 == plan.by_daily_cap and plan.binding == "daily_cap"

    def test_lag_aware_pool_removes_the_unsettled_usage(self) -> None:
        """The seed's open item: b0_est = balance + usage is inflated by L; the lag-aware pool is not."""
        # B0 1.5M; 300k used, of which the last 150k was not yet settled when billing was read
        snap = _snap(1_500_000 - 150_000, 300_000, lagged=150_000)
        v6 = plan_model("m", snap, quota.Counters(300_000), V6, DAY)
        aware = plan_model("m", snap, quota.Counters(300_000), LAG_AWARE, DAY)
        assert v6.budget == 1_650_000 - 50_000 - 300_000  # L = 150k past the true pool
        assert aware.budget == 1_500_000 - 50_000 - 300_000  # exactly the true pool

    def test_no_balance_today_plans_nothing(self) -> None:
        """Yesterday's snapshot, or none, gives a zero plan that says what to do."""
        for snapshot in (None, _snap(900_000, 0, day="2026-08-12")):
            plan = plan_model("m", snapshot, quota.Counters(), V6, DAY)
            assert plan.budget == 0 and plan.binding == "no_balance"
            assert "quotawrap sync" in render_plan(plan)

    def test_never_negative(self) -> None:
        """Usage past the limit plans 0, not a negative amount."""
        assert plan_model("m", _snap(10_000, 900_000), quota.Counters(900_000), V6, DAY).budget == 0

    def test_render_names_both_clamps(self) -> None:
        """The dry-run text shows the budget and the two clamps with their numbers."""
        text = render_plan(plan_model("m", _snap(600_000, 300_000), quota.Counters(300_000), V6, DAY))
        assert "plan 550,000 tokens" in text and "= 1,700,000" in text and "= 550,000" in text


class TestNextCallTokens:
    def test_the_whole_hold_fits_what_is_left(self) -> None:
        """max_tokens + prompt never exceeds what is unassigned, and never the per-call maximum."""
        assert next_call_tokens(1_000_000, 100, 16_384) == 16_384
        assert next_call_tokens(10_000, 100, 16_384) == 9_900

    def test_too_little_left_is_zero(self) -> None:
        """Less than MIN_CALL_TOKENS of output left: stop rather than send a tiny call."""
        assert next_call_tokens(100 + MIN_CALL_TOKENS - 1, 100, 16_384) == 0
        assert next_call_tokens(100 + MIN_CALL_TOKENS, 100, 16_384) == MIN_CALL_TOKENS


_GO_ON: dict[str, object] = {
    "unassigned": 100_000,
    "prompt_tokens": 100,
    "seconds_to_midnight": 3_000.0,
    "stop_before_s": 600.0,
    "error_streak": 0,
    "max_errors": 3,
    "blocked_by": None,
}


class TestStopReason:
    @pytest.mark.parametrize(
        ("change", "expected"),
        [
            ({}, None),
            ({"blocked_by": "daily_cap"}, "stopped at the daily_cap limit"),
            ({"error_streak": 3}, "stopped after 3 errors in a row"),
            ({"seconds_to_midnight": 600.0}, "stopped 10 min before Beijing midnight"),
            ({"unassigned": 200}, "plan spent"),
        ],
    )
    def test_each_condition(self, change: dict[str, object], expected: str | None) -> None:
        """Limit, error streak, the margin before midnight and a spent plan each stop the task."""
        assert stop_reason(**{**_GO_ON, **change}) == expected  # type: ignore[arg-type]


class TestAt:
    def test_parse(self) -> None:
        """HH:MM in 24 h; anything else is a clear error."""
        assert parse_at("23:20") == (23, 20) and parse_at("7:05") == (7, 5)
        for bad in ("24:00", "23:2", "noon", "23:20:00"):
            with pytest.raises(ValueError, match="HH:MM"):
                parse_at(bad)

    def test_seconds_until_beijing_time(self) -> None:
        """Waits until HH:MM Beijing today; a time already passed means at once."""
        at_22 = datetime(2026, 8, 13, 22, 0, tzinfo=quota.BEIJING).timestamp()
        assert seconds_until(at_22, 23, 20) == 80 * 60
        assert seconds_until(T + 1, 23, 20) == 0.0


def test_lease_name_is_the_seeds_key() -> None:
    """§6.1: consume:last_run:{Beijing date}."""
    assert lease_name(DAY) == "consume:last_run:2026-08-13"
