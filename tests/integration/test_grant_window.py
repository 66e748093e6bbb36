"""The 0:00-to-grant window (notes §1.1): 150k left at midnight, yesterday's return lands at 09:30.

Runs bench/day_simulation.py's own core on that scenario: real simulator and billing SDK, real
guard, ledger and sync loop, on a simulated clock. Between midnight and the grant the only free
pool is what was left; the guard must hold the day inside it, then open up once the grant is synced.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from quotawrap.core import quota
from tests.conftest import load_bench

GRANT_S = 9.5 * 3600


day = load_bench("day_simulation.py", "day_simulation_grant")
SCENARIO = next(s for s in day.SCENARIOS if "grant 09:30" in s.name)


@pytest.fixture(scope="module")
def lag_aware() -> Any:
    """The grant scenario under the shipped lag-aware limit, on the default seed's traffic."""
    traffic = day.make_traffic(day.DEFAULT_SEED)
    with tempfile.TemporaryDirectory() as tmp:
        return day.run_variant(SCENARIO, traffic, "lag-aware", day.LAG_AWARE_S, Path(tmp))


class TestGrantWindow:
    def test_nothing_is_charged_beyond_the_free_pool(self, lag_aware: Any) -> None:
        """0 tokens billed at the real price over the whole day, grant window included."""
        assert SCENARIO.b0 == 150_000
        assert lag_aware.overspend == 0

    def test_before_the_grant_the_day_stays_inside_what_was_left(self, lag_aware: Any) -> None:
        """Until 09:30 the bill stays within 150k - S, although the traffic wanted more."""
        before = sum(tokens for t, tokens in lag_aware.bills if t < GRANT_S)
        assert before <= SCENARIO.b0 - quota.QuotaSettings().small_buffer
        assert lag_aware.first_block_s < GRANT_S  # the demand was there: the guard held it back

    def test_the_grant_is_used_once_synced(self, lag_aware: Any) -> None:
        """After the grant the model is open again and most of the day's usable pool is used."""
        after = sum(tokens for t, tokens in lag_aware.bills if t >= GRANT_S)
        assert after > 1_000_000
        assert lag_aware.pool_used >= 0.9
