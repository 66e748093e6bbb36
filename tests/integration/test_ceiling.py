"""Issue 9 end to end: waiting instead of false blocks, a ceiling the provider enforces, abandoned streams.

The real `quotawrap` CLI runs tests/integration/children/ceiling_agent.py (the openai SDK, no retries)
against the bundled Ark simulator, whose bill is the truth every assertion is held to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, cli_json, communicate_all, ledger_rows, run_quotawrap
from tests.redis_server import session_url


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _run(sim: ArkSimulator, store: str, tmp_path: Path, limit: list[str], *agent: str) -> tuple[list[dict], dict]:
    report = tmp_path / "report.json"
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url, *limit, "--report-json", str(report)],
        child("ceiling_agent.py", *agent),
        env={"SIM_URL": sim.url},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return _records(result.stdout), json.loads(report.read_text())


class TestParallelCallsThatFit:
    @pytest.mark.parametrize("callers", [24, 64])
    def test_none_refused(self, sim: ArkSimulator, store: str, tmp_path: Path, callers: int) -> None:
        """N parallel non-retrying calls whose total fits the cap are all answered, and the bill stays under it."""
        cap = 20_000
        records, report = _run(sim, store, tmp_path, ["--cap-tokens", str(cap)], "--threads", str(callers))
        assert [r for r in records if r["outcome"] != "ok"] == []
        assert len(records) == callers
        assert sim.billed_total() <= cap
        assert report["totals"]["blocked_calls"] == 0
        assert report["waits"]["waited_calls"] > 0  # they did not all fit at once: some waited for room

    def test_refuse_at_once_with_wait_zero(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """Control: --wait 0 restores refuse-at-once, and the same 24 calls are partly refused."""
        records, report = _run(sim, store, tmp_path, ["--cap-tokens", "20000", "--wait", "0"], "--threads", "24")
        blocked = [r for r in records if r["outcome"] == "blocked"]
        assert blocked
        assert report["totals"]["blocked_calls"] == len(blocked)

    def test_async_callers_wait_without_blocking_their_loop(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """24 tasks of one event loop: all answered, and the loop's ticker ran while they waited."""
        sim.configure(latency_s=0.05)
        records, report = _run(sim, store, tmp_path, ["--cap-tokens", "20000"], "--async", "--threads", "24")
        calls = [r for r in records if "outcome" in r]
        assert [r for r in calls if r["outcome"] != "ok"] == []
        assert len(calls) == 24
        assert report["waits"]["waited_calls"] > 0
        # a blocked loop would tick once per wait at most; 24 calls waited through several 50 ms answers
        assert next(r["ticks"] for r in records if "ticks" in r) > 24

    def test_a_call_that_can_never_fit_is_refused_at_once(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """A call larger than the whole cap is refused without waiting (the default wait is minutes)."""
        records, report = _run(sim, store, tmp_path, ["--cap-tokens", "100", "--no-bound"], "--threads", "1")
        assert [r["outcome"] for r in records] == ["blocked"]
        assert report["waits"]["waited_calls"] == 0
        assert sim.billed_total() == 0


class TestThinkingHeavyAgent:
    @pytest.mark.parametrize(
        ("limit", "processes"),
        [(["--cap-tokens", "150000"], "1"), (["--daily-cap", "150000"], "2")],
        ids=["cap-tokens-threads", "daily-cap-processes"],
    )
    def test_bill_never_exceeds_the_cap_and_most_of_it_is_used(
        self, sim: ArkSimulator, store: str, tmp_path: Path, limit: list[str], processes: str
    ) -> None:
        """Reasoning up to 30,000 a call, max_tokens small/large/absent, streams and not: bill <= cap, >= 70% used."""
        sim.configure(tokens_per_chunk=500)
        cap = 150_000
        agent = ["--thinking", "--until-refused", "--calls", "50", "--threads", "4", "--processes", processes]
        records, report = _run(sim, store, tmp_path, limit, *agent)
        billed = sim.billed_total()
        assert billed <= cap
        assert billed >= 0.7 * cap
        assert report["totals"]["settled_tokens"] >= billed
        assert report["totals"]["bounded_calls"] > 0
        assert any(r["outcome"] == "ok" and r["stream"] for r in records)

    def test_the_bound_reaches_the_provider(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """Every call that left its output open went out with max_completion_tokens: none billed past its hold."""
        sim.configure(tokens_per_chunk=500)
        records, report = _run(
            sim, store, tmp_path, ["--cap-tokens", "150000"], "--thinking", "--calls", "6", "--threads", "2"
        )
        rows = ledger_rows(store, "SELECT reserved, charged FROM calls WHERE state = 'settled'")
        assert rows
        # each answered call was bounded, and its bound event reached the run's report (with its settle)
        assert report["totals"]["bounded_calls"] == len([r for r in records if r["outcome"] == "ok"]) > 0
        assert all(charged <= reserved for reserved, charged in rows)
        settled = ledger_rows(store, "SELECT reasoning_tokens FROM calls WHERE state = 'settled'")
        reasoning = max(row[0] for row in settled)
        (row,) = cli_json("status", "--store", store, "--json")
        assert row["reasoning_p99"] == reasoning  # fewer than 100 calls: the largest
        assert row["output_allowance"] == min(65_536, 4_096 + reasoning)


class TestAbandonedStreams:
    def test_holds_are_freed_at_once_and_charged_soundly(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """close(), break-and-drop, an exception in the consumer, task cancellation: nothing stays in flight,
        and each is charged at least what the provider billed and at most its hold."""
        ways = ["close", "break-and-drop", "exception", "cancel"]
        records, report = _run(sim, store, tmp_path, ["--cap-tokens", "200000"], "--abandon", *ways)
        assert [(r["abandoned"], r["in_flight"]) for r in records] == [(how, 0) for how in ways]
        rows = ledger_rows(store, "SELECT reserved, charged FROM calls WHERE state != 'blocked'")
        assert len(rows) == len(ways)
        assert all(charged <= reserved for reserved, charged in rows)
        assert report["totals"]["settled_tokens"] >= sim.billed_total()


class TestAcrossRunsOnRedis:
    def test_two_runs_share_a_daily_cap_and_none_is_refused(self, sim: ArkSimulator, tmp_path: Path) -> None:
        """Two wrapper runs at once on one Redis ledger, 24 callers each, whose total fits the daily cap:
        they wait across processes (retry-based), none is refused, the bill stays under the cap."""
        cap = 20_000
        with session_url() as url:
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "quotawrap",
                        *("--store", url, "--base-url", sim.url, "--daily-cap", str(cap)),
                        *("--report-json", str(tmp_path / f"report-{n}.json"), "--"),
                        *child("ceiling_agent.py", "--threads", "24"),
                    ],
                    env={**os.environ, "SIM_URL": sim.url},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for n in range(2)
            ]
            outputs = communicate_all(procs, timeout=300)
        for proc, (_, stderr) in zip(procs, outputs, strict=True):
            assert proc.returncode == 0, stderr
        records = [record for stdout, _ in outputs for record in _records(stdout)]
        assert len(records) == 48
        assert [r for r in records if r["outcome"] != "ok"] == []
        assert sim.billed_total() <= cap


class TestOwnSettlesInTransit:
    def test_sequential_calls_under_wait_zero_are_not_refused_for_their_own_settles(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """One thread, one call after another, each hold most of the cap: a call's settle travels off the caller's
        path (to the wrapper), so the next call can find it still in flight. Under --wait 0 that must not refuse
        it: the call lands its own process's settles and asks again."""
        records, report = _run(
            sim, store, tmp_path, ["--cap-tokens", "6000", "--wait", "0"], "--threads", "1", "--calls", "12"
        )
        assert [r["outcome"] for r in records] == ["ok"] * 12
        assert report["totals"]["blocked_calls"] == 0
        assert report["totals"]["settled_tokens"] == sim.billed_total() <= 6000
        [row] = cli_json("report", "--store", store, "--format", "json")["rows"]
        assert row["blocked_calls"] == 0  # the attempts asked again are no blocked calls in the report either
        # it lands them before it asks (it looks first), so the ledger keeps no refused attempt either
        assert ledger_rows(store, "SELECT count(*) FROM calls WHERE state = 'blocked'") == [(0,)]
