"""A guarded run with every speed piece switched off still guards and settles exactly (real CLI, SDKs, simulator)."""

from __future__ import annotations

import json
from pathlib import Path

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
