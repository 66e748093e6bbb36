"""The stressed day of bench/day_simulation_stress.py: reasoning overshoot, calls in flight together,
batch settlement and grants during the day, and still nothing billed beyond the free packages."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "day_simulation_stress.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("day_simulation_stress", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


stress = _load()


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
