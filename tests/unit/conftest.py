"""What several unit test modules share: a Guard installed over the simulator, a clock moved by hand."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.intercept import set_guard
from quotawrap.simulator import ArkSimulator


@pytest.fixture
def make_guard(store: str, sim: ArkSimulator) -> Iterator[Callable[..., Guard]]:
    """Install a Guard over the simulator with this test's private ledger (and these settings); gone after the test."""

    made: list[Guard] = []

    def make(**changes: Any) -> Guard:
        guard = Guard(Settings(**{"store": store, "base_url": (sim.url,), **changes}))
        set_guard(guard)
        made.append(guard)
        return guard

    yield make
    set_guard(None)
    for guard in made:  # a guard that answered retries from memory says so now, not at the runner's exit
        guard.retries.close()


@pytest.fixture
def guard(make_guard: Callable[..., Guard]) -> Guard:
    """``make_guard``'s Guard with the default settings."""
    return make_guard()


class FakeClock:
    """A clock tests move by hand (``clock.now += 60``)."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
