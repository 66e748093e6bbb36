"""The real `quotawrap` CLI, real SDKs, the real simulator, threads and processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from quotawrap.simulator import ArkSimulator
from tests.conftest import CHILDREN, child, communicate_all, ledger_rows, run_quotawrap, sigkill_mid_stream, start_cli

MODEL = "deepseek-v4-flash"


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


class TestConcurrentCap:
    def test_threads_and_processes_never_overspend(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """32 threads in 4 processes (fork, spawn; openai, ark, requests, async httpx) stay under the cap."""
        sim.configure(reply_tokens=400)
        cap = 20_000
        report = tmp_path / "report.json"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--cap-tokens", str(cap), "--report-json", str(report)],
            child("swarm.py", "--processes", "4", "--threads", "8"),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        records = _records(result.stdout)
        assert {r["client"] for r in records} == {"openai", "ark", "requests", "httpx-async"}
        assert any(r["outcome"] == "blocked" for r in records)
        assert any(r.get("stream") for r in records if r["outcome"] == "ok")
        billed = sim.billed_total()
        settled = json.loads(report.read_text())["totals"]["settled_tokens"]
        assert billed <= cap
        assert billed >= 0.8 * cap
        assert settled == billed

    def test_calls_drawn_from_advances_never_overspend(self, sim: ArkSimulator, store: str) -> None:
        """32 threads in 4 processes on a cap 64 times their advances and more: most calls are drawn from
        advances (quotawrap.admission.advances), the last ones near the cap reserve one by one, and the cap holds
        with every call settled exactly and nothing left open."""
        sim.configure(reply_tokens=100)
        cap = 200_000
        args = ["--store", store, "--base-url", sim.url, "--daily-cap", str(cap), "--usage-wall", str(cap)]
        result = run_quotawrap(
            args,
            child("swarm.py", "--processes", "4", "--threads", "8", "--max-calls", "400", "--max-tokens", "120"),
            env={"SIM_URL": sim.url, "SWARM_DRAWN": "1"},
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        records = _records(result.stdout)
        drawn = [r["drawn"] for r in records if "drawn" in r]
        calls = [r for r in records if r.get("outcome") == "ok"]
        assert len(drawn) == 4 and sum(drawn) > len(calls) // 2  # most calls never asked the ledger alone
        assert any(r.get("outcome") == "blocked" for r in records)
        billed = sim.billed_total()
        assert 0.9 * cap <= billed <= cap
        (settled, rows) = ledger_rows(store, "SELECT SUM(charged), COUNT(*) FROM calls WHERE state = 'settled'")[0]
        assert (settled, rows) == (billed, len(calls))
        assert ledger_rows(store, "SELECT COUNT(*) FROM holds") == [(0,)]

    def test_without_quotawrap_the_same_swarm_overspends(self, sim: ArkSimulator) -> None:
        """Control: the same program unguarded runs far past the cap (so the test above means something)."""
        sim.configure(reply_tokens=400)
        subprocess.run(
            child("swarm.py", "--processes", "4", "--threads", "8", "--max-calls", "3"),
            env={**os.environ, "SIM_URL": sim.url},
            capture_output=True,
            check=True,
            timeout=120,
        )
        assert sim.billed_total() > 20_000

    def test_two_concurrent_runs_share_the_daily_cap(self, sim: ArkSimulator, store: str) -> None:
        """Two wrapper runs at once on one ledger: the per-model daily cap holds across both."""
        sim.configure(reply_tokens=400)
        cap = 12_000
        args = ["--store", store, "--base-url", sim.url, "--daily-cap", str(cap), "--usage-wall", str(cap)]
        procs = [
            start_cli(*args, "--", *child("swarm.py", "--threads", "8"), env={"SIM_URL": sim.url}) for _ in range(2)
        ]
        for proc, (_, stderr) in zip(procs, communicate_all(procs, timeout=120), strict=True):
            assert proc.returncode == 0, stderr
        billed = sim.billed_total()
        assert billed <= cap
        assert billed >= 0.8 * cap
        (settled,) = ledger_rows(store, "SELECT SUM(charged) FROM calls")[0]
        assert settled == billed


class TestCrashSafety:
    def test_sigkill_mid_stream_leaves_no_open_hold(self, sim: ArkSimulator, store: str) -> None:
        """A child SIGKILLed mid-stream: the wrapper charges its hold; nothing stays held; charge >= bill."""
        _, (state, charged, reserved) = sigkill_mid_stream(sim, store)
        assert state == "unresolved"
        assert charged == reserved
        assert charged >= sim.billed_total() > 0


class TestInjection:
    def test_user_sitecustomize_still_runs(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """The user's own sitecustomize runs, and the call is still guarded."""
        user_dir = tmp_path / "usersite"
        user_dir.mkdir()
        marker = tmp_path / "marker"
        (user_dir / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url],
            child("one_call.py"),
            env={"SIM_URL": sim.url, "PYTHONPATH": str(user_dir)},
        )
        assert result.returncode == 0, result.stderr
        assert marker.read_text() == "ran"
        assert ledger_rows(store, "SELECT COUNT(*) FROM calls WHERE state = 'settled'") == [(1,)]

    def test_sdk_objects_identical_with_and_without_quotawrap(self, sim: ArkSimulator, store: str) -> None:
        """What the caller's SDK yields (chunks too: the injected usage chunk is hidden) does not change."""
        env = {**os.environ, "SIM_URL": sim.url}
        plain = subprocess.run(child("parity.py"), env=env, capture_output=True, text=True, check=True, timeout=60)
        guarded = run_quotawrap(["--store", store, "--base-url", sim.url], child("parity.py"), env=env)
        assert guarded.returncode == 0, guarded.stderr
        assert json.loads(guarded.stdout) == json.loads(plain.stdout)
        # and the guard really saw those calls, streams included, with their usage
        assert ledger_rows(store, "SELECT COUNT(*), SUM(state = 'settled') FROM calls") == [(8, 8)]

    def test_grandchildren_are_guarded_in_the_same_run(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """A subprocess of the child is guarded too, and counted in the run's report."""
        report = tmp_path / "r.json"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--report-json", str(report)],
            child("one_call.py", "--spawn-grandchild"),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(report.read_text())["totals"]["calls"] == 2
        assert len({pid for (pid,) in ledger_rows(store, "SELECT pid FROM calls")}) == 2

    def test_isolated_python_of_this_environment_is_guarded(self, sim: ArkSimulator, store: str) -> None:
        """`python -I` ignores PYTHONPATH, but the installed quotawrap-hook.pth still loads the hook."""
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url],
            [sys.executable, "-I", *child("one_call.py")[1:]],
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        assert f"TOTAL {sim.billed_total()}" in result.stdout
        assert ledger_rows(store, "SELECT COUNT(*) FROM calls WHERE state = 'settled'") == [(1,)]
        assert "UNGUARDED" not in result.stderr

    def test_python_without_site_is_reported(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """`python -S` loads no hook at all: the summary and the report name its pid and command."""
        report = tmp_path / "report.json"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--report-json", str(report)],
            [sys.executable, "-S", "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(0.5)"],
        )
        assert result.returncode == 0, result.stderr
        pid = int(result.stdout.strip())
        (process,) = json.loads(report.read_text())["totals"]["unguarded_processes"]
        assert process["pid"] == pid and "-S" in process["command"]
        assert f"UNGUARDED PROCESS: pid {pid}" in result.stderr


class TestResults:
    def test_block_is_an_ark_shaped_429_naming_the_limit(self, sim: ArkSimulator, store: str) -> None:
        """The child sees a 429 whose message names the limit, the numbers and how to raise it."""
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--cap-tokens", "10"],
            child("one_call.py"),
            env={"SIM_URL": sim.url},
        )
        assert "BLOCKED" in result.stdout
        assert "run_cap" in result.stdout and "--cap-tokens" in result.stdout and "> 10" in result.stdout
        assert sim.billed_total() == 0

    def test_fail_on_block_exit_code_and_report(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """--fail-on-block exits 3 when a call was blocked; the JSON report says why."""
        report = tmp_path / "report.json"
        result = run_quotawrap(
            [
                "--store",
                store,
                "--base-url",
                sim.url,
                "--cap-tokens",
                "10",
                "--fail-on-block",
                "--report-json",
                str(report),
            ],
            child("one_call.py"),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 3
        data = json.loads(report.read_text())
        assert data["totals"]["blocked_calls"] == 1
        assert set(data["totals"]) >= {
            "calls",
            "blocked_calls",
            "settled_tokens",
            "reserved_open_tokens",
            "overshoot_calls",
            "unresolved_calls",
        }
        assert data["models"][MODEL]["blocked_calls"] == 1

    def test_child_exit_code_passes_through(self, store: str) -> None:
        """The child's exit code is the wrapper's."""
        result = run_quotawrap(["--store", store], [sys.executable, "-c", "raise SystemExit(7)"])
        assert result.returncode == 7

    def test_unknown_command_and_bad_flag(self, store: str) -> None:
        """Our own errors have their own codes: 127 command not found, 2 usage error."""
        assert run_quotawrap(["--store", store], ["no-such-command-xyz"]).returncode == 127
        assert run_quotawrap(["--store", store, "--cap-tokens", "lots"], ["true"]).returncode == 2

    def test_watch_blocks_nothing_but_says_what_it_would_have(self, sim: ArkSimulator, store: str) -> None:
        """--watch lets the call through and the summary counts it as would-have-been-blocked."""
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--cap-tokens", "10", "--watch"],
            child("one_call.py"),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("TOTAL")
        assert "1 WOULD have been blocked" in result.stderr
        assert sim.billed_total() > 0

    def test_signals_are_forwarded(self, store: str, tmp_path: Path) -> None:
        """SIGTERM to the wrapper reaches the child, whose handler runs; its exit code comes back."""
        script = tmp_path / "trap.py"
        script.write_text(
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
            "print('READY', flush=True)\n"
            "time.sleep(30)\n"
        )
        proc = start_cli("--store", store, "--", sys.executable, str(script))
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
        assert proc.returncode == 42
        assert time.monotonic() - started < 20

    def test_stdin_and_stdout_pass_straight_through(self, store: str) -> None:
        """The child reads our stdin and writes our stdout unchanged."""
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "quotawrap",
                "--store",
                store,
                "--quiet",
                "--",
                sys.executable,
                "-c",
                "import sys; sys.stdout.write(sys.stdin.read().upper())",
            ],
            input="piped text",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.stdout == "PIPED TEXT"
        assert proc.stderr == ""


def test_children_dir_exists() -> None:
    """The helper programs the integration tests run are in place."""
    assert (CHILDREN / "swarm.py").is_file()
