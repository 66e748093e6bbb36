"""The simulated day of bench/day_simulation.py: v6 pays real money on a B0 < 2M burst day, lag-aware does not.

Runs the script's own core (``run_day``) on its headline scenario only: one Beijing day, B0 = 1.5M,
billing 14 min behind, six bursts of 150k-400k tokens in 10-15 minutes, real simulator, real
guard, real ledger and real sync loop on a simulated clock.
"""

from __future__ import annotations

from typing import Any

import pytest

from quotawrap.core import quota
from quotawrap.simulator import BillRecord, PackageSpec
from tests.conftest import load_bench

day = load_bench("day_simulation.py", "day_simulation")


@pytest.fixture(scope="module")
def headline() -> dict[str, Any]:
    """The headline scenario's two runs, by variant name (v6 first, then lag-aware)."""
    v6, lag_aware = day.run_day(day.DEFAULT_SEED, (day.HEADLINE,))
    return {"v6": v6, "lag-aware": lag_aware}


class TestHeadline:
    def test_v6_is_charged_real_money(self, headline: dict[str, Any]) -> None:
        """v6's limit, inflated by the unsettled burst, lets usage run past B0: paid tokens."""
        v6 = headline["v6"]
        assert v6.balance_lag_s == 0
        assert v6.overspend > 0
        assert v6.overspend == v6.consumption - day.HEADLINE.b0  # no expiry: past B0 is paid
        assert v6.max_excess > v6.overspend  # the inflation L, of which S and the last slack were free

    def test_lag_aware_is_never_charged(self, headline: dict[str, Any]) -> None:
        """The lag-aware limit never stands above the true pool, so nothing is paid."""
        aware = headline["lag-aware"]
        assert aware.balance_lag_s == quota.QuotaSettings().balance_lag_s
        assert aware.overspend == 0
        assert aware.consumption <= day.HEADLINE.b0 - quota.QuotaSettings().small_buffer
        assert aware.max_excess <= 0

    def test_lag_aware_still_uses_the_pool(self, headline: dict[str, Any]) -> None:
        """Safety does not cost the pool: >= 95% of min(2M, B0 - S) is used (20-seed sweep minimum: 96.7%)."""
        aware = headline["lag-aware"]
        assert aware.usable_pool == day.HEADLINE.b0 - quota.QuotaSettings().small_buffer
        assert aware.pool_used >= 0.95
        assert aware.blocked > 0  # the day's demand exceeds the pool: the guard had to stop it

    def test_both_saw_the_same_traffic(self, headline: dict[str, Any]) -> None:
        """Identical calls reached both guards; only the decisions differ."""
        v6, aware = headline["v6"], headline["lag-aware"]
        assert v6.calls == aware.calls == len(day.make_traffic(day.DEFAULT_SEED))
        assert v6.blocked < aware.blocked

    def test_same_seed_same_numbers(self, headline: dict[str, Any]) -> None:
        """A second run of the seed reproduces the first run's every figure."""
        (again,) = day.run_day(day.DEFAULT_SEED, (day.HEADLINE,), day.VARIANTS[:1])
        assert again == headline["v6"]


class TestTraffic:
    def test_seeded(self) -> None:
        """Same seed, same calls; another seed, other calls."""
        assert day.make_traffic(7) == day.make_traffic(7)
        assert day.make_traffic(7) != day.make_traffic(8)

    def test_bursts_are_sized_like_the_notes(self) -> None:
        """Bursting calls exist and each reply fits its max_tokens (usage <= reservation)."""
        calls = day.make_traffic(day.DEFAULT_SEED)
        assert sum(call.burst for call in calls) > 0
        assert all(call.reply_tokens <= call.max_tokens for call in calls)
        assert [call.at_s for call in calls] == sorted(call.at_s for call in calls)


def _package(total: int, effective: float, expiry: float) -> PackageSpec:
    return PackageSpec(day.MODEL, total, day.DAY_START + effective, day.DAY_START + expiry)


def _bill(at: float, tokens: int) -> BillRecord:
    return BillRecord(day.DAY_START + at, day.MODEL, "/api/v3/chat/completions", tokens, 0)


class TestFreeAndPaid:
    def test_past_the_pool_is_paid(self) -> None:
        """One package: what goes past it is paid, nothing expires."""
        packages = [_package(1_000, -10, 10 * 86_400)]
        assert day.free_and_paid(packages, [_bill(1, 600), _bill(2, 600)]) == (200, 0, 1_000)

    def test_expired_remainder_is_lost_and_later_use_paid(self) -> None:
        """FIFO: the expiring package is drawn first; its remainder expires; use after is paid if nothing is left."""
        packages = [_package(1_000, -10, 3_600)]
        assert day.free_and_paid(packages, [_bill(1, 400), _bill(4_000, 100)]) == (100, 600, 400)

    def test_true_pool_drops_at_expiry(self) -> None:
        """P(t) loses an expiring package's remainder at its expiry, not before."""
        packages = [_package(1_000, -10, 3_600), _package(500, -10, 10 * 86_400)]
        bills = [_bill(1, 400)]
        assert day.true_pool(packages, bills, day.DAY_START + 3_599) == 1_500
        assert day.true_pool(packages, bills, day.DAY_START + 3_600) == 900
        assert day.free_left(packages, bills, day.DAY_START + 3_600) == 500


class TestIdealAdmits:
    def test_the_yardstick_uses_the_guards_limits(self) -> None:
        """Without lag the guard admits up to pool - S and evicts below the balance wall."""
        qs = quota.QuotaSettings()
        now = day.DAY_START + 3_600
        assert day.ideal_admits(1_000_000, 500_000, 400_000, now, qs)
        assert not day.ideal_admits(1_000_000, 500_000, 460_000, now, qs)  # past pool - S
        assert not day.ideal_admits(1_000_000, 90_000, 1_000, now, qs)  # balance wall
