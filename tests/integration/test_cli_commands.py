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


def test_a_model_name_cannot_write_into_the_terminal(tmp_path: Path) -> None:
    """A program (or a provider) names a model with a line break and escape sequences: the run's summary,
    `report`, `sessions` and `status` print it escaped, one row each, never raw."""
    from quotawrap.simulator import SimConfig, serve

    hostile = "evil\n\x1b[31mRED\x1b[0m\u202etxt"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path), "MODEL": hostile}
    env.pop("QUOTAWRAP_RUN_ID", None)
    child = Path(__file__).parent / "children" / "one_call.py"
    with serve(config=SimConfig(strict=False)) as sim:  # Ark would 404 such a model; a lenient provider answers
        env["SIM_URL"] = sim.url
        run = subprocess.run(
            [sys.executable, "-m", "quotawrap", "--base-url", sim.url, "--", sys.executable, str(child)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr
    outputs = {"summary": run.stderr}
    # the command a run records is the program's too
    assert subprocess.run([sys.executable, "-m", "quotawrap", "--", "true", hostile], env=env).returncode == 0
    for command in ("report", "sessions", "status"):
        done = subprocess.run(
            [sys.executable, "-m", "quotawrap", command], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        outputs[command] = done.stdout
    for name, text in outputs.items():  # the ledger keys the model case-folded (quotawrap.core.identity)
        assert "\x1b" not in text and "\u202e" not in text, name
        lowered = text.lower()
        assert "red" in lowered, name
        assert not any(line.startswith("\x1b") or line.startswith("[31mred") for line in lowered.splitlines()), name
        (line,) = [line for line in lowered.splitlines() if "evil" in line]  # the name stays on its row
        assert "evil\\n\\x1b[31mred" in line, (name, line)
