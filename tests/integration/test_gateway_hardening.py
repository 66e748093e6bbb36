"""The gateway against what a careless or hostile client sends: credentials it must not show, huge and
endless requests, garbage, methods and numbers the provider does not bill or read. A real `quotawrap
serve` (or `--proxy`) process, real sockets, the real simulator."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import ledger_rows, run_quotawrap
from tests.integration.gateway_process import MODEL, chat_body, gateway
from tests.redis_server import free_port

JSON = {"content-type": "application/json", "authorization": "Bearer sk-gateway-test"}
PASSWORD = "PaSsW0rd-9f3c"


def _with_credentials(url: str) -> str:
    return url.replace("http://", f"http://alice:{PASSWORD}@", 1)


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or 80


class TestCredentialsInTheBaseUrl:
    def test_never_shown_and_the_gateway_still_works(self, sim: ArkSimulator, store: str) -> None:
        """Health, the start line, a 502's body and the log hide the password; a caller's own key still goes."""
        with gateway(["--store", store, "--base-url", _with_credentials(sim.url)]) as gw:
            health = httpx.get(f"{gw.url}/_quotawrap/health", timeout=30)
            answer = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=JSON, timeout=30)
            start_line = gw.start_line
            _code, stderr = gw.terminate()
        assert PASSWORD not in health.text and PASSWORD not in start_line and PASSWORD not in stderr
        assert health.json()["upstream"] == sim.url.replace("http://", "http://alice:***@")
        assert "alice:***@" in start_line
        assert answer.status_code == 200, answer.text  # aiohttp refused to send a key beside URL credentials
        assert sim.calls() == 1

    def test_an_unreachable_upstream_is_named_without_them(self, store: str) -> None:
        dead = _with_credentials(f"http://127.0.0.1:{free_port()}/api/v3")
        with gateway(["--store", store, "--base-url", dead]) as gw:
            answer = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=JSON, timeout=30)
            _code, stderr = gw.terminate()
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == "QuotawrapUpstreamUnavailable"
        assert PASSWORD not in answer.text and PASSWORD not in stderr
        assert "alice:***@" in answer.json()["error"]["message"]

    def test_proxy_mode_names_neither_url_with_its_password(self, sim: ArkSimulator, store: str) -> None:
        """--proxy warns that it replaces OPENAI_BASE_URL: both URLs are named with their passwords hidden."""
        result = run_quotawrap(
            ["--store", store, "--proxy", "--base-url", _with_credentials(sim.url)],
            [sys.executable, "-c", "print('ran')"],
            env={"OPENAI_BASE_URL": "http://bob:0ther-Secret@127.0.0.1:9/v1"},
        )
        assert result.returncode == 0, result.stderr
        assert "is replaced by the gateway" in result.stderr
        assert PASSWORD not in result.stderr and "0ther-Secret" not in result.stderr


class TestBigBodies:
    def test_a_body_over_the_limit_is_a_413_in_the_provider_shape(self, sim: ArkSimulator, store: str) -> None:
        """Declared by Content-Length or streamed chunked, a body past --max-body-mib is refused unsent."""
        big = chat_body(content="x" * (2 * 1024 * 1024))

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(big), 65536):
                yield big[start : start + 65536]

        with gateway(["--store", store, "--base-url", sim.url, "--max-body-mib", "1"]) as gw:
            declared = httpx.post(f"{gw.url}/chat/completions", content=big, headers=JSON, timeout=60)
            chunked = httpx.post(f"{gw.url}/chat/completions", content=chunks(), headers=JSON, timeout=60)
            small = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=JSON, timeout=60)
        for answer in (declared, chunked):
            assert answer.status_code == 413
            error = answer.json()["error"]
            assert (error["code"], error["type"], error["param"]) == (
                "QuotawrapRequestTooLarge",
                "RequestEntityTooLarge",
                "",
            )
            assert "--max-body-mib" in error["message"]
        assert small.status_code == 200
        assert sim.requests_by_path() == {"/api/v3/chat/completions": 1}  # only the small one went out

    def test_health_answers_while_a_huge_prompt_is_estimated(self, sim: ArkSimulator, store: str) -> None:
        """A 28 MB prompt is counted off the event loop: health checks are answered meanwhile, and see it
        being admitted, before its own answer comes (inline, the loop answered nothing until it was done)."""
        body = chat_body(content="hello world, a long prompt. " * 1_000_000)
        events: list[tuple[str, int]] = []
        lock = threading.Lock()

        def huge() -> None:
            answer = httpx.post(f"{gw.url}/chat/completions", content=body, headers=JSON, timeout=300)
            with lock:
                events.append(("huge", answer.status_code))

        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            caller = threading.Thread(target=huge)
            caller.start()
            while caller.is_alive():
                admitting = httpx.get(f"{gw.url}/_quotawrap/health", timeout=300).json()["admitting"]
                with lock:
                    events.append(("health", admitting))
            caller.join()
        order = [event for event in events if event == ("health", 1) or event[0] == "huge"]
        assert order[0] == ("health", 1), events  # answered while the huge prompt was being admitted
        assert order[-1][0] == "huge" and order[-1][1] == 429  # over the day's cap: refused, never sent
        assert sim.requests_by_path() == {}


def _slow_head(address: tuple[str, int]) -> socket.socket:
    """A connection that starts a request's headers and never finishes them."""
    sock = socket.create_connection(address, timeout=60)
    sock.sendall(b"POST /chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


class TestSlowClients:
    def test_headers_that_never_end_are_closed_and_the_limit_answers_503(self, sim: ArkSimulator, store: str) -> None:
        """Three connections that never finish their headers fill --max-connections 3: a fourth is answered 503
        and closed; the three are closed after --header-timeout; then a normal caller is served."""
        args = ["--store", store, "--base-url", sim.url, "--header-timeout", "2", "--max-connections", "3"]
        with gateway(args) as gw:
            address = _address(gw.url)
            slow = [_slow_head(address) for _ in range(3)]
            health = httpx.get(f"{gw.url}/_quotawrap/health", timeout=30)  # the three are counted: a 4th is over
            closed_by_gateway = [_read_all(sock) for sock in slow]  # recv returns b"" once the gateway closes
            served = httpx.post(f"{gw.url}/chat/completions", content=chat_body(), headers=JSON, timeout=30)
            for sock in slow:
                sock.close()
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "QuotawrapTooManyConnections"
        assert closed_by_gateway == [b"", b"", b""]
        assert served.status_code == 200

    def test_a_call_longer_than_the_header_timeout_is_not_cut(self, sim: ArkSimulator, store: str) -> None:
        """The timeout is on the headers only: a stream that takes longer than it runs to its end."""
        args = ["--store", store, "--base-url", sim.url, "--header-timeout", "1"]
        headers = {**JSON, "x-sim-chunk-delay-s": "0.15", "x-sim-reply-tokens": "20"}
        with gateway(args) as gw, httpx.Client(timeout=60) as client:
            with client.stream(
                "POST", f"{gw.url}/chat/completions", content=chat_body(stream=True), headers=headers
            ) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data:")]
            again = client.post(f"{gw.url}/chat/completions", content=chat_body(), headers=JSON)  # same connection
        assert lines[-1] == "data: [DONE]"
        assert again.status_code == 200
        assert sim.calls() == 2


GARBAGE = [
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET /a b c HTTP/1.1\r\n\r\n",
    b"\x00\x01\x02\x03 / HTTP/1.1\r\n\r\n",
    b"POST /chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]

SEND_GARBAGE = f"""
import os, socket
from urllib.parse import urlsplit
parts = urlsplit(os.environ["OPENAI_BASE_URL"])
for junk in {GARBAGE!r}:
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(junk)
    print(sock.recv(200).split(b"\\r\\n")[0].decode(), flush=True)
    sock.close()
"""


class TestMalformedRequests:
    def test_one_line_each_and_no_traceback_under_proxy(self, sim: ArkSimulator, store: str) -> None:
        """Garbage sent to the --proxy gateway: a 400 each, and one line each in the user's terminal."""
        result = run_quotawrap(
            ["--store", store, "--proxy", "--base-url", sim.url], [sys.executable, "-c", SEND_GARBAGE]
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == ["HTTP/1.0 400 Bad Request"] * len(GARBAGE)
        assert "Traceback" not in result.stderr
        complaints = [line for line in result.stderr.splitlines() if "gateway: Error handling request" in line]
        assert len(complaints) == 4, result.stderr  # the NUL line is refused by aiohttp without a word

    def test_serve_logs_one_line_too(self, sim: ArkSimulator, store: str) -> None:
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            for junk in GARBAGE:
                with socket.create_connection(_address(gw.url), timeout=30) as sock:
                    sock.sendall(junk)
                    assert sock.recv(200).startswith(b"HTTP/1.0 400")
            _code, stderr = gw.terminate()
        assert "Traceback" not in stderr
        assert "gateway: Error handling request from 127.0.0.1: BadStatusLine" in stderr


class TestWhatIsNeverSent:
    @pytest.mark.parametrize("method", ["PUT", "PATCH", "GET", "DELETE"])
    def test_another_method_on_a_billed_path_is_a_405(self, sim: ArkSimulator, store: str, method: str) -> None:
        """Only POST is billed on /chat/completions: the gateway answers any other method 405 itself."""
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            answer = httpx.request(method, f"{gw.url}/chat/completions", content=chat_body(), headers=JSON, timeout=30)
        assert answer.status_code == 405
        assert answer.headers["allow"] == "POST"
        assert answer.json()["error"]["code"] == "QuotawrapMethodNotAllowed"
        assert sim.requests_by_path() == {}

    def test_a_number_that_is_not_json_once_rewritten_is_refused(self, sim: ArkSimulator, store: str) -> None:
        """1e400 would go out as Infinity (the stream's usage is asked for, so the body is written again)."""
        body = chat_body(stream=True).replace(b'"stream": true', b'"stream": true, "temperature": 1e400')
        nan = chat_body().replace(b'"max_tokens"', b'"temperature": NaN, "max_tokens"')
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            overflow = httpx.post(f"{gw.url}/chat/completions", content=body, headers=JSON, timeout=30)
            not_json = httpx.post(f"{gw.url}/chat/completions", content=nan, headers=JSON, timeout=30)
        for answer, reason in ((overflow, "out of range of a 64-bit float: 1e400"), (not_json, "NaN is not")):
            assert answer.status_code == 400
            assert answer.json()["error"]["code"] == "QuotawrapUnreadableRequest"
            assert reason in answer.json()["error"]["message"]
        assert sim.requests_by_path() == {}

    def test_repeated_slashes_are_chat_not_the_legacy_completions(self, sim: ArkSimulator, store: str) -> None:
        with gateway(["--store", store, "--base-url", sim.url]) as gw:
            httpx.post(f"{gw.url}//chat//completions", content=chat_body(), headers=JSON, timeout=30)
        assert ledger_rows(store, "SELECT endpoint FROM calls") == [("chat",)]


HOOKED_CALLS = """
import json, os, httpx
url = os.environ["SIM_URL"] + "/chat/completions"
headers = {"authorization": "Bearer sk-test", "content-type": "application/json"}
messages = [{"role": "user", "content": "hi"}]
body = json.dumps({"model": "MODEL_NAME", "messages": messages, "max_tokens": 20, "stream": True})
for method in ("PUT", "PATCH", "GET"):
    print(method, httpx.request(method, url, content=body, headers=headers).status_code)
overflow = body.replace('"stream": true', '"stream": true, "temperature": 1e400')
print("1e400", httpx.post(url, content=overflow, headers=headers).status_code)
""".replace("MODEL_NAME", MODEL)


def test_the_hook_refuses_them_the_same_way(sim: ArkSimulator, store: str) -> None:
    """The one routing rule: inside a guarded program the same requests get the same answers, unsent."""
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url], [sys.executable, "-c", HOOKED_CALLS], env={"SIM_URL": sim.url}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["PUT", "405", "PATCH", "405", "GET", "405", "1e400", "400"]
    assert sim.requests_by_path() == {}
