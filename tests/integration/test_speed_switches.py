"""A guarded run with every speed piece switched off still guards and settles exactly (real CLI, SDKs, simulator)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, ledger_rows, run_quotawrap

OFF = ["--no-advances", "--no-background-settle"]


def test_a_run_with_every_speed_piece_off_settles_exactly(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """16 threads in 2 processes (fork, spawn; openai, ark, requests, async httpx) under a cap, each settle
    landing on its caller's path in the ledger: no call drawn from an advance, the cap holds, every call
    is settled at the simulator's bill and no hold is left open."""
    sim.configure(reply_tokens=400)
    cap = 20_000
    report = tmp_path / "report.json"
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url, "--cap-tokens", str(cap), "--report-json", str(report), *OFF],
        child("swarm.py", "--processes", "2", "--threads", "8"),
        env={"SIM_URL": sim.url, "SWARM_DRAWN": "1"},
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["drawn"] for r in records if "drawn" in r] == [0, 0]
    assert any(r["outcome"] == "blocked" for r in records)
    billed = sim.billed_total()
    assert 0.8 * cap <= billed <= cap
    assert json.loads(report.read_text())["totals"]["settled_tokens"] == billed
    assert ledger_rows(store, "SELECT COUNT(*) FROM holds") == [(0,)]


# One guarded call (the run's lean books bind the relay once a process opens the ledger), then what the child
# was told and whether that socket is there.
_ONE_CALL_THEN_LOOK = """
import json, os, time
import openai
from quotawrap.intercept import get_guard
openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0).chat.completions.create(
    model="deepseek-v4-flash", messages=[{"role": "user", "content": "hi"}], max_tokens=10
)
path = os.environ.get("QUOTAWRAP_SETTLE_SOCKET")
deadline = time.monotonic() + 10
while path and not os.path.exists(path) and time.monotonic() < deadline:
    time.sleep(0.01)
guard = get_guard()
print(json.dumps([path, bool(path) and os.path.exists(path), guard.advances is not None]))
"""


@pytest.mark.parametrize(
    ("flags", "relayed"), [([], True), (["--no-advances"], False), (["--watch"], False)], ids=["on", "off", "watch"]
)
def test_the_wrapper_relays_settles_only_for_advances(
    sim: ArkSimulator, store: str, flags: list[str], relayed: bool
) -> None:
    """Advances, their draw notes and the relay are one piece: with advances off (or in --watch, which
    reserves nothing ahead) the wrapper binds no socket and names none to its child, not even an outer run's,
    and the child's call is settled all the same."""
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url, *flags],
        [sys.executable, "-c", _ONE_CALL_THEN_LOOK],
        env={"SIM_URL": sim.url, "QUOTAWRAP_SETTLE_SOCKET": "/nonexistent/outer-run.sock"},
    )
    assert result.returncode == 0, result.stderr
    path, bound, advances = json.loads(result.stdout.strip().splitlines()[-1])
    assert (bound, advances) == (relayed, relayed)
    assert path != "/nonexistent/outer-run.sock" and (path is not None) is relayed
    assert ledger_rows(store, "SELECT COUNT(*) FROM holds") == [(0,)]
    assert sim.billed_total() > 0
