"""``GET /metrics`` on a real ``quotawrap serve``, after real guarded runs on SQLite and Redis: the figures equal
``status --json``'s and ``report``'s, and the gateway answers it itself (nothing is forwarded)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, cli_json, run_quotawrap, start_cli
from tests.integration.gateway_process import chat_body, gateway
from tests.redis_server import private_server, session_url

MODEL = "deepseek-v4-flash"
# The limits every command of a test runs with: status explains the limits it is told
LIMITS = ["--daily-cap", "3000", "--usage-wall", "3000", "--wait", "0"]


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest, store: str) -> Iterator[str]:
    if request.param == "sqlite":
        yield store
        return
    with session_url() as url:
        yield url


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels), as Prometheus's own parser reads it."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    answer = httpx.get(f"{url}/metrics", timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    return _samples(answer.text)


def _guarded_runs(sim: ArkSimulator, store: str) -> None:
    """Two teams' runs, until the day's cap refuses their calls."""
    for team in ("alpha", "beta"):
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--tag", f"team={team}", *LIMITS],
            child("swarm.py", "--threads", "3", "--max-calls", "3", "--max-tokens", "200", "--model", MODEL),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr


def _report(store: str, by: str) -> dict[str, dict[str, Any]]:
    rows = cli_json("report", "--store", store, "--by", by, "--format", "json")["rows"]
    return {row["key"]: row for row in rows}


def test_metrics_equal_status_and_report(sim: ArkSimulator, store_url: str, tmp_path: Path) -> None:
    """Each model's settled, in-flight, limit, headroom and waiting figures are status --json's; refusals and
    the tag counters are report's; and the gateway did not forward the scrape."""
    sim.configure(reply_tokens=300)
    _guarded_runs(sim, store_url)
    calls_before = sim.calls()
    # this host's runs, read from their events logs by both: this test's alone, not the machine's
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}
    with gateway(["--store", store_url, "--base-url", sim.url, *LIMITS], env=state) as gw:
        samples = _scrape(gw.url)
        status = cli_json("status", "--store", store_url, "--json", *LIMITS[:4], env=state)
    assert sim.calls() == calls_before  # answered by the gateway, not the upstream
    (row,) = status
    model = (("model", MODEL),)
    assert samples[("quotawrap_settled_tokens_total", model)] == row["usage"] == sim.billed_total() > 0
    assert samples[("quotawrap_inflight_tokens", model)] == row["in_flight"]
    assert samples[("quotawrap_headroom_tokens", model)] == row["headroom"]
    assert samples[("quotawrap_waiting_calls", model)] == row["waiting"]
    assert samples[("quotawrap_limit_tokens", (("limit", "effective"), *model))] == row["effective_limit"] == 3000
    assert samples[("quotawrap_unguarded_processes", ())] == len(row["unguarded_processes"]) == 0
    by_model = _report(store_url, "model")
    refused = by_model[MODEL]["blocked_calls"]
    assert samples[("quotawrap_refused_calls_total", model)] == refused > 0  # the cap refused some
    teams = _report(store_url, "tag:team")
    for team in ("alpha", "beta"):
        key = ("quotawrap_tag_settled_tokens_total", (("tag", "team"), ("value", team)))
        assert samples[key] == teams[team]["settled_tokens"]
    users = sum(value for (name, labels), value in samples.items() if dict(labels).get("tag") == "user")
    assert users == row["usage"]  # every call carries the automatic user tag


def test_each_scrape_reads_the_store_anew(sim: ArkSimulator, store_url: str) -> None:
    """A call through the gateway between two scrapes: the second shows its tokens (no figure kept in memory)."""
    sim.configure(reply_tokens=120)
    headers = {"content-type": "application/json", "authorization": "Bearer sk-test"}
    model = (("model", MODEL),)
    with gateway(["--store", store_url, "--base-url", sim.url]) as gw:
        answer = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        first = _scrape(gw.url)[("quotawrap_settled_tokens_total", model)]
        billed_first = sim.billed_total()
        again = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=headers, timeout=60)
        assert again.status_code == 200, again.text
        second = _scrape(gw.url)[("quotawrap_settled_tokens_total", model)]
    assert first == json.loads(answer.content)["usage"]["total_tokens"] == billed_first > 0
    assert second == sim.billed_total() > first


def test_dashboard_answers_metrics_too(sim: ArkSimulator, store_url: str, tmp_path: Path) -> None:
    """``quotawrap dashboard`` serves the same exposition beside its page (once the dashboard is in the tree)."""
    pytest.importorskip("quotawrap.dashboard", reason="quotawrap dashboard comes with the dashboard's branch")
    sim.configure(reply_tokens=300)
    _guarded_runs(sim, store_url)
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}
    dashboard = start_cli("dashboard", "--store", store_url, "--port", "0", *LIMITS[:4], env=state)
    try:
        assert dashboard.stdout is not None
        found = re.search(r"on (http://\S+)", dashboard.stdout.readline())
        assert found, dashboard.stderr.read() if dashboard.stderr else ""
        samples = _scrape(found.group(1).rstrip("/"))
    finally:
        dashboard.terminate()
        dashboard.communicate(timeout=30)
    (row,) = cli_json("status", "--store", store_url, "--json", *LIMITS[:4], env=state)
    model = (("model", MODEL),)
    assert samples[("quotawrap_settled_tokens_total", model)] == row["usage"] == sim.billed_total() > 0
    assert samples[("quotawrap_inflight_tokens", model)] == row["in_flight"]
    assert samples[("quotawrap_limit_tokens", (("limit", "effective"), *model))] == row["effective_limit"]


@pytest.mark.redis
def test_a_store_that_cannot_be_read_is_a_503(sim: ArkSimulator) -> None:
    """Redis stops: a scrape is answered 503 in one line, and answered again once Redis is back."""
    with private_server(appendonly=True) as server, gateway(["--store", server.url, "--base-url", sim.url]) as gw:
        assert httpx.get(f"{gw.url}/metrics", timeout=30).status_code == 200
        server.stop()
        down = httpx.get(f"{gw.url}/metrics", timeout=60)
        server.start()
        back = httpx.get(f"{gw.url}/metrics", timeout=60)
    assert down.status_code == 503
    assert down.text.startswith("quotawrap: cannot read the store for /metrics: ") and down.text.count("\n") == 1
    assert back.status_code == 200 and "quotawrap_unguarded_processes" in back.text
