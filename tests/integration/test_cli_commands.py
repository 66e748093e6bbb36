"""The commands a newcomer runs first: `quotawrap simulate` and `quotawrap demo`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx


def test_simulate_serves_ark_on_loopback_until_terminated() -> None:
    """`quotawrap simulate --port 0` prints its URL, answers a chat call with usage, and stops on SIGTERM."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "quotawrap", "simulate", "--port", "0", "--reply-tokens", "7"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+/api/v3)", line)
        assert match, line
        answer = httpx.post(
            match.group(1) + "/chat/completions",
            json={"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer x"},
        )
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 7
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    assert proc.returncode == 0


def test_demo_runs_the_agent_against_the_simulator(tmp_path: Path) -> None:
    """`quotawrap demo` without ARK_API_KEY: the agent runs guarded, every call answered (those that did not fit
    at once waited for room), the bill within the cap."""
    env = {k: v for k, v in os.environ.items() if k != "ARK_API_KEY"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "quotawrap",
            "demo",
            "--calls",
            "6",
            "--cap-tokens",
            "9000",
            "--store",
            f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("answered") == 6 and "BLOCKED" not in result.stdout
    assert "waited for room" in result.stderr
    billed = int(re.search(r"the simulator billed ([\d,]+) tokens", result.stderr).group(1).replace(",", ""))
    settled = int(re.search(r"([\d,]+) tokens settled", result.stderr).group(1).replace(",", ""))
    assert settled == billed <= 9000
