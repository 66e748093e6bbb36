"""A ledger's reasoning history is the rule (`reasoning_samples` over the call records), read cheaply."""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotawrap.core.usage import Usage
from quotawrap.ledger import Ledger, open_ledger
from quotawrap.ledger.reasoning import reasoning_samples
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from tests.conftest import hold_request
from tests.redis_server import flushed, session_url

MODELS = ("model-a", "model-b")
# What becomes of one call: settled with its usage, settled with no usage known (charged whole),
# released before generation, or still in flight
OUTCOMES = ("settle", "unknown", "release", "open")


def _call(ledger: Ledger, model: str, endpoint: str, outcome: str, reasoning: int | None) -> None:
    hold = hold_request(model, endpoint=endpoint, enforce=False)
    hold_id = ledger.reserve(hold, lambda _snapshot: []).hold_id
    if outcome == "settle":
        ledger.settle(hold_id, Usage(10, 20, 30, reasoning_tokens=reasoning or 0))
    elif outcome == "unknown":
        ledger.settle(hold_id, None)
    elif outcome == "release":
        ledger.release(hold_id)


calls = st.lists(
    st.tuples(
        st.sampled_from(MODELS),
        st.sampled_from(("chat", "chat", "embeddings")),
        st.sampled_from(OUTCOMES),
        st.integers(0, 9),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(calls, st.integers(0, 25), st.integers(1, 6))
def test_the_query_is_the_rule(generated: list[tuple[str, str, str, int]], since_index: int, limit: int) -> None:
    """On generated ledgers (each call started a second after the one before), per model and window."""
    ticks = itertools.count(1_800_000_000)
    with tempfile.TemporaryDirectory() as directory:
        ledger = SQLiteLedger(Path(directory) / "ledger.sqlite3", clock=lambda: float(next(ticks)))
        try:
            for model, endpoint, outcome, reasoning in generated:
                _call(ledger, model, endpoint, outcome, reasoning)
            since = 1_800_000_000 + since_index
            expected = reasoning_samples(ledger.call_records(since=since), limit)
            for model in MODELS:
                assert ledger.reasoning_history(model, since=since, limit=limit) == expected.get(model, [])
        finally:
            ledger.close()


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "sqlite":
        opened = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
        yield opened
        opened.close()
        return
    with session_url() as url:
        opened = open_ledger(flushed(url))
        yield opened
        opened.close()


def test_each_ledger_keeps_the_latest_settled_generating_calls(ledger: Ledger) -> None:
    """Oldest first, the latest `limit` of one model; other models, embeddings, releases, calls in
    flight and calls of unknown usage say nothing of its reasoning."""
    for reasoning in range(1, 8):
        _call(ledger, "model-a", "chat", "settle", reasoning * 100)
        _call(ledger, "model-b", "chat", "settle", reasoning)
        for outcome in ("unknown", "release", "open"):
            _call(ledger, "model-a", "chat", outcome, 99_999)
        _call(ledger, "model-a", "embeddings", "settle", 99_999)
    since = time.time() - 3600
    assert ledger.reasoning_history("model-a", since=since, limit=5) == [300, 400, 500, 600, 700]
    assert ledger.reasoning_history("model-b", since=since, limit=100) == [1, 2, 3, 4, 5, 6, 7]
    assert ledger.reasoning_history("model-c", since=since, limit=5) == []
    assert ledger.reasoning_history("model-a", since=time.time() + 60, limit=5) == []
