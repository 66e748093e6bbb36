"""The stressed day of bench/day_simulation_stress.py: reasoning overshoot, calls in flight together,
batch settlement and grants during the day, and still nothing billed beyond the free packages."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import load_bench

stress = load_bench("day_simulation_stress.py", "day_simulation_stress")


@pytest.fixture(scope="module")
def lag_aware() -> Any:
    """The stressed day on the default seed under the shipped lag-aware limit."""
    with tempfile.TemporaryDirectory() as tmp:
        return stress.run_stress(stress.day.DEFAULT_SEED, "lag-aware", stress.day.LAG_AWARE_S, Path(tmp))


class TestStressedDay:
    def test_the_roughness_really_happened(self, lag_aware: Any) -> None:
        """Calls reasoned, several were in flight at once, and demand outran the pool; the guard's bound on
        reasoning (issue 9) kept every call within its hold, so none overshot."""
        assert lag_aware.reasoning_tokens > 0
        assert lag_aware.overshoot_calls == 0 and lag_aware.overshoot_tokens == 0
        assert lag_aware.max_in_flight > 1
        assert lag_aware.blocked > 0

    def test_nothing_is_billed_beyond_the_free_packages(self, lag_aware: Any) -> None:
        """0 tokens at the real price, with the grants of 09:30 and 15:00 used."""
        assert lag_aware.overspend == 0
        assert lag_aware.consumption > 150_000 + 1_200_000  # the grants were synced and spent
        assert lag_aware.pool_used >= 0.9
