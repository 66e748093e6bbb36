"""Totals are right or say they are not: forks, nested wrappers, killed wrappers, --fail-open, a zero cap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from quotawrap.ledger import open_ledger
from quotawrap.simulator import ArkSimulator
from tests.conftest import child, cli_json, run_cli, run_quotawrap
from tests.redis_server import free_port, session_url

# The parent calls and exits at once; its fork calls after the parent is gone.
FORK_AFTER_EXIT = """
import os, sys, time
import openai

def call():
    sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
    sdk.chat.completions.create(model="deepseek-v4-flash", messages=[{"role": "user", "content": "hi"}], max_tokens=20)

if os.fork() == 0:
    time.sleep(1.0)  # long enough for the parent to have exited
    call()
    sys.exit(0)  # a normal exit: the guard's exit flush settles the call (os._exit would leave it charged whole)
call()
"""


def sessions(store: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = cli_json("sessions", "--store", store, "--json")
    return rows


class TestEveryProcessOfTheRunCounts:
    def test_a_fork_calling_after_the_child_exited_is_in_the_totals(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """The wrapper waits for what the child left running: the report counts both calls, as billed."""
        report = tmp_path / "report.json"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--report-json", str(report)],
            [sys.executable, "-c", FORK_AFTER_EXIT],
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        totals = json.loads(report.read_text())["totals"]
        assert totals["calls"] == 2 and totals["settled_tokens"] == sim.billed_total() > 0
        assert "left 1 process(es) running" in result.stderr

    def test_a_daemon_left_running_does_not_hold_the_run_open_past_linger(self, store: str) -> None:
        """A process the command leaves running for good is waited for --linger seconds, then named."""
        # The daemon lets go of the captured pipes, as daemons do, so only the wrapper could wait for it.
        daemon = (
            "import os, time\n"
            "if os.fork() == 0:\n"
            "    os.dup2(os.open(os.devnull, os.O_RDWR), 1)\n"
            "    os.dup2(1, 2)\n"
            "    time.sleep(60)\n"
        )
        started = time.monotonic()
        result = run_quotawrap(["--store", store, "--linger", "0.5"], [sys.executable, "-c", daemon], timeout=50)
        assert result.returncode == 0, result.stderr
        assert "still running after --linger 0.5 s" in result.stderr
        assert time.monotonic() - started < 45  # the daemon sleeps 60 s: the run did not wait for it

    def test_a_nested_wrapper_joins_the_outer_run_without_overwriting_it(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """quotawrap -- quotawrap -- agent: one session, the outer command and exit code, the call counted."""
        report = tmp_path / "outer.json"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--report-json", str(report)],
            [sys.executable, "-m", "quotawrap", "--", *child("one_call.py")],
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        (run,) = sessions(store)
        assert "-m quotawrap" in str(run["command"]) and run["exit_code"] == 0 and run["calls"] == 1
        assert json.loads(report.read_text())["totals"]["settled_tokens"] == sim.billed_total() > 0
        assert "nested in run" in result.stderr


class TestRecordsTellTheTruth:
    def test_a_sigkilled_wrapper_shows_as_died_not_running_forever(self, store: str, tmp_path: Path) -> None:
        """A wrapper killed with SIGKILL: `sessions` says 'wrapper died' once its pid is gone."""
        pid_file = tmp_path / "child.pid"
        script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        env = {k: v for k, v in os.environ.items() if k != "QUOTAWRAP_RUN_ID"}
        wrapper = subprocess.Popen(
            [sys.executable, "-m", "quotawrap", "--store", store, "--quiet", "--", sys.executable, "-c", script],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():  # wait until the run has started
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        assert [run["state"] for run in sessions(store)] == ["running"]
        wrapper.kill()
        wrapper.wait()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        assert [run["state"] for run in sessions(store)] == ["wrapper died"]

    def test_the_step_summary_names_unguarded_calls_under_fail_open(self, sim: ArkSimulator, tmp_path: Path) -> None:
        """--fail-open with the store down: $GITHUB_STEP_SUMMARY says calls went out UNGUARDED."""
        summary = tmp_path / "summary.md"
        result = run_quotawrap(
            ["--store", f"redis://127.0.0.1:{free_port()}/0", "--base-url", sim.url, "--fail-open"],
            child("one_call.py"),
            env={"SIM_URL": sim.url, "GITHUB_STEP_SUMMARY": str(summary)},
        )
        assert result.returncode == 0, result.stderr
        text = summary.read_text()
        assert "1 call(s) went out UNGUARDED" in text and "Totals are incomplete" in text

    def test_daily_cap_zero_names_daily_cap(self, sim: ArkSimulator, store: str) -> None:
        """--daily-cap 0 refuses the call naming daily_cap and --daily-cap, not usage_wall."""
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--daily-cap", "0"],
            child("one_call.py"),
            env={"SIM_URL": sim.url},
        )
        assert result.stdout.startswith("BLOCKED"), result.stdout + result.stderr
        assert "daily_cap" in result.stdout and "--daily-cap" in result.stdout and "usage_wall" not in result.stdout
        assert sim.billed_total() == 0


class TestImplausibleUsageIsNamed:
    """An answer whose usage cannot be true is charged its hold, and every view says why, not just "unresolved"."""

    def _check(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        sim.configure(fault="implausible_usage")
        report = tmp_path / "report.json"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--report-json", str(report)],
            child("one_call.py"),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        totals = json.loads(report.read_text())["totals"]
        assert (totals["calls"], totals["unresolved_calls"], totals["anomalous_calls"]) == (1, 1, 1)
        assert "1 call(s) with implausible usage (charged their hold)" in result.stderr
        assert "ended without usage" not in result.stderr  # it had usage: an unbelievable one
        [row] = cli_json("report", "--store", store, "--format", "json")["rows"]
        assert (row["calls"], row["anomalous_calls"]) == (1, 1)
        assert "1 call(s) with implausible usage" in run_cli("report", "--store", store).stdout
        [model] = cli_json("status", "--store", store, "--json")
        assert model["anomalous_calls"] == 1
        assert "today: 1 call(s) with implausible usage" in run_cli("status", "--store", store).stdout

    WHY = f"total_tokens {2**63} is not a plausible token count"

    def test_on_sqlite(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        self._check(sim, store, tmp_path)
        assert [record.usage_anomaly for record in open_ledger(store).call_records()] == [self.WHY]

    def test_on_redis(self, sim: ArkSimulator, tmp_path: Path) -> None:
        with session_url() as redis_url:
            self._check(sim, redis_url, tmp_path)
            assert [record.usage_anomaly for record in open_ledger(redis_url).call_records()] == [self.WHY]
