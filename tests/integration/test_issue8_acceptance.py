"""Issue 8 as checked: one agent mixing every Python HTTP stack and Ark endpoint under a binding token cap.

The real `quotawrap` CLI runs children/acceptance.py against the bundled simulator. What the issue's other checks
ask is proven elsewhere: `quotawrap -- opentelemetry-instrument python app.py` in
test_every_stack.py::TestOpenTelemetryInstrument, a child without PYTHONPATH named by pid and command (and stopped by
--strict) in test_every_stack.py::TestProcessesWithoutTheHook. Below, the GitHub step summary says so too.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, ledger_rows, run_quotawrap
from tests.redis_server import session_url

CAP = 120_000


def _agent(sim: ArkSimulator, store: str, tmp_path: Path) -> dict[str, Any]:
    """One run of the acceptance agent under --cap-tokens CAP; its output lines, report and summary."""
    sim.configure(task_s=0.3, reply_tokens=1500)  # each chat bills ~1500: the cap binds in a few rounds
    report = tmp_path / "report.json"
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url, "--cap-tokens", str(CAP), "--report-json", str(report)],
        child("acceptance.py"),
        env={"SIM_URL": sim.url},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(raw) for raw in result.stdout.splitlines() if raw.startswith("{")]
    return {
        "steps": {line["step"]: line for line in lines if "step" in line},
        "chats": [line for line in lines if "stack" in line],
        "report": json.loads(report.read_text()),
        "stderr": result.stderr,
    }


@pytest.fixture
def run(sim: ArkSimulator, store: str, tmp_path: Path) -> dict[str, Any]:
    """The agent on the test's SQLite ledger."""
    return _agent(sim, store, tmp_path)


class TestOneAgentUnderACap:
    def test_the_cap_binds_and_the_bill_stays_under_it(self, sim: ArkSimulator, run: dict[str, Any]) -> None:
        """Every stack got answers and then refusals (the cap bound); the provider billed at most the cap."""
        by_stack: dict[str, Counter[int]] = {}
        for chat in run["chats"]:
            by_stack.setdefault(chat["stack"], Counter())[chat["status"]] += 1
        assert len(by_stack) == 12  # six stacks, plain and streamed
        for stack, statuses in by_stack.items():
            assert statuses[200] >= 1 and statuses[429] >= 1, (stack, statuses)
        assert 0 < sim.billed_total() <= CAP

    def test_every_billed_request_is_in_the_ledger_with_its_usage(
        self, sim: ArkSimulator, store: str, run: dict[str, Any]
    ) -> None:
        """The ledger's charged rows are the provider's bills one for one; settled equals the bill."""
        steps = run["steps"]
        assert [steps[name]["outcome"] for name in ("images", "video", "context", "batch")] == ["ok"] * 4
        assert steps["video"]["status"] == "succeeded"
        billed = sorted(bill.total_tokens for bill in sim.bills())
        charged = sorted(row[0] for row in ledger_rows(store, "SELECT charged FROM calls WHERE charged > 0"))
        assert charged == billed
        answered = [chat for chat in run["chats"] if chat["status"] == 200]
        settled = Counter(
            row[0]
            for row in ledger_rows(store, "SELECT charged FROM calls WHERE endpoint = 'chat' AND state = 'settled'")
        )
        assert settled.total() == len(answered)
        # a stream that did not ask for usage shows the client none; quotawrap asked for it on the caller's behalf
        seen = Counter(chat["total"] for chat in answered if chat["total"] is not None)
        assert seen and not seen - settled, seen - settled  # each answer's own usage, as the client saw it
        totals = run["report"]["totals"]
        assert totals["settled_tokens"] == sim.billed_total()
        assert totals["unresolved_calls"] == 0

    def test_the_unknown_path_is_refused_with_a_clear_message(self, sim: ArkSimulator, run: dict[str, Any]) -> None:
        """The POST to a path quotawrap does not know never left: 403 naming it and --allow-path."""
        unknown = run["steps"]["unknown"]
        assert unknown["status"] == 403
        assert "quotawrap refused POST /api/v3/audio/speech" in unknown["message"]
        assert "--allow-path" in unknown["message"]
        assert "/api/v3/audio/speech" not in sim.requests_by_path()

    def test_the_summary_counts_the_guarded_calls(self, sim: ArkSimulator, run: dict[str, Any]) -> None:
        """Never '0 guarded calls' while the provider billed: the summary counts at least every billed call."""
        totals = run["report"]["totals"]
        assert totals["calls"] >= sim.calls() > 0
        (headline,) = [line for line in run["stderr"].splitlines() if line.startswith("quotawrap: session")]
        assert f"{totals['calls']} guarded call(s)" in headline
        assert totals["unguarded_processes"] == [] and totals["unguarded_connections"] == 0

    def test_on_redis_too(self, sim: ArkSimulator, tmp_path: Path) -> None:
        """The same agent on the Redis ledger: the cap binds, the bill stays under it, settled is the bill."""
        with session_url() as redis_url:
            run = _agent(sim, redis_url, tmp_path)
        assert {chat["status"] for chat in run["chats"]} == {200, 429}
        assert run["report"]["totals"]["settled_tokens"] == sim.billed_total() <= CAP
        assert run["steps"]["unknown"]["status"] == 403


class TestStepSummarySaysWhatWentAround:
    def _summary(self, sim: ArkSimulator, store: str, tmp_path: Path, args: list[str], *mode: str) -> str:
        summary = tmp_path / "summary.md"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, *args],
            child("around.py", *mode),
            env={"SIM_URL": sim.url, "GITHUB_STEP_SUMMARY": str(summary)},
        )
        assert result.returncode == 0, result.stderr
        return result.stdout + "\n" + summary.read_text()

    def test_an_unguarded_process_is_named_on_the_ci_page(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """A grandchild with a cleared environment: the step summary names its pid and command, as stderr does."""
        text = self._summary(sim, store, tmp_path, [], "bare-env", "0.5")
        pid = int(text.split("GRANDCHILD")[1].split()[0])
        assert "**Not everything went through the guard:**" in text
        assert f"**UNGUARDED PROCESS** pid {pid} (`" in text and "its calls were **not** guarded" in text

    def test_an_unguarded_connection_is_counted_on_the_ci_page(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """--allow-unguarded lets a raw socket through: the step summary says a connection went out UNGUARDED."""
        text = self._summary(sim, store, tmp_path, ["--allow-unguarded"], "raw-socket")
        assert "**1 connection(s) went out UNGUARDED** (--allow-unguarded)" in text

    def test_a_clean_run_says_nothing_of_the_kind(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """Control: a run where everything was guarded has no such section."""
        summary = tmp_path / "summary.md"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url],
            child("one_call.py"),
            env={"SIM_URL": sim.url, "GITHUB_STEP_SUMMARY": str(summary)},
        )
        assert result.returncode == 0, result.stderr
        assert "guarded call(s)" in summary.read_text() and "Not everything" not in summary.read_text()
