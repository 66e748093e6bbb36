"""Tests for quotawrap.core.quota: every numbered scenario of the VolcEngine quota notes, one table row each.

Section numbers (§) point into the production notes (volc-quota-notes.md). Numbers are the
notes' own; rows say where each comes from. Times are Beijing time.
"""

from __future__ import annotations

import heapq
import inspect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotawrap.core.errors import ConfigError
from quotawrap.core.expiry import drain_daily_usage, keep_alive_daily_usage
from quotawrap.core.quota import (
    BEIJING,
    CalibrationDay,
    Counters,
    Limit,
    Package,
    QuotaSettings,
    Snapshot,
    beijing_day,
    beijing_day_start,
    calibrate_lag,
    calibrate_lag_days,
    effective_limit,
    evicted_by,
    lag_fit,
    lagged_usage,
    model_day_limits,
    pool_estimate,
    run_limits,
    seconds_to_beijing_midnight,
    series_total,
    should_restore,
    should_soft_evict,
    soft_evict_walls,
    usage_at,
    verdict,
)

MIN = 60
V6 = QuotaSettings(balance_lag_s=0)  # --balance-lag 0: the production v6 limiter exactly
DEFAULT = QuotaSettings()
B0_0813 = 2_242_178  # §4.2 true initial balance on 08-13 (web reading at collection 0)
B0_0812 = 2_293_004  # §4.2/§5 08-12 pool, from the converged 14:59:51 sync


def bj(hour: int, minute: int = 0, second: int = 0, day: int = 13) -> float:
    """A Beijing wall-clock time on 2026-08-<day> as a Unix timestamp."""
    return datetime(2026, 8, day, hour, minute, second, tzinfo=BEIJING).timestamp()


def synced(
    t: float,
    balance: int,
    series: Sequence[tuple[float, int]],
    lag_s: float,
    previous: Sequence[tuple[float, int]] = (),
    *,
    bucket_s: float = 0.0,
) -> Snapshot:
    """The snapshot a ledger stores at a sync: the notes' usage numbers are exact log readings (bucket 0)."""
    usage = usage_at(series, t)
    lagged = lagged_usage(t, lag_s, usage, series, previous, bucket_s=bucket_s)
    return Snapshot(balance, usage, lagged, t, beijing_day(t), "billing-api")


def snap(balance: int, usage_at_sync: int, lagged: int | None = None, day: int = 13) -> Snapshot:
    """A snapshot taken at noon of 2026-08-<day>; lagged defaults to usage_at_sync (converged / lag 0)."""
    lagged = usage_at_sync if lagged is None else lagged
    return Snapshot(balance, usage_at_sync, lagged, bj(12, day=day), f"2026-08-{day}", "billing-api")


def decide(limits: Sequence[Limit], settled: int, reserve: int, in_flight: int = 0) -> str:
    return verdict(limits, {"model_day": Counters(settled, in_flight)}, reserve).reason


# §4.2, 08-13: usage read at the two syncs (515,652 at 11:08; 665,268 = 515,652 + 149,616 at 11:22)
SERIES_0813 = [(bj(11, 8), 515_652), (bj(11, 22), 665_268)]

# §4.1/§5/§7.6, 08-12: usage 1,696,135 by 13:38, +98 at 20:38:26, +176,571 at 20:53:13,
# 2,050,826 at the 20:53:35 sync
SERIES_0812 = [
    (bj(13, 38, day=12), 1_696_135),
    (bj(20, 38, 26, day=12), 1_696_233),
    (bj(20, 53, 13, day=12), 1_872_804),
    (bj(20, 53, 35, day=12), 2_050_826),
]


class TestBeijingCalendar:
    @pytest.mark.parametrize(
        ("ts", "day"),
        [
            (bj(0, 0, 0), "2026-08-13"),  # §6.1 daily_usage rolls at Beijing 00:00
            (bj(0, 0, 0) - 1, "2026-08-12"),  # one second earlier is yesterday's counter
            (datetime.fromisoformat("2026-08-12T16:00:00+00:00").timestamp(), "2026-08-13"),  # UTC+8, no DST
            (bj(23, 59, 59), "2026-08-13"),
        ],
    )
    def test_beijing_day(self, ts: float, day: str) -> None:
        """The model-day counter is keyed by the Beijing calendar date."""
        assert beijing_day(ts) == day

    def test_beijing_day_remembered_for_one_day_only(self) -> None:
        """The day's text is kept between calls: every timestamp around two midnights, asked in an
        order that crosses them both ways, still gets its own calendar day."""
        midnight = bj(0, 0, 0)
        stamps = [midnight + offset for offset in (-1.0, -0.0005, 0.0, 0.0005, 1.0, 43_200.0, 86_399.9995, 86_400.0)]
        for ts in [*stamps, *reversed(stamps), *stamps[::2], *stamps[1::2]]:
            assert beijing_day(ts) == datetime.fromtimestamp(ts, BEIJING).strftime("%Y-%m-%d"), ts

    @pytest.mark.parametrize(
        ("ts", "seconds"),
        [
            (bj(23, 20), 40 * MIN),  # §1.1 the 23:20 consumption task has 40 minutes left
            (bj(0, 0), 86_400.0),  # right at the reset the next one is a full day away
            (bj(12, 0), 12 * 3600.0),
            (bj(23, 59, 59), 1.0),
        ],
    )
    def test_seconds_to_midnight(self, ts: float, seconds: float) -> None:
        """Time to the Beijing-midnight reset, in (0, 86400]."""
        assert seconds_to_beijing_midnight(ts) == seconds

    def test_day_start(self) -> None:
        """The day start is the Beijing midnight before the timestamp."""
        assert beijing_day_start(bj(11, 22, 7)) == bj(0, 0)


class TestUsageSeries:
    @pytest.mark.parametrize(
        ("t", "usage"),
        [
            (bj(11, 7, 59), 0),  # before the first point: nothing counted
            (bj(11, 8), 515_652),  # a point counts at its own stamp
            (bj(11, 21, 59), 515_652),  # step function between points
            (bj(11, 22), 665_268),
            (bj(23, 0), 665_268),
        ],
    )
    def test_usage_at(self, t: float, usage: int) -> None:
        """usage_at is the step function of the cumulative series, 0 before its first point."""
        assert usage_at(SERIES_0813, t) == usage

    def test_series_total(self) -> None:
        """A finished day's usage is its last cumulative value; an empty day used nothing."""
        assert (series_total(SERIES_0812), series_total([])) == (2_050_826, 0)


class TestLaggedUsage:
    def test_lag_zero_is_usage_at_sync(self) -> None:
        """--balance-lag 0 stores usage_at_sync: the v6 snapshot exactly."""
        assert lagged_usage(bj(11, 22), 0, 665_268, SERIES_0813) == 665_268

    def test_reads_the_series_lag_earlier(self) -> None:
        """§4.2 a 14-minute lag at the 11:22 sync reads the 11:08 usage 515,652."""
        assert lagged_usage(bj(11, 22), 14 * MIN, 665_268, SERIES_0813, bucket_s=0) == 515_652

    def test_minute_buckets_are_read_one_bucket_earlier(self) -> None:
        """A point stamped at a minute's start may hold usage to its end: the guard reads a bucket back."""
        series = [(bj(10, 0), 100), (bj(11, 8), 515_652)]  # the 11:08 bucket holds usage up to 11:08:59
        assert lagged_usage(bj(11, 22, 30), 14 * MIN, 665_268, series) == 100

    def test_never_above_usage_at_sync(self) -> None:
        """A series stamped ahead of the sync cannot raise the lagged reading above the usage at sync."""
        assert lagged_usage(bj(11, 22), 60, 500_000, [(bj(11, 0), 600_000)]) == 500_000

    def test_yesterdays_unsettled_tail_is_subtracted(self) -> None:
        """Across midnight the balance still holds yesterday's unsettled usage, which is not today's pool."""
        yesterday = [(bj(9, day=12), 800_000), (bj(23, 55, day=12), 920_000)]  # 120,000 at 23:55
        assert lagged_usage(bj(0, 5), 30 * MIN, 0, [], yesterday, bucket_s=0) == -120_000

    def test_old_yesterday_usage_does_not_count(self) -> None:
        """§7.2 yesterday's settled usage, however small or large, plays no part in today's reading."""
        today = [(bj(9), 300_000)]
        readings = {
            lagged_usage(bj(12), 30 * MIN, 300_000, today, [(bj(9, day=12), total)]) for total in (10_000, 2_000_000)
        }
        assert readings == {300_000}


class TestSection42SettlementLag:
    """§4.2 08-13: B0 = 2,242,178; 11:08 Bal 2,242,063 (residual 115); 11:22 Bal 1,726,526 = B0 − 515,652."""

    @pytest.mark.parametrize(
        ("t", "balance", "lag_s", "pool", "cap"),
        [
            (bj(11, 22), 1_726_526, 0, 2_391_794, 2_000_000),  # §4.2 v6: B0 + L, inflated by 149,616
            (
                bj(11, 22),
                1_726_526,
                14 * MIN,
                B0_0813,
                2_000_000,
            ),  # lag = Δ: 1,726,526 + 515,652 = B0 exactly
            (bj(11, 8), 2_242_063, 0, 2_757_715, 2_000_000),  # §4.2 v6 at 11:08: nothing settled yet
            (bj(11, 8), 2_242_063, 14 * MIN, 2_242_063, 2_000_000),  # lag-aware: B0 − residual 115
            (bj(11, 22), 1_726_526, 30 * MIN, 1_726_526, 1_676_526),  # default lag, no series before 11:08
        ],
    )
    def test_pool_and_limit(self, t: float, balance: int, lag_s: float, pool: int, cap: int) -> None:
        """The pool is balance + usage(t_sync − lag); the limit is min(2M, pool − 50,000)."""
        s = QuotaSettings(balance_lag_s=lag_s)
        snapshot = synced(t, balance, SERIES_0813, lag_s)
        assert (pool_estimate(snapshot, s), effective_limit(snapshot, s)[0]) == (pool, cap)

    def test_v6_inflation_is_the_unsettled_usage(self) -> None:
        """§4.2 L = usage_at_sync − settled = 665,268 − (B0 − 1,726,526) = 149,616."""
        snapshot = synced(bj(11, 22), 1_726_526, SERIES_0813, 0)
        assert pool_estimate(snapshot, V6) - B0_0813 == snapshot.usage_at_sync - (B0_0813 - 1_726_526) == 149_616

    def test_v6_limit_term_before_the_cap(self) -> None:
        """§4.2 v6 at 11:22: 2,391,794 − 50,000 = 2,341,794, above B0; only the 2M cap binds."""
        hold = model_day_limits(synced(bj(11, 22), 1_726_526, SERIES_0813, 0), V6)[0]
        assert (hold.name, hold.cap) == ("daily_cap", 2_000_000) and "2,341,794" in hold.detail

    @pytest.mark.parametrize("lag_min", [14, 15, 20, 30, 60])
    def test_lag_at_least_delta_never_exceeds_b0(self, lag_min: int) -> None:
        """§4.2 with lag >= Δ = 14 min the 11:22 pool is at most B0: the guard stays below B0 − 50,000."""
        s = QuotaSettings(balance_lag_s=lag_min * MIN)
        assert pool_estimate(synced(bj(11, 22), 1_726_526, SERIES_0813, lag_min * MIN), s) <= B0_0813

    def test_converged_sync_08_12(self) -> None:
        """§4.2 08-12 14:59:51 converged: 596,869 = 2,293,004 − 1,696,135 to the token, at any lag."""
        pools = {
            pool_estimate(synced(bj(14, 59, 51, day=12), 596_869, SERIES_0812, lag), QuotaSettings(balance_lag_s=lag))
            for lag in (0, 14 * MIN, 30 * MIN)
        }
        assert pools == {B0_0812}


class TestSection5TodayAboveBalance:
    """§4.1/§5: Today > BalAtSync is two different measures, not an overspend."""

    def test_v6_log_line(self) -> None:
        """§5 '+98 (Today: 1,696,233 | BalAtSync: 596,869 | Limit: 2,000,000)' is allowed and not evicted."""
        limits = model_day_limits(snap(596_869, 1_696_135), V6)
        assert (
            limits[0].cap,
            decide(limits, 1_696_135, 98),
            evicted_by(limits, {"model_day": Counters(1_696_233)}),
        ) == (2_000_000, "fits", None)

    def test_lagged_13_36_snapshot_overstates_by_half_a_million(self) -> None:
        """§4.1/§5 13:36:01 Bal 1,558,307 at usage 1,241,821: v6 pool 2,800,128 = 2,293,004 + 507,124."""
        pool = pool_estimate(snap(1_558_307, 1_241_821), V6)
        assert (pool, pool - B0_0812, 1_558_307 - (B0_0812 - 1_241_821)) == (2_800_128, 507_124, 507_124)

    def test_usage_run_after_13_36_stays_under_the_cap(self) -> None:
        """§4.1 usage 1,241,821 → 1,696,135 (13:36→13:38) on a frozen balance: only the 2M cap bounds it."""
        limits = model_day_limits(snap(1_558_307, 1_241_821), V6)
        assert (limits[0].name, decide(limits, 1_241_821, 1_696_135 - 1_241_821)) == ("daily_cap", "fits")


class TestSection72YesterdayAnchor:
    """§7.2 v3 `min(2M, yesterday's usage × k)` is not expressible: only today's stock sets today's cap."""

    def test_balance_2m_yesterday_10k(self) -> None:
        """§7.2 the user's counterexample: balance 2M, yesterday 10K → today min(2M, 2M − 50,000), not 10K."""
        assert effective_limit(snap(2_000_000, 0), DEFAULT, today="2026-08-13") == (1_950_000, "snapshot")

    def test_snapshot_of_another_day_is_ignored(self) -> None:
        """§7.2 yesterday's snapshot (usage 10K) never sets today's cap: the daily cap alone applies."""
        yesterday = snap(12_000, 10_000, day=12)
        assert effective_limit(yesterday, DEFAULT, today="2026-08-13") == (2_000_000, "daily_cap")

    def test_another_days_snapshot_brings_no_walls(self) -> None:
        """A stale snapshot's low balance does not evict today's model."""
        limits = model_day_limits(snap(50_000, 10_000, day=12), DEFAULT, today="2026-08-13")
        assert [limit.name for limit in limits] == [
            "daily_cap",
            "usage_wall",
        ] and "no balance sync today" in (limits[0].detail)

    def test_no_yesterday_input(self) -> None:
        """effective_limit takes no yesterday figure at all: a snapshot, the settings and the day."""
        assert list(inspect.signature(effective_limit).parameters) == ["snapshot", "settings", "today"]

    @pytest.mark.parametrize("yesterday_use", [10_000, 1_000_000, 2_000_000])
    def test_conservation_keeps_the_limit(self, yesterday_use: int) -> None:
        """§1.3 balance_{N+1} = balance_N − use_N + return_{N+1}: any use ≤ 2M keeps tomorrow's limit."""
        balance_tomorrow = 2_000_000 - yesterday_use + yesterday_use
        assert effective_limit(snap(balance_tomorrow, 0), DEFAULT)[0] == 1_950_000


class TestSection73FrozenSnapshot:
    """§7.3 v4 `max(0, balance − BUFFER)` blocked 1,696,135 + 16 against 296,869 with 596,869 free."""

    def test_false_block_is_gone(self) -> None:
        """§7.3 15:09:51: our limit at Bal 596,869, usage 1,696,135 is 2,000,000; the 16-token call fits."""
        limits = model_day_limits(snap(596_869, 1_696_135), V6)
        assert (limits[0].cap, decide(limits, 1_696_135, 16)) == (2_000_000, "fits")

    def test_even_with_the_old_buffer(self) -> None:
        """§7.3/§7.4 with BUFFER 300,000 the cap is 1,993,004, not v4's 296,869: the call still fits."""
        limits = model_day_limits(snap(596_869, 1_696_135), QuotaSettings(small_buffer=300_000, balance_lag_s=0))
        assert (limits[0].cap, decide(limits, 1_696_135, 16)) == (1_993_004, "fits")

    def test_v4_coincides_only_at_zero_usage(self) -> None:
        """§7.3 '仅在同步时点 U=0 巧合正确': with no usage at sync, balance − BUFFER is also our cap."""
        assert effective_limit(snap(596_869, 0), QuotaSettings(small_buffer=300_000))[0] == 296_869

    @given(
        balance=st.integers(0, 3_000_000),
        usage=st.integers(0, 2_500_000),
        moved=st.integers(0, 2_500_000),
        lag=st.sampled_from([0.0, 1800.0]),
    )
    def test_only_balance_plus_usage_counts(self, balance: int, usage: int, moved: int, lag: float) -> None:
        """§7.3 'remaining ≠ cumulative limit': only balance + usage counts, so v4 is unreachable."""
        moved = min(moved, usage)
        s = QuotaSettings(balance_lag_s=lag)
        assert effective_limit(snap(balance, usage), s) == effective_limit(snap(balance + moved, usage - moved), s)


class TestSection74OldBuffer:
    """§7.1/§7.4 v2/v5 `usage + balance − BUFFER(300k)`: our formula with small_buffer = 300,000."""

    def test_stable_limit_1_993_004(self) -> None:
        """§7.4 U 1,696,135 + B 596,869 − 300,000 = 1,993,004, leaving 296,869 usable."""
        cap, binding = effective_limit(snap(596_869, 1_696_135), QuotaSettings(small_buffer=300_000))
        assert (cap, binding, cap - 1_696_135) == (1_993_004, "snapshot", 296_869)

    def test_v6_keeps_only_50k_back(self) -> None:
        """§7.5 table: v6 at the same sync gives min(2M, 2,293,004 − 50,000 = 2,243,004) = 2,000,000."""
        hold = model_day_limits(snap(596_869, 1_696_135), V6)[0]
        assert (hold.cap, "2,243,004" in hold.detail) == (2_000_000, True)

    def test_balance_below_buffer_blocks_everything(self) -> None:
        """§7.4 balance < BUFFER at U = 0 → limit 0 → every call refused, never negative."""
        s = QuotaSettings(small_buffer=300_000)
        limits = model_day_limits(snap(200_000, 0), s)
        assert (effective_limit(snap(200_000, 0), s), decide(limits, 0, 1)) == ((0, "snapshot"), "evicted")


class TestSection75Invariant:
    """§7.5 at the block line real remaining = SMALL_BUFFER + reserve − L; the B0 < 2M day breaks v6."""

    @pytest.mark.parametrize(
        ("b0", "unsettled", "lag_aware", "cap", "remaining"),
        [
            (1_500_000, 0, False, 1_450_000, 54_096),  # §7.5 L = 0: remaining S + reserve > 0, never charged
            (1_500_000, 149_616, False, 1_599_616, -95_520),  # §7.5 B0 < 2M, L = 149,616 > S: v6 charges
            (1_500_000, 149_616, True, 1_450_000, 54_096),  # lag >= Δ removes L: back to S + reserve
            (
                B0_0813,
                149_616,
                False,
                2_000_000,
                246_274,
            ),  # §7.5 08-13: the static 2M wall saves v6 (242,178 left)
            (B0_0813, 149_616, True, 2_000_000, 246_274),
        ],
    )
    def test_block_line(self, b0: int, unsettled: int, lag_aware: bool, cap: int, remaining: int) -> None:
        """The remaining free balance where the seed blocks (usage = cap − reserve) matches the notes."""
        reserve, settled = 4_096, 515_652  # settled: usage billing had already deducted at the sync
        s = QuotaSettings(balance_lag_s=14 * MIN if lag_aware else 0)
        limits = model_day_limits(snap(b0 - settled, settled + unsettled, settled), s)
        line = limits[0].cap - reserve
        assert (limits[0].cap, b0 - line) == (cap, remaining)

    @pytest.mark.parametrize(("b0", "unsettled"), [(1_500_000, 0), (1_500_000, 149_616)])
    def test_formula(self, b0: int, unsettled: int) -> None:
        """§7.5 with the snapshot binding, remaining at the block line is exactly S + reserve − L."""
        reserve, settled = 4_096, 515_652
        cap = effective_limit(snap(b0 - settled, settled + unsettled), V6)[0]
        assert b0 - (cap - reserve) == V6.small_buffer + reserve - unsettled

    def test_one_token_boundary(self) -> None:
        """The seed blocks at usage + reserve >= limit; a hold fits at == cap and refuses one token more."""
        limits = model_day_limits(snap(1_500_000, 0), V6)
        assert (decide(limits, 1_450_000 - 4_096, 4_096), decide(limits, 1_450_000 - 4_095, 4_096)) == (
            "fits",
            "over_limit",
        )


class TestSection76Reserve:
    """§7.6 08-12 20:53: a single 176,571-token request pushed usage past 2M (2,050,826 at the sync)."""

    LIMITS = model_day_limits(snap(596_869, 1_696_135), V6)  # 20:33 sync: B0 = 596,869 + 1,696,135

    @pytest.mark.parametrize(
        ("settled", "in_flight", "reserve", "reason"),
        [
            (1_800_000, 0, 50_000, "fits"),  # old reserve: 1,850,000 < 2M → PASS
            (
                1_976_571,
                0,
                50_000,
                "evicted",
            ),  # after +176,571: past the 1.95M usage wall, 429 before counting
            (1_800_000, 0, 250_000, "over_limit"),  # new reserve: 200k input + 50k undeclared output, blocked
            (
                1_800_000,
                0,
                200_000 + max(16, 4_096),
                "over_limit",
            ),  # 200k input + thinking floor 4096, blocked
            (1_800_000, 0, 126_000 + 50_000, "fits"),  # §7.6 'input ≥ 150k only': 126k still passes at 1.8M
            (
                1_800_000,
                0,
                150_000 + 50_000,
                "fits",
            ),  # 150k + 50k lands on 2M: the seed blocks (>=), a hold fits
            (1_800_000, 176_571, 50_000, "over_limit"),  # 并发击穿: the in-flight call now counts at the gate
            (2_050_826, 0, 1, "evicted"),  # 20:53:35 usage 2,050,826 = 2M + 50,826
        ],
    )
    def test_gate(self, settled: int, in_flight: int, reserve: int, reason: str) -> None:
        """The pre-gate and the walls decide the 20:53 requests as §7.6 describes (plus in-flight)."""
        assert decide(self.LIMITS, settled, reserve, in_flight) == reason

    def test_seed_gate_alone_blocks_the_next_request(self) -> None:
        """§7.6 without walls the hold alone refuses 1,976,571 + 50,000 = 2,026,571 > 2M."""
        assert decide(self.LIMITS[:1], 1_976_571, 50_000) == "over_limit"

    def test_old_reserve_overruns(self) -> None:
        """§7.6 the admitted request's 176,571 beat its 50,000 reserve: the hold can then be exceeded."""
        assert decide(self.LIMITS[:1], 1_800_000, 50_000) == "fits" and 1_800_000 + 176_571 == 1_976_571

    @pytest.mark.parametrize("actual", [167, 150])
    def test_thinking_case(self, actual: int) -> None:
        """§7.6 '彩虹有几种颜色': 18 + 16 = 34 under-reserves +167/+150; 18 + max(16, 4096) covers it."""
        old, new = 18 + 16, 18 + max(16, 4_096)
        near_cap = self.LIMITS[0].cap - 100
        assert (
            old < actual <= new,
            decide(self.LIMITS[:1], near_cap, old),
            decide(self.LIMITS[:1], near_cap, new),
        ) == (True, "fits", "over_limit")

    @pytest.mark.parametrize(
        ("t", "balance", "lag_s", "pool"),
        [
            (bj(20, 33, day=12), 596_869, 0, B0_0812),  # 20:33 B0 = 596,869 + 1,696,135
            (bj(20, 53, 35, day=12), 596_771, 0, 2_647_597),  # 20:53 v6: inflated by 354,593 unsettled tokens
            (bj(20, 53, 35, day=12), 596_771, 15 * MIN, B0_0812),  # lag 15 min reads 1,696,233: B0 exactly
            (bj(20, 53, 35, day=12), 596_771, 30 * MIN, 2_292_906),  # default lag: B0 − 98, the safe side
            (bj(23, 18, 59, day=12), 242_178, 0, B0_0812),  # 23:18:59 converged: 242,178 + 2,050,826
            (bj(23, 18, 59, day=12), 242_178, 30 * MIN, B0_0812),
        ],
    )
    def test_sync_pools(self, t: float, balance: int, lag_s: float, pool: int) -> None:
        """§7.6 'B0 守恒' check: lagged snapshots inflate under v6 and come back to 2,293,004 with a lag."""
        assert pool_estimate(synced(t, balance, SERIES_0812, lag_s), QuotaSettings(balance_lag_s=lag_s)) == pool

    def test_consume_task_clamp(self) -> None:
        """§8.4 plan ≤ min(2M − usage, b0_est − S − usage) is the hold's headroom: 303,865 at 1,696,135."""
        plan = min(2_000_000 - 1_696_135, (596_869 + 1_696_135) - 50_000 - 1_696_135)
        assert (
            plan,
            decide(self.LIMITS[:1], 1_696_135, plan),
            decide(self.LIMITS[:1], 1_696_135, plan + 1),
        ) == (
            303_865,
            "fits",
            "over_limit",
        )


class TestSoftEvict:
    """§7.6 soft-evict: usage wall min(effective, 1.95M), balance wall 100,000 with usage > 0; 9/9 cases."""

    CASES: ClassVar[list[tuple[str, int, int, int, bool]]] = [
        ("不踢 ordinary day", 1_000_000, 2_000_000, 1_500_000, False),
        ("踢 usage wall 1.95M reached", 1_950_000, 2_000_000, 1_500_000, True),
        ("不踢 one token below the usage wall", 1_949_999, 2_000_000, 1_500_000, False),
        ("动态墙取 min: small pool, wall at the effective limit", 1_200_000, 1_200_000, 1_250_000, True),
        ("动态墙取 min: one token below a small effective limit", 1_199_999, 1_200_000, 1_250_000, False),
        ("踢 balance wall: balance < 100k and used", 500, 2_000_000, 99_999, True),
        ("死锁防护: B0 < 100k model not evicted before its first token", 0, 30_000, 80_000, False),
        ("不踢 balance exactly at the 100k wall", 500, 2_000_000, 100_000, False),
        (
            "防抖动: the evicted low-balance model stays evicted at the next check",
            10,
            2_000_000,
            90_000,
            True,
        ),
    ]

    @pytest.mark.parametrize(("name", "usage", "effective", "balance", "evict"), CASES, ids=[c[0] for c in CASES])
    def test_case(self, name: str, usage: int, effective: int, balance: int, evict: bool) -> None:
        """should_soft_evict matches the notes' case; should_restore is its exact negation (no flapping)."""
        verdicts = (
            should_soft_evict(usage, effective, balance, DEFAULT),
            should_restore(usage, effective, balance, DEFAULT),
        )
        assert verdicts == (evict, not evict)

    def test_nine_cases(self) -> None:
        """§7.6 '9/9 场景' are all here."""
        assert len(self.CASES) == 9

    def test_no_sync_no_balance_wall(self) -> None:
        """Without a balance reading only the usage wall applies."""
        assert [w.name for w in soft_evict_walls(2_000_000, None, DEFAULT)] == ["usage_wall"]

    def test_walls_are_configurable(self) -> None:
        """SOFT_EVICT_USAGE_LIMIT / SOFT_EVICT_BALANCE_LIMIT are settings."""
        s = QuotaSettings(usage_wall=1_900_000, balance_wall=300_000)
        assert (
            should_soft_evict(1_900_000, 2_000_000, None, s),
            should_soft_evict(1, 2_000_000, 250_000, s),
        ) == (
            True,
            True,
        )

    @given(
        balance=st.integers(0, 3_000_000),
        at_sync=st.integers(0, 2_500_000),
        usage=st.integers(0, 2_500_000),
        lag=st.sampled_from([0.0, 1800.0]),
    )
    def test_limits_agree_with_should_soft_evict(self, balance: int, at_sync: int, usage: int, lag: float) -> None:
        """The walls in model_day_limits evict exactly when should_soft_evict says so."""
        s = QuotaSettings(balance_lag_s=lag)
        snapshot = snap(balance, at_sync)
        limits = model_day_limits(snapshot, s)
        walled = evicted_by(limits, {"model_day": Counters(usage)}) is not None
        assert walled == should_soft_evict(usage, effective_limit(snapshot, s)[0], balance, s)

    def test_evicted_answered_before_counting(self) -> None:
        """§7.6 short-circuit: an evicted model is refused with reason 'evicted' whatever the reserve."""
        limits = model_day_limits(snap(1_500_000, 600_000), V6)
        assert (decide(limits, 1_960_000, 0), decide(limits, 1_960_000, 10**9)) == ("evicted", "evicted")


class TestEffectiveLimit:
    @pytest.mark.parametrize(
        ("snapshot", "expected"),
        [
            (None, (2_000_000, "daily_cap")),  # no sync: the collection cap alone
            (snap(20_000, 0), (0, "snapshot")),  # pool below SMALL_BUFFER: 0, never negative
            (snap(2_050_000, 0), (2_000_000, "daily_cap")),  # tie: the daily cap is named
            (snap(1_000_000, 300_000), (1_250_000, "snapshot")),
        ],
    )
    def test_cap_and_binding_term(self, snapshot: Snapshot | None, expected: tuple[int, str]) -> None:
        """effective = min(daily_cap, pool − small_buffer) >= 0 and names the binding term."""
        assert effective_limit(snapshot, V6) == expected

    def test_daily_cap_configurable(self) -> None:
        """The collection cap is a setting."""
        assert effective_limit(snap(3_000_000, 0), QuotaSettings(daily_cap=1_000_000)) == (
            1_000_000,
            "daily_cap",
        )

    def test_lag_setting_zero_ignores_stored_lagged_usage(self) -> None:
        """With lag 0 the pool is balance + usage_at_sync whatever was stored as lagged."""
        assert pool_estimate(snap(1_000_000, 300_000, 100_000), V6) == 1_300_000

    def test_lag_setting_uses_stored_lagged_usage(self) -> None:
        """With a lag the pool is balance + the stored lagged usage."""
        assert pool_estimate(snap(1_000_000, 300_000, 100_000), DEFAULT) == 1_100_000


class TestModelDayLimits:
    def test_shape(self) -> None:
        """A hold at the effective limit, usage wall at min(effective, 1.95M), balance wall at cap 1."""
        limits = model_day_limits(snap(90_000, 200_000, 200_000), DEFAULT)
        assert [(x.name, x.scope, x.kind, x.cap) for x in limits] == [
            ("snapshot", "model_day", "hold", 240_000),
            ("usage_wall", "model_day", "wall", 240_000),
            ("balance_wall", "model_day", "wall", 1),
        ]

    def test_detail_explains_the_numbers(self) -> None:
        """The hold's detail names the balance, the lagged usage and the buffer."""
        hold = model_day_limits(synced(bj(11, 22), 1_726_526, SERIES_0813, 30 * MIN), DEFAULT)[0]
        assert all(part in hold.detail for part in ("1,726,526", "11:22", "30 min", "50,000", "1,676,526"))

    def test_no_snapshot(self) -> None:
        """Without a sync: the daily cap and the usage wall at 1.95M."""
        assert [(x.name, x.cap) for x in model_day_limits(None, DEFAULT)] == [
            ("daily_cap", 2_000_000),
            ("usage_wall", 1_950_000),
        ]


class TestRunLimits:
    def test_none(self) -> None:
        """No run cap, no run limit."""
        assert run_limits(None) == []

    def test_cap(self) -> None:
        """A run cap is a hold on the run scope and composes with the model-day limits."""
        limits = [*run_limits(1_000), *model_day_limits(None, DEFAULT)]
        counters = {"run": Counters(900, 50), "model_day": Counters(0, 0)}
        assert (limits[0].scope, verdict(limits, counters, 51).blocking) == ("run", limits[0])

    def test_negative(self) -> None:
        """A negative run cap is a configuration error."""
        with pytest.raises(ConfigError):
            run_limits(-1)


class TestQuotaSettings:
    def test_defaults(self) -> None:
        """The notes' constants: 2M cap, 50k buffer, 1.95M and 100k walls; a 30-minute lag (2 × Δ)."""
        s = QuotaSettings()
        assert (s.daily_cap, s.small_buffer, s.usage_wall, s.balance_wall, s.balance_lag_s) == (
            2_000_000,
            50_000,
            1_950_000,
            100_000,
            1800.0,
        )

    @pytest.mark.parametrize(
        "changes",
        [{"small_buffer": -1}, {"daily_cap": 1.5}, {"balance_lag_s": -1.0}, {"balance_lag_s": 86_400.0}],
    )
    def test_invalid(self, changes: dict[str, float]) -> None:
        """Negative or fractional token counts and impossible lags are refused as configuration errors."""
        with pytest.raises(ConfigError):
            QuotaSettings(**changes)  # type: ignore[arg-type]


class TestCalibrateLag:
    def test_section_4_2(self) -> None:
        """§4.2 the 11:08/11:22 syncs give Δ = 14 min, spread = the 115-token residual."""
        syncs = [(bj(11, 8), 2_242_063), (bj(11, 22), 1_726_526)]
        assert calibrate_lag(syncs, SERIES_0813) == (840.0, 115.0)

    def test_evening_08_12(self) -> None:
        """§7.6 the 20:33/20:53:35/23:18:59 syncs fit exactly for lags up to 15 min (ties go long)."""
        syncs = [
            (bj(20, 33, day=12), 596_869),
            (bj(20, 53, 35, day=12), 596_771),
            (bj(23, 18, 59, day=12), 242_178),
        ]
        assert calibrate_lag(syncs, SERIES_0812) == (900.0, 0.0)

    def test_v6_fits_worse(self) -> None:
        """The lag-0 (v6) reading leaves the 08-13 pools 365,921 apart."""
        day = CalibrationDay([(bj(11, 8), 2_242_063), (bj(11, 22), 1_726_526)], SERIES_0813)
        assert lag_fit([day], [0, 840]) == [(0.0, 365_921, 365_921), (840.0, 115, 115)]

    def test_synthetic_day(self) -> None:
        """A bursty day with a true 14-minute delay and a per-minute series calibrates to 14 min, spread 0."""
        rng = random.Random(7)
        b0, delta = 1_800_000, 14 * MIN
        events = [(bj(8) + m * MIN + 17, rng.choice([0, 0, 50, 900, 12_000])) for m in range(600)]
        series: list[tuple[float, int]] = []
        total = 0
        for t, tokens in events:
            total += tokens
            series.append((t - 17, total))  # SQLite ledger stamps the minute's start
        syncs = [
            (t, b0 - sum(n for e, n in events if e <= t - delta)) for t in (bj(9) + k * 420 + 45 for k in range(60))
        ]
        assert calibrate_lag(syncs, series) == (840.0, 0.0)

    def test_ties_go_to_the_safe_side(self) -> None:
        """With nothing used around the syncs every lag fits: the largest candidate is reported."""
        assert calibrate_lag([(bj(11), 900_000), (bj(12), 900_000)], [(bj(8), 100_000)], [0, 60, 120]) == (
            120.0,
            0.0,
        )

    def test_needs_two_syncs(self) -> None:
        """One sync cannot show a lag."""
        with pytest.raises(ValueError, match="two balance syncs"):
            calibrate_lag([(bj(11), 900_000)], [])

    def test_several_days(self) -> None:
        """Spreads add up across days; the worst day's spread is reported."""
        d13 = CalibrationDay([(bj(11, 8), 2_242_063), (bj(11, 22), 1_726_526)], SERIES_0813)
        d12 = CalibrationDay([(bj(20, 33, day=12), 596_869), (bj(20, 53, 35, day=12), 596_771)], SERIES_0812)
        assert calibrate_lag_days([d12, d13, CalibrationDay([], [])]) == (840.0, 115.0)


class TestKeepAlive:
    NOW = bj(12)

    def pkg(self, available: int, days: float, model: str = "deepseek-v4-flash") -> Package:
        return Package(model, available, self.NOW + days * 86_400)

    def test_2m_over_30_days(self) -> None:
        """§1.3 a fresh 2M package is used up by 2M/30 = 66,667 tokens a day."""
        assert drain_daily_usage([self.pkg(2_000_000, 30)], self.NOW) == 66_667

    def test_fifo_counts_earlier_packages(self) -> None:
        """§1.2 FIFO: a later package is reached only after the earlier ones; the tightest deadline wins."""
        assert drain_daily_usage([self.pkg(2_000_000, 8), self.pkg(100_000, 2)], self.NOW) == 262_500

    def test_nine_day_window(self) -> None:
        """§1.3 only packages expiring within 9 days are reported, per model, soonest first."""
        packages = [
            self.pkg(2_000_000, 30),
            self.pkg(500_000, 9),
            self.pkg(90_000, 3),
            self.pkg(10, 5, "doubao"),
        ]
        advice = keep_alive_daily_usage(packages, self.NOW)
        assert [(a.model, a.expiring_tokens, a.first_expiry_at, a.daily_usage) for a in advice] == [
            ("deepseek-v4-flash", 590_000, self.NOW + 3 * 86_400, 65_556),
            ("doubao", 10, self.NOW + 5 * 86_400, 2),
        ]

    def test_nothing_expiring(self) -> None:
        """No advice when nothing expires within the window, or it already expired or is empty."""
        assert keep_alive_daily_usage([self.pkg(2_000_000, 30), self.pkg(5, -1), self.pkg(0, 2)], self.NOW) == []


# -- the guarantee: a simulated day ----------------------------------------------------------------

DAY0 = bj(0)
TODAY = "2026-08-13"


@dataclass(frozen=True)
class Step:
    kind: str  # "sync" | "call" | "fill" (a call reserving all the headroom left) | "expire" | "arrive"
    dt: int  # seconds after the previous step
    amount: int = 0  # call: reserve; expire/arrive: tokens
    actual: int = 0  # call: tokens it really uses (<= reserve)
    duration: int = 0  # call: seconds until it settles


@dataclass
class Outcome:
    admitted: int = 0
    refused: int = 0
    usage: int = 0
    guard_margin: int = 10**12  # min over settlements of max(0, best synced pool − S) − usage
    free_margin: int = 10**12  # min over settlements of the true free balance (< 0: charged)
    refusals: list[str] = field(default_factory=list)


def _stamp(series: list[tuple[float, int]], t: float, cumulative: int) -> None:
    minute = t // MIN * MIN  # the SQLite ledger's per-minute series, stamped at the minute's start
    if series and series[-1][0] == minute:
        series[-1] = (minute, cumulative)
    else:
        series.append((minute, cumulative))


def simulate(
    b0: int,
    delta_s: int,
    quota: QuotaSettings,
    steps: Sequence[Step],
    yesterday_tail: Sequence[tuple[int, int]] = (),
    *,
    expiry_budget: int | None = None,
    read_yesterday: bool = True,
) -> Outcome:
    """One Beijing day of one model: Volc bills at settlement and shows it `delta_s` later (§4.2).

    ``b0`` is today's true free pool at midnight; ``yesterday_tail`` are (seconds before midnight,
    tokens) of yesterday's last calls, possibly still unsettled in the balance after midnight.
    Expiries total at most ``expiry_budget`` (default SMALL_BUFFER, §7.5's assumption);
    ``read_yesterday=False`` is the naive lag reading that sees only today's series.
    """
    budget = quota.small_buffer if expiry_budget is None else expiry_budget
    tail = sorted((DAY0 - back, tokens) for back, tokens in yesterday_tail)
    yesterday_events = [(DAY0 - 20 * 3600, 700_000), *tail]  # 700,000 settled long before midnight
    yesterday_series: list[tuple[float, int]] = []
    running = 0
    for t, tokens in yesterday_events:
        running += tokens
        _stamp(yesterday_series, t, running)
    today_events: list[tuple[float, int]] = []
    today_series: list[tuple[float, int]] = []
    pending: list[tuple[float, int, int, int]] = []
    out = Outcome()
    now, in_flight, arrived, expired, seq = DAY0, 0, 0, 0, 0
    snapshot: Snapshot | None = None
    best_pool = 0

    def billed_by(x: float) -> int:
        return sum(n for t, n in yesterday_events if t <= x) + sum(n for t, n in today_events if t <= x)

    def settle_until(x: float) -> None:
        nonlocal in_flight
        while pending and pending[0][0] <= x:
            end, _, reserve, actual = heapq.heappop(pending)
            in_flight -= reserve
            out.usage += actual
            today_events.append((end, actual))
            _stamp(today_series, end, out.usage)
            out.guard_margin = min(out.guard_margin, max(0, best_pool - quota.small_buffer) - out.usage)
            out.free_margin = min(out.free_margin, b0 + arrived - expired - out.usage)

    for step in steps:
        now += step.dt
        settle_until(now)
        if step.kind == "sync":
            shown = b0 + running + arrived - expired - billed_by(now - delta_s)  # running = yesterday's total
            previous = yesterday_series if read_yesterday else []
            lagged = lagged_usage(now, quota.balance_lag_s, out.usage, today_series, previous)
            snapshot = Snapshot(max(0, shown), out.usage, lagged, now, TODAY, "billing-api")
            best_pool = max(best_pool, b0 + arrived - expired)
        elif step.kind == "arrive":
            arrived += step.amount
        elif step.kind == "expire":
            # §7.5 SMALL_BUFFER covers expiry; a package cannot lose more than is left in it
            expired += min(step.amount, budget - expired, max(0, b0 + arrived - expired - out.usage))
        else:
            limits = model_day_limits(snapshot, quota, today=TODAY)
            reserve, actual = step.amount, step.actual
            if step.kind == "fill":  # the worst case: take every token the hold still allows, and use it
                reserve = actual = max(1, limits[0].cap - out.usage - in_flight)
            decision = verdict(limits, {"model_day": Counters(out.usage, in_flight)}, reserve)
            if decision.allowed:
                out.admitted += 1
                in_flight += reserve
                seq += 1
                heapq.heappush(pending, (now + step.duration, seq, reserve, actual))
            else:
                out.refused += 1
                out.refusals.append(decision.reason)
    settle_until(float("inf"))
    return out


@st.composite
def days(draw: st.DrawFn) -> list[Step]:
    steps = [Step("sync", 0)]  # the guard syncs before the day's first call
    for _ in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from(["call", "call", "call", "fill", "sync", "sync", "expire", "arrive"]))
        dt = draw(st.one_of(st.integers(0, 120), st.integers(0, 1200)))  # bursts inside the lag, and gaps
        duration = draw(st.one_of(st.integers(0, 60), st.integers(0, 2400)))
        if kind == "call":
            reserve = draw(st.integers(1, 900_000))
            actual = draw(st.one_of(st.just(reserve), st.integers(0, reserve)))
            steps.append(Step("call", dt, reserve, actual, duration))
        elif kind == "fill":
            steps.append(Step("fill", dt, duration=duration))
        elif kind == "sync":
            steps.append(Step("sync", dt))
        else:
            steps.append(Step(kind, dt, draw(st.integers(0, 400_000 if kind == "arrive" else 60_000))))
    return steps


class TestGuarantee:
    """lag >= true delay, actual <= reserve ⇒ usage never exceeds B0 − SMALL_BUFFER (docs/quota-math.md)."""

    @settings(max_examples=300, deadline=None)
    @given(
        b0=st.one_of(st.integers(0, 2_600_000), st.sampled_from([1_500_000, B0_0813, 2_050_000])),
        delta=st.integers(0, 40 * MIN),
        extra_lag=st.integers(0, 30 * MIN),
        small_buffer=st.sampled_from([0, 50_000, 150_000]),
        tail=st.lists(st.tuples(st.integers(1, 3600), st.integers(0, 300_000)), max_size=4),
        steps=days(),
    )
    def test_never_charged(
        self,
        b0: int,
        delta: int,
        extra_lag: int,
        small_buffer: int,
        tail: list[tuple[int, int]],
        steps: list[Step],
    ) -> None:
        """Any interleaving of calls, syncs, expiries (≤ SMALL_BUFFER) and arrivals stays in the free pool."""
        quota = QuotaSettings(small_buffer=small_buffer, balance_lag_s=delta + extra_lag)
        out = simulate(b0, delta, quota, steps, tail)
        assert out.guard_margin >= 0  # usage <= best synced pool − SMALL_BUFFER
        assert out.free_margin >= 0  # never billed at real price
        assert out.usage <= quota.daily_cap

    @settings(max_examples=100, deadline=None)
    @given(b0=st.integers(0, 2_600_000), delta=st.integers(0, 30 * MIN), steps=days())
    def test_no_package_events_b0_minus_buffer(self, b0: int, delta: int, steps: list[Step]) -> None:
        """Without expiries or arrivals the day's usage is at most max(0, B0 − 50,000) at the default lag."""
        steps = [s for s in steps if s.kind in ("sync", "call", "fill")]
        out = simulate(b0, delta, DEFAULT, steps)
        assert out.usage <= max(0, b0 - DEFAULT.small_buffer)


class TestLagMatters:
    """§7.5 remaining risk 1, as a regression: v6 (lag 0) charges on a B0 < 2M day with L > SMALL_BUFFER."""

    # §4.2's 08-13 morning on a 1,500,000 pool: 115 settled by 11:08, 515,652 by 11:22, L = 149,616 at 11:22
    MORNING: ClassVar[list[Step]] = [
        Step("sync", 0),
        Step("call", int(bj(10, 50) - DAY0), 115, 115),
        Step("call", 10 * MIN, 515_537, 515_537),  # 11:00
        Step("sync", 8 * MIN),  # 11:08: Bal = B0 − 115
        Step("call", 7 * MIN, 149_616, 149_616),  # 11:15
        Step("sync", 7 * MIN),  # 11:22: Bal = B0 − 515,652, usage 665,268
        Step("call", 0, 934_348, 934_348),  # fills v6's limit 1,599,616 exactly
    ]

    def test_v6_charges(self) -> None:
        """Lag 0: the 934,348-token call is admitted and usage ends 99,616 = L − S past the free pool."""
        out = simulate(1_500_000, 14 * MIN, V6, self.MORNING)
        assert (out.admitted, out.usage, out.free_margin, out.guard_margin) == (
            4,
            1_599_616,
            -99_616,
            -149_616,
        )

    def test_lag_aware_refuses(self) -> None:
        """The default 30-minute lag refuses that call: the pool is read as B0 − unsettled, never B0 + L."""
        out = simulate(1_500_000, 14 * MIN, DEFAULT, self.MORNING)
        assert (out.admitted, out.refusals, out.usage) == (3, ["over_limit"], 665_268) and out.free_margin > 0

    def test_lag_below_delta_is_not_covered(self) -> None:
        """A lag shorter than the true delay re-opens the hole: the guarantee needs lag >= Δ."""
        out = simulate(1_500_000, 14 * MIN, QuotaSettings(balance_lag_s=5 * MIN), self.MORNING)
        assert out.free_margin < 0

    def test_day_boundary_needs_yesterdays_tail(self) -> None:
        """A 00:05 sync still shows yesterday's unsettled 23:55 usage: today's series alone overspends."""
        steps = [Step("sync", 5 * MIN), Step("call", 0, 1_570_000, 1_570_000)]  # naive cap 1,620,000 − 50,000
        lagged = simulate(1_500_000, 14 * MIN, DEFAULT, steps, [(5 * MIN, 120_000)])
        naive = simulate(1_500_000, 14 * MIN, DEFAULT, steps, [(5 * MIN, 120_000)], read_yesterday=False)
        assert (lagged.refusals, naive.admitted, naive.free_margin) == (["over_limit"], 1, -70_000)

    def test_expiry_beyond_small_buffer(self) -> None:
        """§7.5 remaining risk 2: an expiry above SMALL_BUFFER during a call admitted at the limit charges."""
        steps = [Step("sync", 0), Step("call", 60, 1_450_000, 1_450_000, 3600), Step("expire", 60, 80_000)]
        covered = simulate(1_500_000, 0, DEFAULT, steps)
        beyond = simulate(1_500_000, 0, DEFAULT, steps, expiry_budget=80_000)
        assert (covered.free_margin, beyond.free_margin) == (0, -30_000)


class TestZeroLimitNamesItself:
    def test_daily_cap_zero_is_named_daily_cap(self) -> None:
        """--daily-cap 0 evicts at once, and the refusal names daily_cap (raise it there), not usage_wall."""
        limits = model_day_limits(None, QuotaSettings(daily_cap=0))
        decision = verdict(limits, {"model_day": Counters()}, 1)
        assert decision.blocking is not None and decision.blocking.name == "daily_cap"
        assert [limit.name for limit in limits] == ["daily_cap", "daily_cap"]
