"""Tests for quotawrap.intercept.requests_adapter, against the real in-process Ark simulator.

No ``responses`` mocking here: it replaces ``HTTPAdapter.send``, the very method the adapter
wraps. The simulator is a real HTTP server on loopback, so urllib3, chunked bodies and broken
connections are all real.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from quotawrap.admission.guard import Guard
from quotawrap.intercept import requests_adapter
from quotawrap.simulator import ArkSimulator
from tests.conftest import ledger_rows

MODEL = "doubao-seed-1-6-250615"
AUTH = {"Authorization": "Bearer sk-test"}
ROWS = "SELECT state, reserved, charged, would_block FROM calls"


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 64, **extra}


def _rows(store: str) -> list[tuple[Any, ...]]:
    """The calls the ledger recorded (none when the guard never opened it)."""
    if not Path(store.removeprefix("sqlite:///")).exists():
        return []
    return ledger_rows(store, ROWS)


def _is_usage_only(line: bytes | str) -> bool:
    text = line.decode() if isinstance(line, bytes) else line
    return text.startswith("data: {") and json.loads(text[6:]).get("choices") == []


@pytest.fixture(autouse=True)
def patched() -> Iterator[None]:
    """requests patched for the test (and left as it was found)."""
    was_patched = getattr(requests.adapters.HTTPAdapter, "_quotawrap_patched", False)
    requests_adapter.patch(requests)
    yield
    if not was_patched:
        requests_adapter.unpatch(requests)


def _assert_settled(store: str, sim: ArkSimulator) -> None:
    """One call, settled at exactly what the provider billed."""
    assert sim.billed_total() > 0
    assert [(row[0], row[2]) for row in _rows(store)] == [("settled", sim.billed_total())]


def _assert_charged_in_full(store: str) -> None:
    [(state, reserved, charged, _)] = _rows(store)
    assert (state, charged) == ("unresolved", reserved)
    assert reserved > 0


class TestNotGuarded:
    def test_other_base_url_passes_untouched(
        self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A server outside every guarded base URL: no usage injected, no identity override, no ledger."""
        make_guard(base_url=("http://127.0.0.1:9/api/v3",))
        response = requests.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=AUTH, stream=True)
        lines = [line for line in response.iter_lines() if line]
        assert response.status_code == 200
        assert not any(_is_usage_only(line) for line in lines)
        assert response.request.headers.get("Accept-Encoding") != "identity"
        assert _rows(store) == []


class TestJson:
    def test_stream_false_settles(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """A non-streamed answer is charged exactly its usage; the request asked for identity encoding."""
        make_guard()
        response = requests.post(sim.url + "/chat/completions", json=_chat(), headers=AUTH)
        assert response.json()["usage"]["total_tokens"] == sim.billed_total()
        assert response.request.headers["Accept-Encoding"] == "identity"
        _assert_settled(store, sim)

    def test_stream_true_then_json(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """stream=True then .json(): the body passes the tee all the same."""
        make_guard()
        response = requests.post(sim.url + "/chat/completions", json=_chat(), headers=AUTH, stream=True)
        assert response.json()["usage"]["total_tokens"] == sim.billed_total()
        _assert_settled(store, sim)

    def test_raw_read_whole(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """One `raw.read()` returns the whole body: that is its end, so the call settles (not charged whole)."""
        make_guard()
        response = requests.post(sim.url + "/chat/completions", json=_chat(), headers=AUTH, stream=True)
        body = json.loads(response.raw.read())
        response.close()
        assert body["usage"]["total_tokens"] == sim.billed_total()
        _assert_settled(store, sim)

    def test_raw_read_in_pieces(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """`raw.read(n)` until b'' settles at the empty read."""
        make_guard()
        response = requests.post(sim.url + "/chat/completions", json=_chat(), headers=AUTH, stream=True)
        pieces = []
        while piece := response.raw.read(7):
            pieces.append(piece)
        assert json.loads(b"".join(pieces))["usage"]["total_tokens"] == sim.billed_total()
        _assert_settled(store, sim)

    def test_responses_endpoint(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """The Responses API's input/output usage shape settles too."""
        make_guard()
        body = {"model": MODEL, "input": "Say hi", "max_output_tokens": 64}
        response = requests.post(sim.url + "/responses", json=body, headers=AUTH)
        assert response.status_code == 200
        _assert_settled(store, sim)


class TestStreams:
    def test_iter_lines_hides_the_injected_chunk(
        self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """The request asks for usage; the caller's lines lack the usage-only chunk; the ledger has it."""
        make_guard()
        response = requests.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=AUTH, stream=True)
        lines = [line for line in response.iter_lines() if line]
        assert json.loads(response.request.body)["stream_options"] == {"include_usage": True}
        assert lines[-1] == b"data: [DONE]"
        assert not any(_is_usage_only(line) for line in lines)
        _assert_settled(store, sim)

    def test_iter_content(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """Byte chunks of any size: same hiding, same settlement."""
        make_guard()
        response = requests.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=AUTH, stream=True)
        text = b"".join(response.iter_content(chunk_size=5)).decode()
        assert '"choices":[]' not in text.replace(" ", "")
        assert text.rstrip().endswith("data: [DONE]")
        _assert_settled(store, sim)

    def test_stream_false_on_an_event_stream(
        self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A stream read whole (.text) is hidden and settled as well."""
        make_guard()
        response = requests.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=AUTH)
        assert not any(_is_usage_only(line) for line in response.text.splitlines() if line)
        _assert_settled(store, sim)

    def test_caller_asked_for_usage(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """The caller's own include_usage: its body is sent as is and the chunk is visible."""
        make_guard(bound=False)
        raw = json.dumps(_chat(stream=True, stream_options={"include_usage": True})).encode()
        headers = {**AUTH, "Content-Type": "application/json"}
        response = requests.post(sim.url + "/chat/completions", data=raw, headers=headers, stream=True)
        lines = [line for line in response.iter_lines() if line]
        assert response.request.body == raw
        assert any(_is_usage_only(line) for line in lines)
        _assert_settled(store, sim)

    def test_early_close_charges_the_hold(
        self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A reader that stops after the first line and closes: the whole hold is charged."""
        make_guard()
        response = requests.post(
            sim.url + "/chat/completions",
            json=_chat(stream=True),
            headers={**AUTH, "x-sim-chunk-delay-s": "0.05"},
            stream=True,
        )
        for _line in response.iter_lines():
            break
        response.close()
        _assert_charged_in_full(store)

    def test_cut_stream_charges_the_hold(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """The provider drops the connection mid-stream: the caller sees the error, the hold is charged."""
        make_guard()
        headers = {**AUTH, "x-sim-fault": "cut"}
        response = requests.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=headers, stream=True)
        with pytest.raises(requests.exceptions.RequestException):
            for _line in response.iter_lines():
                pass
        _assert_charged_in_full(store)

    def test_cut_json_charges_the_hold(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """A JSON answer cut before its body: the hold is charged."""
        make_guard()
        headers = {**AUTH, "x-sim-fault": "cut"}
        with pytest.raises(requests.exceptions.RequestException):
            requests.post(sim.url + "/chat/completions", json=_chat(), headers=headers)
        _assert_charged_in_full(store)

    def test_no_usage_in_the_stream_charges_the_hold(
        self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A provider that ignores include_usage: nothing to reconcile with, the hold is charged."""
        make_guard()
        headers = {**AUTH, "x-sim-fault": "no_usage"}
        requests.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=headers).close()
        _assert_charged_in_full(store)


class TestBlocked:
    def test_synthetic_429(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """Over the cap: a complete requests.Response with Ark's error body, and the server never hears of it."""
        make_guard(cap_tokens=1)
        url = sim.url + "/chat/completions"
        response = requests.post(url, json=_chat(), headers=AUTH)
        assert response.status_code == 429
        assert response.reason == "Too Many Requests"
        assert response.headers["x-should-retry"] == "false"
        assert response.headers["Content-Type"].startswith("application/json")
        assert response.json()["error"]["code"] == "QuotawrapLimitExceeded"
        assert response.url == url
        assert not response.ok
        with pytest.raises(requests.HTTPError):
            response.raise_for_status()
        assert sim.requests_by_path() == {}
        assert [row[0] for row in _rows(store)] == ["blocked"]

    def test_streaming_caller_reads_the_429(self, sim: ArkSimulator, make_guard: Callable[..., Guard]) -> None:
        """stream=True callers can iterate the synthetic body."""
        make_guard(cap_tokens=1)
        response = requests.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=AUTH, stream=True)
        body = b"".join(response.iter_content(chunk_size=16))
        assert json.loads(body)["error"]["type"] == "TooManyRequests"
        assert sim.requests_by_path() == {}

    def test_unreadable_body_is_refused(self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str) -> None:
        """Form data to a chat endpoint cannot be guarded: a synthetic 400, nothing sent."""
        make_guard()
        response = requests.post(sim.url + "/chat/completions", data={"model": MODEL}, headers=AUTH)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "QuotawrapUnreadableRequest"
        assert sim.requests_by_path() == {}
        assert _rows(store) == []

    def test_ledger_failure_is_503(self, sim: ArkSimulator, make_guard: Callable[..., Guard], tmp_path: Path) -> None:
        """No ledger, no spending: a 503 naming the store."""
        blocker = tmp_path / "file"
        blocker.write_text("")
        make_guard(store=f"sqlite:///{blocker / 'ledger.sqlite3'}")
        response = requests.post(sim.url + "/chat/completions", json=_chat(), headers=AUTH)
        assert response.status_code == 503
        assert str(blocker) in response.json()["error"]["message"]
        assert sim.requests_by_path() == {}


class TestErrors:
    @pytest.mark.parametrize("fault", ["error_400", "error_500"])
    def test_error_answers_are_released(
        self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str, fault: str
    ) -> None:
        """Ark's own error answers come before generation: nothing is charged."""
        make_guard()
        headers = {**AUTH, "x-sim-fault": fault}
        response = requests.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=headers)
        assert response.status_code >= 400
        assert [(row[0], row[2]) for row in _rows(store)] == [("released", 0)]

    def test_connection_refused_is_released(self, make_guard: Callable[..., Guard], store: str) -> None:
        """Nothing listening: nothing was sent, the hold is released, the error reaches the caller."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        base = f"http://127.0.0.1:{port}/api/v3"
        make_guard(base_url=(base,))
        with pytest.raises(requests.ConnectionError):
            requests.post(base + "/chat/completions", json=_chat(), headers=AUTH, timeout=10)
        assert [(row[0], row[2]) for row in _rows(store)] == [("released", 0)]


class TestPatching:
    def test_patch_is_idempotent(self) -> None:
        """Patching twice leaves one wrapper over the original send."""
        requests_adapter.patch(requests)
        send = requests.adapters.HTTPAdapter.send
        assert hasattr(send, "__wrapped__")
        assert not hasattr(send.__wrapped__, "__wrapped__")

    def test_unpatch_restores_the_original(
        self, sim: ArkSimulator, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """Unpatched, the guard is out of the way: an over-cap call reaches the server."""
        make_guard(cap_tokens=1)
        original = requests.adapters.HTTPAdapter.send.__wrapped__
        requests_adapter.unpatch(requests)
        try:
            assert requests.adapters.HTTPAdapter.send is original
            assert requests.post(sim.url + "/chat/completions", json=_chat(), headers=AUTH).status_code == 200
        finally:
            requests_adapter.patch(requests)
        assert _rows(store) == []
