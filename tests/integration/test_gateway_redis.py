"""A team service: two `quotawrap serve` gateways on one private Redis share one quota."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import cli_json
from tests.integration.gateway_process import chat_body, gateway
from tests.redis_server import private_server, session_url

pytestmark = pytest.mark.redis


@pytest.fixture
def redis_url() -> Iterator[str]:
    with session_url() as url:
        yield url


def _until_refused(url: str, user: str, stream: bool) -> list[int]:
    """One client: calls until five in a row are refused (a hold of another client may free up), at most 40."""
    codes: list[int] = []
    headers = {
        "content-type": "application/json",
        "authorization": f"Bearer sk-{user}",
        "x-quotawrap-tag": f"user={user}",
    }
    with httpx.Client(timeout=60) as client:
        for n in range(40):
            body = chat_body(stream=stream, content=f"{user} {n}")
            codes.append(client.post(f"{url}/chat/completions", content=body, headers=headers).status_code)
            if codes[-5:] == [429] * 5:
                break
    return codes


def test_two_gateways_share_one_daily_cap(sim: ArkSimulator, redis_url: str) -> None:
    """16 clients split over two gateways on one Redis ledger: the bill stays within one shared cap.

    The clients ask for far more than twice the cap, so two gateways that did not share it would bill past it.
    """
    sim.configure(reply_tokens=400)
    cap = 16_000
    args = ["--store", redis_url, "--base-url", sim.url, "--daily-cap", str(cap), "--usage-wall", str(cap)]
    with gateway(args) as first, gateway(args) as second:
        for gw in (first, second):
            health = httpx.get(f"{gw.url}/_quotawrap/health", timeout=10)
            assert health.status_code == 200 and health.json()["status"] == "ok"
        jobs = [(gw.url, f"user{n}", n % 2 == 0) for n, gw in enumerate([first, second] * 8)]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            results = list(pool.map(lambda job: _until_refused(*job), jobs))
        assert first.terminate()[0] == 0 and second.terminate()[0] == 0
    codes = [code for result in results for code in result]
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}
    billed = sim.billed_total()
    # every hold is >= 4,096 tokens (the thinking floor): within one hold of the cap is all that fits
    assert cap - 5_000 <= billed <= cap
    rows = cli_json("report", "--store", redis_url, "--by", "session", "--format", "json")["rows"]
    assert len(rows) == 2  # one session per gateway, both counted against the one cap
    assert all(row["calls"] + row["blocked_calls"] > 0 for row in rows)  # each gateway took its clients' calls
    assert sum(row["settled_tokens"] for row in rows) == billed


def test_ledger_down_is_a_503_in_the_provider_shape_and_health_says_so(sim: ArkSimulator) -> None:
    """Redis stops: health turns 503, calls are refused 503 QuotawrapStoreUnavailable, never sent; then recovers."""
    with private_server(appendonly=True) as server, gateway(["--store", server.url, "--base-url", sim.url]) as gw:
        headers = {"content-type": "application/json", "authorization": "Bearer sk-team"}
        assert httpx.get(f"{gw.url}/_quotawrap/health", timeout=30).status_code == 200
        server.stop()
        health = httpx.get(f"{gw.url}/_quotawrap/health", timeout=30)
        refused = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=headers, timeout=30)
        server.start()
        recovered = httpx.get(f"{gw.url}/_quotawrap/health", timeout=30)
        answered = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=headers, timeout=30)
    assert (health.status_code, health.json()["status"]) == (503, "ledger unavailable")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "QuotawrapStoreUnavailable"
    assert recovered.status_code == 200 and answered.status_code == 200
    assert sim.calls() == 1


def test_a_stalled_ledger_does_not_stall_the_gateway(sim: ArkSimulator) -> None:
    """Redis frozen (SIGSTOP) while a call waits to reserve: other traffic still passes through meanwhile.

    The ledger's round trips run off the event loop; run inline, the GET below would wait for the
    frozen Redis's socket timeout (5 s) and miss its own 3 s bound.
    """
    with private_server(appendonly=False) as server, gateway(["--store", server.url, "--base-url", sim.url]) as gw:
        assert server.process is not None
        headers = {"content-type": "application/json", "authorization": "Bearer sk-team"}
        waiting: list[int] = []
        os.kill(server.process.pid, signal.SIGSTOP)
        try:

            def guarded_call() -> None:
                answer = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=headers, timeout=120)
                waiting.append(answer.status_code)

            caller = threading.Thread(target=guarded_call)
            caller.start()
            passing = httpx.get(f"{gw.url}/models", headers=headers, timeout=3)
            still_waiting = caller.is_alive()
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        caller.join(120)
    assert still_waiting  # the guarded call was held up by the frozen ledger ...
    assert passing.status_code == 404  # ... while the gateway relayed the simulator's answer to another
    assert waiting and waiting[0] in (200, 503)
