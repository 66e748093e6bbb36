"""`quotawrap serve` and `quotawrap --proxy`: a real gateway process, real clients, the real simulator."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import cli_json, ledger_rows, run_quotawrap
from tests.integration.gateway_process import MODEL, chat_body, gateway

JSON = {"content-type": "application/json", "authorization": "Bearer sk-gateway-test"}

CURL_LOOP = r"""
set -u
for i in $(seq 1 40); do
  if [ $((i % 2)) -eq 0 ]; then stream=true; else stream=false; fi
  code=$(curl -sS -o /dev/null -w '%{http_code}' "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"max_tokens\": 300, \"stream\": $stream,
         \"messages\": [{\"role\": \"user\", \"content\": \"call $i\"}]}")
  echo "$stream $code"
done
"""


@contextlib.contextmanager
def slow_stream(gateway_url: str, *, delay_s: str, tokens: str) -> Iterator[tuple[str, Iterator[str]]]:
    """A slowly streamed call through the gateway, read up to its first event: (that event, the lines after)."""
    headers = {**JSON, "x-sim-chunk-delay-s": delay_s, "x-sim-reply-tokens": tokens}
    url = f"{gateway_url}/chat/completions"
    with httpx.stream("POST", url, content=chat_body(stream=True), headers=headers, timeout=60) as response:
        lines = response.iter_lines()
        yield next(line for line in lines if line.startswith("data:")), lines


def _settled(report: Path) -> int:
    return int(json.loads(report.read_text())["totals"]["settled_tokens"])


class TestProxyRun:
    def test_curl_loop_stays_under_the_cap(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """A bash loop of curl on $OPENAI_BASE_URL under --proxy: bill <= cap, settled == bill, 429s after."""
        sim.configure(reply_tokens=400)
        cap = 6_000
        script = tmp_path / "loop.sh"
        script.write_text(CURL_LOOP)
        report = tmp_path / "report.json"
        args = ["--store", store, "--proxy", "--cap-tokens", str(cap), "--base-url", sim.url]
        result = run_quotawrap(
            [*args, "--report-json", str(report)],
            ["bash", str(script)],
            env={"OPENAI_API_KEY": "sk-curl", "MODEL": MODEL},
        )
        assert result.returncode == 0, result.stderr
        codes = [line.split() for line in result.stdout.splitlines()]
        assert ["true", "200"] in codes and ["false", "200"] in codes
        assert any(code == "429" for _, code in codes)
        assert {code for _, code in codes} <= {"200", "429"}
        billed = sim.billed_total()
        assert 0 < billed <= cap
        assert _settled(report) == billed

    def test_the_same_loop_without_quotawrap_overspends(self, sim: ArkSimulator, tmp_path: Path) -> None:
        """Control: the loop pointed straight at the provider runs far past the cap the test above keeps."""
        sim.configure(reply_tokens=400)
        script = tmp_path / "loop.sh"
        script.write_text(CURL_LOOP)
        env = {**os.environ, "OPENAI_BASE_URL": sim.url, "OPENAI_API_KEY": "sk-curl", "MODEL": MODEL}
        subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True, timeout=120)
        assert sim.billed_total() > 6_000

    def test_python_child_keeps_its_hook_and_no_call_counts_twice(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """Under --proxy a Python child's calls to the gateway are the gateway's, its direct calls the hook's.

        Three calls through OPENAI_BASE_URL (the gateway) and three straight to the provider (the
        in-process hook): six ledger rows, three by the wrapper's gateway and three by the child.
        """
        script = tmp_path / "both.py"
        script.write_text(
            "import os, openai\n"
            "via_gateway = openai.OpenAI(api_key='sk-py', max_retries=0)\n"
            "direct = openai.OpenAI(base_url=os.environ['SIM_URL'], api_key='sk-py', max_retries=0)\n"
            "print('GATEWAY', via_gateway.base_url, 'CHILD', os.getpid(), flush=True)\n"
            "for client in (via_gateway, direct):\n"
            "    for _ in range(3):\n"
            f"        client.chat.completions.create(model={MODEL!r}, max_tokens=50,\n"
            "            messages=[{'role': 'user', 'content': 'hi'}])\n"
        )
        report = tmp_path / "report.json"
        result = run_quotawrap(
            ["--store", store, "--proxy", "--base-url", sim.url, "--report-json", str(report)],
            [sys.executable, str(script)],
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        words = result.stdout.split()
        assert words[1].startswith("http://127.0.0.1:")  # the SDK read OPENAI_BASE_URL
        child_pid = int(words[3])
        pids = [pid for (pid,) in ledger_rows(store, "SELECT pid FROM calls WHERE state = 'settled'")]
        assert len(pids) == 6
        assert pids.count(child_pid) == 3  # the hook, in the child
        assert sim.calls() == 6
        assert _settled(report) == sim.billed_total()


class TestServe:
    def test_status_headers_and_body_pass_through(self, sim: ArkSimulator, store: str) -> None:
        """The upstream's status, headers and body reach the caller unchanged, errors included."""
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            ok = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=JSON, timeout=30)
            failed = httpx.post(
                f"{gw.url}/chat/completions",
                content=chat_body(),
                headers={**JSON, "x-sim-fault": "error_400"},
                timeout=30,
            )
            models = httpx.get(f"{gw.url}/models", timeout=30)
            direct_models = httpx.get(f"{sim.url}/models", timeout=30)
        assert ok.status_code == 200
        assert ok.headers["server"] == "ArkSimulator/0.1"  # the upstream's, not the gateway's
        assert ok.headers["x-request-id"] == ok.json()["id"]
        assert int(ok.headers["content-length"]) == len(ok.content)
        assert ok.json()["usage"]["total_tokens"] > 0
        assert failed.status_code == 400
        assert failed.json()["error"]["type"] == "BadRequest"
        assert models.status_code == direct_models.status_code  # a GET, not guarded, forwarded as it is
        assert (
            models.json()["error"]["message"].split(" Request id")[0]
            == (direct_models.json()["error"]["message"].split(" Request id")[0])
        )
        (settled,) = ledger_rows(store, "SELECT SUM(charged) FROM calls WHERE state = 'settled'")[0]
        assert settled == sim.billed_total()
        assert ledger_rows(store, "SELECT COUNT(*) FROM calls WHERE state = 'released'") == [(1,)]

    def test_stream_chunks_reach_the_caller_as_they_arrive(self, sim: ArkSimulator, store: str) -> None:
        """The first chunk of a slow stream arrives while the upstream is still producing the rest."""
        with (
            gateway(["--store", store, "--base-url", sim.url]) as gw,
            slow_stream(gw.url, delay_s="0.3", tokens="40") as (first, lines),
        ):
            health = httpx.get(f"{gw.url}/_quotawrap/health", timeout=10).json()
            rest = [line for line in lines if line.startswith("data:")]
        assert json.loads(first[5:])["object"] == "chat.completion.chunk"
        assert health["in_flight"] == 1  # the stream had not ended when its first chunk arrived
        assert rest[-1] == "data: [DONE]"
        assert not any('"usage": {' in line or '"usage":{' in line for line in rest)  # injected, then hidden
        (settled,) = ledger_rows(store, "SELECT SUM(charged) FROM calls WHERE state = 'settled'")[0]
        assert settled == sim.billed_total() > 0

    def test_refusal_is_a_provider_error_and_never_sent(self, sim: ArkSimulator, store: str) -> None:
        """A call over the cap is answered 429 in Ark's error shape, and the provider never sees it."""
        with gateway(["--store", store, "--base-url", sim.url, "--cap-tokens", "1000"]) as gw:
            # even sent with its max_tokens as the whole-output bound, the call is more than the whole cap
            body = chat_body(max_tokens=5_000)
            refused = httpx.post(f"{gw.url}/chat/completions", content=body, headers=JSON, timeout=30)
        assert refused.status_code == 429
        assert refused.headers["x-should-retry"] == "false"
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("QuotawrapLimitExceeded", "TooManyRequests")
        assert "run_cap" in error["message"]
        assert sim.calls() == 0

    def test_unreachable_upstream_is_a_502_and_the_hold_is_released(self, store: str) -> None:
        """Nothing listens upstream: the caller gets a provider-shaped 502 and nothing is charged."""
        from tests.redis_server import free_port

        dead = f"http://127.0.0.1:{free_port()}/api/v3"
        with gateway(["--store", store, "--base-url", dead]) as gw:
            answer = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=JSON, timeout=30)
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == "QuotawrapUpstreamUnavailable"
        assert ledger_rows(store, "SELECT state, charged FROM calls") == [("released", 0)]

    def test_a_caller_that_hangs_up_mid_stream_is_charged_its_hold(self, sim: ArkSimulator, store: str) -> None:
        """The caller closes a slow stream after one chunk: its outcome is unknown, so the whole hold is charged."""
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            with slow_stream(gw.url, delay_s="0.2", tokens="40"):
                pass  # hung up after the first event
            for _ in range(100):  # the gateway notices at its next write; then nothing is in flight
                if httpx.get(f"{gw.url}/_quotawrap/health", timeout=10).json()["in_flight"] == 0:
                    break
                time.sleep(0.1)
        ((state, charged, reserved),) = ledger_rows(store, "SELECT state, charged, reserved FROM calls")
        assert (state, charged) == ("unresolved", reserved)
        assert int(str(charged)) >= sim.billed_total()

    def test_attribution_by_tag_header_and_key_fingerprint(self, sim: ArkSimulator, store: str) -> None:
        """X-Quotawrap-Tag and the bearer key's fingerprint attribute each call; the key itself is never stored."""
        keys = {"alice": "sk-alice-secret-0001", "bob": "sk-bob-secret-0002"}
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            for user, n in (("alice", 2), ("bob", 1)):
                for _ in range(n):
                    answer = httpx.post(
                        f"{gw.url}/chat/completions",
                        content=chat_body(),
                        headers={**JSON, "authorization": f"Bearer {keys[user]}", "x-quotawrap-tag": f"user={user}"},
                        timeout=30,
                    )
                    assert answer.status_code == 200
            bad = httpx.post(
                f"{gw.url}/chat/completions", content=chat_body(), headers={**JSON, "X-Quotawrap-Tag": "nonsense"}
            )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "QuotawrapBadTag"
        assert sim.calls() == 3
        rows = ledger_rows(store, "SELECT tags, key_fingerprint FROM calls")
        by_user: dict[str, set[str]] = {}
        for tags, fingerprint in rows:
            by_user.setdefault(json.loads(str(tags))["user"], set()).add(str(fingerprint))
        assert set(by_user) == {"alice", "bob"}
        assert all(len(prints) == 1 and next(iter(prints)).startswith("sha256:") for prints in by_user.values())
        assert by_user["alice"] != by_user["bob"]
        report = cli_json("report", "--store", store, "--by", "tag:user", "--format", "json")
        calls = {row["key"]: row["calls"] for row in report["rows"]}
        assert calls == {"alice": 2, "bob": 1}
        ledger_bytes = b"".join(
            p.read_bytes() for p in Path(store.removeprefix("sqlite:///")).parent.iterdir() if p.is_file()
        )
        assert not any(key.encode() in ledger_bytes for key in keys.values())

    def test_health_endpoint(self, sim: ArkSimulator, store: str) -> None:
        """GET /_quotawrap/health answers from the gateway itself: ok, its upstream, nothing in flight."""
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            health = httpx.get(f"{gw.url}/_quotawrap/health", timeout=10)
        assert health.status_code == 200
        body = health.json()
        assert (body["status"], body["upstream"], body["in_flight"]) == ("ok", sim.url, 0)
        assert body["run_id"].startswith("serve-")
        assert sim.calls() == 0 and sim.stats()["requests_by_path"] == {}

    def test_sigterm_drains_and_settles_the_call_in_flight(self, sim: ArkSimulator, store: str) -> None:
        """SIGTERM mid-stream: the gateway stops accepting, lets the stream finish, settles it, exits 0."""
        results: list[tuple[int, str]] = []
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            with slow_stream(gw.url, delay_s="0.2", tokens="30") as (_, lines):
                stopper = threading.Thread(target=lambda: results.append(gw.terminate()))
                stopper.start()
                rest = list(lines)
            stopper.join(60)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(f"{gw.url}/_quotawrap/health", timeout=5)
        code, stderr = results[0]
        assert code == 0, stderr
        assert "data: [DONE]" in rest
        assert ledger_rows(store, "SELECT state, charged FROM calls") == [("settled", sim.billed_total())]
        assert sim.billed_total() > 0

    def test_a_hook_in_the_gateway_process_does_not_guard_its_calls_twice(self, sim: ArkSimulator, store: str) -> None:
        """`quotawrap -- quotawrap serve`: the outer hook is in the gateway, which still reserves each call once."""
        outer = ["--store", store, "--base-url", sim.url, "--quiet"]
        with gateway(["--store", store, "--base-url", sim.url], wrapped_by=outer) as gw:
            for stream in (False, True):
                answer = httpx.post(
                    f"{gw.url}/chat/completions", content=chat_body(stream=stream), headers=JSON, timeout=30
                )
                assert answer.status_code == 200
        assert sim.calls() == 2
        assert ledger_rows(store, "SELECT COUNT(*) FROM calls") == [(2,)]
