"""A real Node agent on the official `openai` npm package, guarded through `quotawrap --proxy`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import run_quotawrap

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
AGENT = NODE_DIR / "agent.js"
NODE = shutil.which("node")
CAP = 12_000

pytestmark = pytest.mark.skipif(
    NODE is None,
    reason="SKIPPED LOUDLY: node is not installed, so quotawrap --proxy is untested against a Node agent"
    " (install nodejs and npm, then `make test` runs `npm ci` in tests/node)",
)


@pytest.fixture(scope="module", autouse=True)
def _node_modules() -> None:
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        pytest.fail("tests/node/node_modules is missing: run `make node-deps` (npm ci in tests/node)")


def _records(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_node_agent_stays_under_the_cap(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """`quotawrap --proxy --cap-tokens N --base-url URL -- node agent.js`: bill <= N and settled == bill.

    Six workers alternate streamed and plain calls until refused; the refusal reaches the SDK as
    its own 429 APIError with the provider's error code, and it does not retry into the wall.
    """
    sim.configure(reply_tokens=400)
    cap = CAP
    report = tmp_path / "report.json"
    result = run_quotawrap(
        ["--store", store, "--proxy", "--cap-tokens", str(cap), "--base-url", sim.url, "--report-json", str(report)],
        [str(NODE), str(AGENT)],
        env={"OPENAI_API_KEY": "sk-node", "AGENT_WORKERS": "6", "AGENT_CALLS": "10"},
    )
    assert result.returncode == 0, result.stderr
    records = _records(result.stdout)
    ok = [r for r in records if r["outcome"] == "ok"]
    blocked = [r for r in records if r["outcome"] == "blocked"]
    assert any(r["stream"] for r in ok) and any(not r["stream"] for r in ok)
    assert blocked and all(r["code"] == "QuotawrapLimitExceeded" for r in blocked)
    assert all(r["usage_seen"] is False for r in ok if r["stream"])  # usage asked for, then hidden
    billed = sim.billed_total()
    assert 0 < billed <= cap
    assert json.loads(report.read_text())["totals"]["settled_tokens"] == billed
    assert sim.stats()["requests_by_path"] == {"/api/v3/chat/completions": len(ok)}  # refusals never sent


def test_the_same_node_agent_unguarded_overspends(sim: ArkSimulator) -> None:
    """Control: pointed straight at the provider, the same agent bills far past the cap above."""
    sim.configure(reply_tokens=400)
    env = {**os.environ, "OPENAI_BASE_URL": sim.url, "OPENAI_API_KEY": "sk-node", "AGENT_WORKERS": "6"}
    env["AGENT_CALLS"] = "10"
    subprocess.run([str(NODE), str(AGENT)], env=env, check=True, capture_output=True, timeout=120)
    assert sim.billed_total() > CAP
