"""Keep-alive advice capped at the daily cap, and what expires anyway (quotawrap.core.expiry)."""

from __future__ import annotations

from quotawrap.core import expiry, quota

DAY = quota.DAY_S


def _pkg(tokens: int, days: float) -> quota.Package:
    return quota.Package("m", tokens, days * DAY)


class TestExpiringAtRate:
    def test_three_2m_packages_in_two_days_lose_2m_at_the_cap(self) -> None:
        """At 2M a day, two days draw 4M of the 6M that expire: 2M is lost."""
        assert expiry.expiring_at_rate([_pkg(2_000_000, 2)] * 3, 0.0, 2_000_000) == 2_000_000

    def test_fifo_later_packages_use_capacity_left_by_earlier(self) -> None:
        """A package drawn empty early leaves the rest of the rate to the next one; nothing is lost."""
        assert expiry.expiring_at_rate([_pkg(100_000, 1), _pkg(1_000_000, 10)], 0.0, 200_000) == 0

    def test_an_expired_remainder_takes_no_capacity(self) -> None:
        """What the first package loses at its expiry does not eat into the second one's drawing."""
        # 1M expires in 1 day at 200k/day: 800k lost; the second (300k in 2 days) gets the second day's 200k
        assert expiry.expiring_at_rate([_pkg(1_000_000, 1), _pkg(300_000, 2)], 0.0, 200_000) == 800_000 + 100_000


class TestCappedAdvice:
    def test_advice_never_asks_past_the_cap(self) -> None:
        """The seed's example: 'use 3,000,000 a day' becomes the cap plus a plain shortfall."""
        (advice,) = expiry.keep_alive_daily_usage([_pkg(2_000_000, 2)] * 3, 0.0)
        assert advice.daily_usage == 3_000_000 and advice.advised_daily_usage == 2_000_000
        assert advice.shortfall == 2_000_000
        assert advice.text() == (
            "use 2,000,000 a day (the daily cap; 3,000,000 would be needed): even so 2,000,000 tokens expire unused"
        )

    def test_reachable_advice_has_no_shortfall(self) -> None:
        """The gift package below the cap: 2M over 9 days, 222,223 a day, nothing lost."""
        (advice,) = expiry.keep_alive_daily_usage([_pkg(2_000_000, 9)], 0.0)
        assert advice.shortfall == 0 and advice.advised_daily_usage == advice.daily_usage == 222_223
        assert advice.text() == "use 222,223 a day to consume them before they expire"

    def test_a_lower_cap_is_honoured(self) -> None:
        """A configured daily cap is the advice's ceiling."""
        (advice,) = expiry.keep_alive_daily_usage([_pkg(2_000_000, 9)], 0.0, daily_cap=100_000)
        assert advice.advised_daily_usage == 100_000 and advice.shortfall == 2_000_000 - 900_000


def test_expiring_before_the_next_sync() -> None:
    """Live packages expiring by the horizon; expired ones and later ones are not."""
    gone = expiry.expiring_before([_pkg(1, -1), _pkg(2, 0.5), _pkg(3, 2)], 0.0, DAY)
    assert [p.available for p in gone] == [2]
