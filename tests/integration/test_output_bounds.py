"""What a guarded thinking agent sends is what Ark accepts, and never asks for more than the agent did.

The real `quotawrap` CLI runs tests/integration/children/thinking_agent.py (the openai SDK, threads, streamed and
plain calls, max_tokens small, large or absent) against the bundled Ark simulator with reasoning on. The
simulator answers Ark's 400 to a request that sets max_tokens beside max_completion_tokens, and its model would
say more than any max_tokens here (500 answer tokens): its bill is the truth every assertion is held to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, cli_json, ledger_rows, run_quotawrap

CAP = 150_000
THREADS, CALLS = 4, 6
REASONING = ("--max-reasoning", "6000")  # up to 6,000 a call: the 24 calls' bill fits the cap, so each is answered


@pytest.mark.parametrize(
    ("model", "policy", "replaced"),
    [
        # the model's reasoning ceiling is unknown (the largest documented, 262,144): no max_tokens call can ever
        # fit 150,000 with it, so each is sent with its max_tokens as max_completion_tokens instead
        ("deepseek-v4-flash", "ceiling", True),
        # a 32k ceiling: max_tokens + 32,768 fits the cap, so those calls go out unchanged and wait for room
        ("doubao-seed-1-6-251015", "ceiling", False),
        ("doubao-seed-1-6-251015", "cut", True),
    ],
)
def test_a_thinking_agent_gets_no_400_no_longer_answer_and_a_bill_within_the_cap(
    sim: ArkSimulator, store: str, tmp_path: Path, model: str, policy: str, replaced: bool
) -> None:
    """Every call answered (no 400 from the provider), no answer longer than its max_tokens, the bill at or under
    the cap, settled equal to the bill; the summary, the report JSON and `quotawrap report` agree on the calls
    the guard bounded, per way."""
    sim.configure(reply_tokens=500, tokens_per_chunk=250)
    report_path = tmp_path / "report.json"
    result = run_quotawrap(
        [
            *("--store", store, "--base-url", sim.url, "--cap-tokens", str(CAP)),
            *("--reasoning-reserve", policy, "--report-json", str(report_path)),
        ],
        child("thinking_agent.py", "--model", model, "--threads", str(THREADS), "--calls", str(CALLS), *REASONING),
        env={"SIM_URL": sim.url},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(records) == THREADS * CALLS
    assert [r for r in records if r["status"] != 200] == []
    assert all(r["answer"] <= r["max_tokens"] for r in records if r["max_tokens"] is not None)
    assert any(r["answer"] == 500 for r in records if r["max_tokens"] == 8_000 or not replaced)
    billed = sim.billed_total()
    report = json.loads(report_path.read_text())
    assert billed <= CAP
    assert report["totals"]["settled_tokens"] == billed
    rows = ledger_rows(store, "SELECT reserved, charged FROM calls WHERE state = 'settled'")
    assert len(rows) == THREADS * CALLS and all(charged <= reserved for reserved, charged in rows)
    with_max_tokens = sum(1 for r in records if r["max_tokens"] is not None)
    bounds = report["bounds"]
    assert bounds["added"] == THREADS * CALLS - with_max_tokens
    assert bounds["replaced"] == (with_max_tokens if replaced else 0)
    [row] = cli_json("report", "--store", store, "--format", "json")["rows"]
    assert row["bounded_calls"] == report["totals"]["bounded_calls"] == bounds["added"] + bounds["replaced"]
    assert row["cut_by_bound_calls"] == report["totals"]["cut_by_bound_calls"]
    assert f"{bounds['added']} call(s) that may think set no output bound" in result.stderr
    if replaced:
        assert f"{with_max_tokens} call(s) that may think set max_tokens" in result.stderr
