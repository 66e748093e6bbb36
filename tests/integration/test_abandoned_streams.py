"""Issue 9, streams left unread but still referenced: read ahead, settled exactly, their room free for the next call.

The real `quotawrap` CLI runs tests/integration/children/ceiling_agent.py (the openai SDK, no retries) against
the bundled Ark simulator. The abandoned stream sets no output bound and reasons, so the guard sends it with
its no-history bound fitted to the cap's room: under ``--cap-tokens`` 9,000 the next call fits only once the
abandoned stream has settled, and with ``--wait 0`` a wait would show as a refusal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import cli_json, ledger_rows
from tests.integration.test_ceiling import _run

CAP = ["--cap-tokens", "9000"]


def _exact(store: str, sim: ArkSimulator) -> None:
    """Every call settled from its usage (none charged its hold), at what the simulator billed for it."""
    # (a refused attempt a call refitted and retried is a record too, of no tokens: not a call here)
    rows = ledger_rows(store, "SELECT state, reserved, charged FROM calls WHERE state != 'blocked'")
    assert [state for state, _, _ in rows] == ["settled"] * len(rows)
    assert sorted(charged for _, _, charged in rows) == sorted(bill.total_tokens for bill in sim.bills())


class TestLeftButReferenced:
    @pytest.mark.parametrize("how", ["break-and-keep", "break-and-keep-async"])
    def test_the_next_call_gets_the_room_and_the_left_stream_settles_exactly(
        self, sim: ArkSimulator, store: str, tmp_path: Path, how: str
    ) -> None:
        """The same thread (or task) calls again while its broken-off stream is referenced: admitted, nothing
        in flight after it, and the left stream charged exactly what the provider billed (the read-ahead)."""
        records, report = _run(sim, store, tmp_path, [*CAP, "--wait", "0"], "--abandon", how)
        assert records == [{"abandoned": how, "in_flight": 0}]
        assert report["totals"]["blocked_calls"] == 0
        # no attempt was refused on the way (each would be a blocked row): the call waited for its own stream
        [row] = cli_json("report", "--store", store, "--format", "json")["rows"]
        assert row["blocked_calls"] == 0
        rows = ledger_rows(store, "SELECT reserved FROM calls WHERE state != 'blocked' ORDER BY started_at")
        assert rows[0][0] > 9000 // 2  # the left stream's hold is most of the cap: the next call needed its room
        _exact(store, sim)

    def test_a_consumer_that_resumes_gets_the_identical_stream(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """Read ahead wrongly guessed: the program reads on after its next call and gets every chunk, unchanged."""
        records, _ = _run(sim, store, tmp_path, ["--cap-tokens", "200000"], "--abandon", "break-keep-resume")
        assert len(records) == 1
        assert records[0]["in_flight"] == 0
        assert records[0]["identical"] is True
        assert records[0]["chunks"] > 3
        _exact(store, sim)

    def test_a_waiting_call_reads_ahead_what_another_thread_left(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """Another thread left a stream it still references; this thread's call waits for that room: the wait
        reads the stream ahead, its settle wakes the waiter, and it is admitted."""
        records, report = _run(sim, store, tmp_path, CAP, "--abandon", "left-by-thread")
        assert records == [{"abandoned": "left-by-thread", "in_flight": 0}]
        assert report["totals"]["blocked_calls"] == 0
        _exact(store, sim)

    def test_under_wait_zero_a_call_is_not_refused_for_what_another_thread_left(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """The same with --wait 0: before refusing, the call reads ahead the streams other threads of its process
        left, gives them a moment, and asks once more; it is admitted and no attempt counts as blocked."""
        records, report = _run(sim, store, tmp_path, [*CAP, "--wait", "0"], "--abandon", "left-by-thread")
        assert records == [{"abandoned": "left-by-thread", "in_flight": 0}]
        assert report["totals"]["blocked_calls"] == 0
        [row] = cli_json("report", "--store", store, "--format", "json")["rows"]
        assert row["blocked_calls"] == 0
        _exact(store, sim)
