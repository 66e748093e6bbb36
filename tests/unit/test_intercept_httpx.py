"""Tests for quotawrap.intercept.httpx_adapter: the guard wrapped around httpx and httpx2.

httpx is mocked with respx (its httpcore mocker, so httpx's real transport and response streams
run); respx cannot mock httpx2 (its transport sits on httpcore2), so httpx2 gets its own
``MockTransport``, which the adapter covers just as well: it wraps ``Client._send_single_request``,
the one place every transport's answer passes.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import respx
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.intercept import get_guard, httpx_adapter, set_guard
from tests.conftest import ledger_rows

BASE = "http://testserver/api/v3"
CHAT = BASE + "/chat/completions"
MODEL = "doubao-seed-1-6-250615"
USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
ROWS = "SELECT state, reserved, charged, would_block, prompt_tokens FROM calls"

Handler = Callable[[Any], Any]


def _chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 50, **extra}


def _completion(usage: dict[str, int] | None = USAGE) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "0217abc",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def _chunk(choices: list[Any], usage: dict[str, int] | None = None) -> bytes:
    frame = {"id": "0217abc", "object": "chat.completion.chunk", "model": MODEL, "choices": choices, "usage": usage}
    return b"data: " + json.dumps(frame, separators=(",", ":")).encode() + b"\n\n"


CONTENT_FRAMES = [
    _chunk([{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]),
    _chunk([{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]),
    _chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
]
USAGE_FRAME = _chunk([], USAGE)
DONE_FRAME = b"data: [DONE]\n\n"


# -- a fake provider, for either module ----------------------------------------------------------

_STREAM_CLASSES: dict[str, type] = {}


def _chunk_stream(module: ModuleType, chunks: list[Any]) -> Any:
    """A body that arrives in these pieces (an exception in the list is raised at that point)."""
    cls = _STREAM_CLASSES.get(module.__name__)
    if cls is None:

        class ChunkStream(module.SyncByteStream, module.AsyncByteStream):  # type: ignore[misc,name-defined]
            def __init__(self, pieces: list[Any]) -> None:
                self.pieces = pieces

            def __iter__(self) -> Iterator[bytes]:
                for piece in self.pieces:
                    if isinstance(piece, BaseException):
                        raise piece
                    yield piece

            async def __aiter__(self) -> Any:
                for piece in self.pieces:
                    if isinstance(piece, BaseException):
                        raise piece
                    yield piece

        cls = _STREAM_CLASSES[module.__name__] = ChunkStream
    return cls(chunks)


def _json_response(module: ModuleType, status: int, obj: Any, *, compress: bool = False) -> Any:
    data = json.dumps(obj).encode()
    headers = {"content-type": "application/json"}
    if compress:
        data = gzip.compress(data)
        headers["content-encoding"] = "gzip"
    middle = len(data) // 2
    return module.Response(status, headers=headers, stream=_chunk_stream(module, [data[:middle], data[middle:]]))


def _sse_response(module: ModuleType, pieces: list[Any]) -> Any:
    headers = {"content-type": "text/event-stream; charset=utf-8"}
    return module.Response(200, headers=headers, stream=_chunk_stream(module, pieces))


def _ark_chat(module: ModuleType) -> Handler:
    """Ark's chat endpoint: JSON or SSE; the usage-only chunk only when include_usage asks for it."""

    def handle(request: Any) -> Any:
        body = json.loads(request.read())
        if not body.get("stream"):
            return _json_response(module, 200, _completion())
        frames = list(CONTENT_FRAMES)
        if (body.get("stream_options") or {}).get("include_usage"):
            frames.append(USAGE_FRAME)
        frames.append(DONE_FRAME)
        return _sse_response(module, frames)

    return handle


@dataclass
class Backend:
    """One HTTP client module with a fake provider behind it."""

    module: ModuleType
    handler: Handler | None = None
    sent: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    transport: Any = None
    route: Any = None

    def reply(self, handler: Handler) -> None:
        self.handler = handler

    def dispatch(self, request: Any) -> Any:
        self.sent.append((dict(request.headers), request.read()))
        assert self.handler is not None, "the test set no reply"
        return self.handler(request)

    def client(self) -> Any:
        return self.module.Client(transport=self.transport) if self.transport else self.module.Client()

    def async_client(self) -> Any:
        if self.transport:
            return self.module.AsyncClient(transport=self.transport)
        return self.module.AsyncClient()

    @property
    def called(self) -> bool:
        if self.route is not None:  # respx's own record, independent of ours
            return bool(self.route.called)
        return bool(self.sent)


@pytest.fixture(params=["httpx", "httpx2"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """httpx behind respx, or httpx2 behind its MockTransport; the module patched for the test."""
    module = importlib.import_module(request.param)
    was_patched = getattr(module, "_quotawrap_patched", False)
    httpx_adapter.patch(module)
    backend = Backend(module)
    try:
        if request.param == "httpx":
            with respx.mock(assert_all_called=False) as router:
                backend.route = router.route(host="testserver").mock(side_effect=backend.dispatch)
                yield backend
        else:
            backend.transport = module.MockTransport(backend.dispatch)
            yield backend
    finally:
        if not was_patched:
            httpx_adapter.unpatch(module)


@pytest.fixture
def make_guard(store: str) -> Iterator[Callable[..., Guard]]:
    """Install a Guard over BASE with this test's private ledger (and these settings)."""

    made: list[Guard] = []

    def make(**changes: Any) -> Guard:
        settings = Settings(**{"store": store, "base_url": (BASE,), **changes})
        guard = Guard(settings)
        set_guard(guard)
        made.append(guard)
        return guard

    yield make
    set_guard(None)
    for guard in made:  # a guard that answered retries from memory says so now, not at the runner's exit
        guard.retries.close()


def _rows(store: str) -> list[tuple[Any, ...]]:
    """The calls the ledger recorded (none when the guard never even opened it)."""
    if not Path(store.removeprefix("sqlite:///")).exists():
        return []
    return ledger_rows(store, ROWS)


def _error(response: Any) -> dict[str, Any]:
    body = json.loads(response.read())
    assert set(body) == {"error"}
    return dict(body["error"])


# -- the cases ------------------------------------------------------------------------------------


class TestNotGuarded:
    def test_other_url_passes_untouched(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """A URL outside every guarded base goes out byte for byte, and the ledger never hears of it."""
        make_guard()
        backend.reply(_ark_chat(backend.module))
        raw = json.dumps(_chat_body(stream=True)).encode()
        with backend.client() as client:
            response = client.post("http://testserver/other/v1/chat/completions", content=raw)
            lines = list(response.iter_lines())
        assert response.status_code == 200
        headers, body = backend.sent[0]
        assert body == raw
        assert headers.get("accept-encoding") != "identity"
        assert USAGE_FRAME.decode().strip() not in lines  # no usage was injected
        assert _rows(store) == []

    def test_get_on_a_billed_path_is_refused_and_a_read_passes(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A GET on a billed path is answered 405 without being sent; a read of a stored response passes."""
        make_guard(cap_tokens=0)
        backend.reply(lambda request: backend.module.Response(200, json={"object": "response"}))
        with backend.client() as client:
            refused = client.get(BASE + "/responses")
            assert refused.status_code == 405
            assert refused.headers.get("allow") == "POST"
            assert not backend.called
            assert client.get(BASE + "/responses/resp_1").status_code == 200
        assert backend.called
        assert _rows(store) == []

    def test_model_filter(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """With --model deepseek-*, other models pass untouched and deepseek is guarded."""
        make_guard(model=("deepseek-*",))
        backend.reply(_ark_chat(backend.module))
        raw = json.dumps(_chat_body(stream=True)).encode()
        with backend.client() as client:
            client.post(CHAT, content=raw).read()
            assert _rows(store) == []
            assert backend.sent[0][1] == raw
            client.post(CHAT, json=_chat_body(model="deepseek-v3-250324")).read()
        assert [row[0] for row in _rows(store)] == ["settled"]


class TestBlocked:
    def test_never_reaches_the_transport(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """Over the cap: a synthetic Ark 429 that SDKs do not retry, and nothing is sent."""
        make_guard(cap_tokens=1)
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client:
            response = client.post(CHAT, json=_chat_body())
        assert response.status_code == 429
        assert response.headers["x-should-retry"] == "false"
        assert response.headers["x-quotawrap-blocked"] == "run_cap"
        assert response.headers["content-type"].startswith("application/json")
        error = _error(response)
        assert error["code"] == "QuotawrapLimitExceeded"
        assert error["type"] == "TooManyRequests"
        assert "run_cap" in error["message"]
        assert not backend.called
        assert [row[0] for row in _rows(store)] == ["blocked"]

    def test_streaming_caller_reads_the_error(self, backend: Backend, make_guard: Callable[..., Guard]) -> None:
        """A caller in `client.stream(...)` gets the same readable 429."""
        make_guard(cap_tokens=1)
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client, client.stream("POST", CHAT, json=_chat_body(stream=True)) as response:
            text = "".join(response.iter_text())
        assert response.status_code == 429
        assert json.loads(text)["error"]["code"] == "QuotawrapLimitExceeded"
        assert not backend.called

    def test_async(self, backend: Backend, make_guard: Callable[..., Guard]) -> None:
        """The async client is blocked the same way."""
        make_guard(cap_tokens=1)
        backend.reply(_ark_chat(backend.module))

        async def call() -> Any:
            async with backend.async_client() as client:
                response = await client.post(CHAT, json=_chat_body())
                await response.aread()
                return response

        response = asyncio.run(call())
        assert response.status_code == 429
        assert _error(response)["code"] == "QuotawrapLimitExceeded"
        assert not backend.called


class TestJsonAnswers:
    def test_settles_with_actual_usage(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """A JSON answer is charged its usage, and the request asked for an uncompressed body."""
        make_guard()
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client:
            response = client.post(CHAT, json=_chat_body(), headers={"Authorization": "Bearer k"})
        assert response.json()["usage"] == USAGE
        [(state, reserved, charged, would_block, prompt)] = _rows(store)
        assert (state, charged, would_block, prompt) == ("settled", 12, 0, 9)
        assert reserved >= 50
        assert backend.sent[0][0]["accept-encoding"] == "identity"

    def test_async_settles(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """The async client settles the same way."""
        make_guard()
        backend.reply(_ark_chat(backend.module))

        async def call() -> dict[str, Any]:
            async with backend.async_client() as client:
                response = await client.post(CHAT, json=_chat_body())
                return dict(response.json())

        assert asyncio.run(call())["usage"] == USAGE
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_gzip_answer_is_still_read(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """A provider that compresses anyway: the tee decompresses its copy and finds the usage."""
        make_guard()
        backend.reply(lambda request: _json_response(backend.module, 200, _completion(), compress=True))
        with backend.client() as client:
            response = client.post(CHAT, json=_chat_body())
        assert response.json()["usage"] == USAGE  # the caller's copy is untouched
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_answer_without_usage_charges_the_hold(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A 200 without usage cannot be reconciled: the whole hold is charged (unresolved)."""
        make_guard()
        backend.reply(lambda request: _json_response(backend.module, 200, _completion(usage=None)))
        with backend.client() as client:
            client.post(CHAT, json=_chat_body()).read()
        [(state, reserved, charged, _, _)] = _rows(store)
        assert state == "unresolved"
        assert charged == reserved > 0

    def test_body_loaded_by_the_transport_is_settled(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A transport that hands back an already-read body (MockTransport, content=...) still settles."""
        make_guard()
        module = backend.module
        transport = module.MockTransport(lambda request: module.Response(200, json=_completion()))
        with module.Client(transport=transport) as client:
            assert client.post(CHAT, json=_chat_body()).json()["usage"] == USAGE
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_compressed_body_loaded_by_the_transport_is_settled(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """An already-read body is already decoded: its gzip header must not make the tee inflate it again."""
        make_guard()
        module = backend.module
        data = gzip.compress(json.dumps(_completion()).encode())
        transport = module.MockTransport(
            lambda request: module.Response(200, headers={"content-encoding": "gzip"}, content=data)
        )
        with module.Client(transport=transport) as client:
            assert client.post(CHAT, json=_chat_body()).json()["usage"] == USAGE
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_async_body_loaded_by_the_transport_is_settled(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """The same for the async client."""
        make_guard()
        module = backend.module
        transport = module.MockTransport(lambda request: module.Response(200, json=_completion()))

        async def call() -> None:
            async with module.AsyncClient(transport=transport) as client:
                await client.post(CHAT, json=_chat_body())

        asyncio.run(call())
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]


class TestStreams:
    def test_injected_usage_is_hidden(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """The request asks for usage on the caller's behalf; the caller never sees the extra chunk."""
        make_guard()
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client, client.stream("POST", CHAT, json=_chat_body(stream=True)) as response:
            lines = [line for line in response.iter_lines() if line]
        sent = json.loads(backend.sent[0][1])
        assert sent["stream_options"] == {"include_usage": True}
        assert sent["messages"] == _chat_body()["messages"]
        assert len(lines) == len(CONTENT_FRAMES) + 1
        assert lines[-1] == "data: [DONE]"
        assert not any('"choices":[]' in line for line in lines)
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_rewritten_body_goes_out_with_its_length_and_the_callers_request_is_left_as_it_was(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """The request sent is a copy with the new body (its content-length too); the caller's is untouched."""
        make_guard()
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client:
            request = client.build_request("POST", CHAT, json=_chat_body(stream=True), headers={"x-caller": "kept"})
            original = request.read()
            response = client.send(request, stream=True)
            response.read()
            response.close()
        headers, sent = backend.sent[0]
        assert json.loads(sent)["stream_options"] == {"include_usage": True}
        assert headers["content-length"] == str(len(sent)) and headers["x-caller"] == "kept"
        assert headers["accept-encoding"] == "identity"
        assert request.read() == original and request.headers["content-length"] == str(len(original))
        assert "accept-encoding" not in request.headers or request.headers["accept-encoding"] != "identity"
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_async_injected_usage_is_hidden(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """The async stream hides the injected chunk and settles too."""
        make_guard()
        backend.reply(_ark_chat(backend.module))

        async def call() -> list[str]:
            async with (
                backend.async_client() as client,
                client.stream("POST", CHAT, json=_chat_body(stream=True)) as response,
            ):
                return [line async for line in response.aiter_lines() if line]

        lines = asyncio.run(call())
        assert json.loads(backend.sent[0][1])["stream_options"] == {"include_usage": True}
        assert not any('"choices":[]' in line for line in lines)
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_stream_loaded_by_the_transport_hides_the_chunk(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """An event stream the transport read whole is settled and still hides the injected chunk."""
        make_guard()
        module = backend.module
        frames = b"".join([*CONTENT_FRAMES, USAGE_FRAME, DONE_FRAME])
        headers = {"content-type": "text/event-stream"}
        transport = module.MockTransport(lambda request: module.Response(200, headers=headers, content=frames))
        with module.Client(transport=transport) as client:
            text = client.post(CHAT, json=_chat_body(stream=True)).text
        assert '"choices":[]' not in text
        assert text.endswith("data: [DONE]\n\n")
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_caller_asked_for_usage(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """The caller's own include_usage: the body goes out unchanged and the chunk is theirs to see."""
        make_guard(bound=False)
        backend.reply(_ark_chat(backend.module))
        raw = json.dumps(_chat_body(stream=True, stream_options={"include_usage": True})).encode()
        with backend.client() as client, client.stream("POST", CHAT, content=raw) as response:
            lines = [line for line in response.iter_lines() if line]
        assert backend.sent[0][1] == raw
        assert any('"choices":[]' in line for line in lines)
        assert [(row[0], row[2]) for row in _rows(store)] == [("settled", 12)]

    def test_injection_switched_off(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """--no-inject-usage: the body is untouched and the stream, lacking usage, charges the hold."""
        make_guard(inject_usage=False, bound=False)
        backend.reply(_ark_chat(backend.module))
        raw = json.dumps(_chat_body(stream=True)).encode()
        with backend.client() as client, client.stream("POST", CHAT, content=raw) as response:
            response.read()
        assert backend.sent[0][1] == raw
        [(state, reserved, charged, _, _)] = _rows(store)
        assert (state, charged) == ("unresolved", reserved)

    def test_malformed_stream_options_leave_no_hold_open(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """stream_options that is not an object: the call goes out as written and its hold is settled."""
        make_guard(bound=False)
        backend.reply(lambda request: _sse_response(backend.module, [*CONTENT_FRAMES, USAGE_FRAME, DONE_FRAME]))
        raw = json.dumps(_chat_body(stream=True, stream_options="include_usage")).encode()
        with backend.client() as client, client.stream("POST", CHAT, content=raw) as response:
            response.read()
        assert backend.sent[0][1] == raw
        assert [row[0] for row in _rows(store)] == ["settled"]

    def test_closed_early_charges_the_hold(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A reader that stops after the first line: the outcome is unknown, the whole hold is charged."""
        make_guard()
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client:
            with client.stream("POST", CHAT, json=_chat_body(stream=True)) as response:
                for _line in response.iter_lines():
                    break
            assert _rows(store)[0][0] == "unresolved"  # at close, not at client exit
        [(_, reserved, charged, _, _)] = _rows(store)
        assert charged == reserved > 0

    def test_async_closed_early_charges_the_hold(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """The async reader that stops early is charged in full too."""
        make_guard()
        backend.reply(_ark_chat(backend.module))

        async def call() -> None:
            async with (
                backend.async_client() as client,
                client.stream("POST", CHAT, json=_chat_body(stream=True)) as response,
            ):
                async for _line in response.aiter_lines():
                    break

        asyncio.run(call())
        [(state, reserved, charged, _, _)] = _rows(store)
        assert (state, charged) == ("unresolved", reserved)

    def test_read_error_mid_body_charges_the_hold(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """The connection breaks after generation began: the caller sees the error, the hold is charged."""
        make_guard()
        module = backend.module
        backend.reply(lambda request: _sse_response(module, [CONTENT_FRAMES[0], module.ReadError("reset by peer")]))
        with (
            backend.client() as client,
            pytest.raises(module.ReadError),
            client.stream("POST", CHAT, json=_chat_body(stream=True)) as response,
        ):
            response.read()
        [(state, reserved, charged, _, _)] = _rows(store)
        assert (state, charged) == ("unresolved", reserved)


class TestErrors:
    def test_400_is_released(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """The provider refused the request before generating: nothing is charged."""
        make_guard()
        error = {"error": {"code": "InvalidParameter", "message": "bad", "param": "", "type": "BadRequest"}}
        backend.reply(lambda request: _json_response(backend.module, 400, error))
        with backend.client() as client:
            response = client.post(CHAT, json=_chat_body())
        assert response.status_code == 400
        assert response.json() == error
        assert [(row[0], row[2]) for row in _rows(store)] == [("released", 0)]

    def test_500_with_error_json_is_released(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """Ark's own 500 error body: no generation happened, nothing is charged."""
        make_guard()
        error = {"error": {"code": "InternalServiceError", "message": "oops", "param": "", "type": "Internal"}}
        backend.reply(lambda request: _json_response(backend.module, 500, error))
        with backend.client() as client:
            assert client.post(CHAT, json=_chat_body()).status_code == 500
        assert [(row[0], row[2]) for row in _rows(store)] == [("released", 0)]

    def test_502_without_error_json_is_charged(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """A gateway's HTML 502 says nothing about the generation behind it: the hold is charged."""
        make_guard()
        module = backend.module
        backend.reply(lambda request: module.Response(502, headers={"content-type": "text/html"}, text="<h1>bad</h1>"))
        with backend.client() as client:
            client.post(CHAT, json=_chat_body()).read()
        [(state, reserved, charged, _, _)] = _rows(store)
        assert (state, charged) == ("unresolved", reserved)

    def test_connect_error_is_released(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """A connection never made sent nothing: the hold is released and the error reaches the caller."""
        make_guard()
        module = backend.module

        def refuse(request: Any) -> Any:
            raise module.ConnectError("connection refused")

        backend.reply(refuse)
        with backend.client() as client, pytest.raises(module.ConnectError):
            client.post(CHAT, json=_chat_body())
        assert [(row[0], row[2]) for row in _rows(store)] == [("released", 0)]

    def test_async_connect_error_is_released(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """The async client releases a never-sent call too."""
        make_guard()
        module = backend.module

        def refuse(request: Any) -> Any:
            raise module.ConnectError("connection refused")

        backend.reply(refuse)

        async def call() -> None:
            async with backend.async_client() as client:
                await client.post(CHAT, json=_chat_body())

        with pytest.raises(module.ConnectError):
            asyncio.run(call())
        assert [(row[0], row[2]) for row in _rows(store)] == [("released", 0)]

    def test_read_timeout_before_the_answer_charges_the_hold(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """Sent but no answer: the provider may be generating, so the hold is charged."""
        make_guard()
        module = backend.module

        def time_out(request: Any) -> Any:
            raise module.ReadTimeout("no answer")

        backend.reply(time_out)
        with backend.client() as client, pytest.raises(module.ReadTimeout):
            client.post(CHAT, json=_chat_body())
        [(state, reserved, charged, _, _)] = _rows(store)
        assert (state, charged) == ("unresolved", reserved)


class TestUnreadableRequests:
    def test_unparseable_body(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """A body that is not JSON cannot be guarded: a synthetic 400, nothing sent, nothing held."""
        make_guard()
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client:
            response = client.post(CHAT, content=b"model=doubao")
        assert response.status_code == 400
        assert response.headers["x-should-retry"] == "false"
        assert _error(response)["code"] == "QuotawrapUnreadableRequest"
        assert not backend.called
        assert _rows(store) == []

    def test_missing_model(self, backend: Backend, make_guard: Callable[..., Guard], store: str) -> None:
        """Without a model string there is no ledger key: a synthetic 400."""
        make_guard()
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client:
            response = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400
        assert "'model'" in _error(response)["message"]
        assert not backend.called
        assert _rows(store) == []


class TestWatchMode:
    def test_over_cap_call_goes_out_and_is_recorded(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """--watch blocks nothing but records what would have been blocked."""
        make_guard(cap_tokens=1, watch=True)
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client:
            assert client.post(CHAT, json=_chat_body()).status_code == 200
        assert backend.called
        assert [(row[0], row[2], row[3]) for row in _rows(store)] == [("settled", 12, 1)]


class TestLedgerFailure:
    @pytest.fixture
    def broken_store(self, tmp_path: Path) -> str:
        """A store whose directory cannot be created: its parent is a file."""
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("")
        return f"sqlite:///{blocker / 'sub' / 'ledger.sqlite3'}"

    def test_fails_closed_with_503(self, backend: Backend, make_guard: Callable[..., Guard], broken_store: str) -> None:
        """No ledger, no spending: a synthetic 503 naming the store, and nothing is sent."""
        make_guard(store=broken_store)
        backend.reply(_ark_chat(backend.module))
        with backend.client() as client:
            response = client.post(CHAT, json=_chat_body())
        assert response.status_code == 503
        error = _error(response)
        assert error["code"] == "QuotawrapStoreUnavailable"
        assert "not-a-dir" in error["message"]
        assert "--fail-open" in error["message"]
        assert not backend.called

    def test_fail_open_lets_it_through_with_a_warning(
        self,
        backend: Backend,
        make_guard: Callable[..., Guard],
        broken_store: str,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        """--fail-open: the call goes out unguarded and stderr says so."""
        make_guard(store=broken_store, fail_open=True)
        backend.reply(_ark_chat(backend.module))
        raw = json.dumps(_chat_body()).encode()
        with backend.client() as client:
            assert client.post(CHAT, content=raw).status_code == 200
        assert backend.sent[0][1] == raw
        assert "UNGUARDED" in capsys.readouterr().err


class TestPatching:
    def test_patch_is_idempotent(self, backend: Backend) -> None:
        """Patching twice leaves one wrapper layer, over the original method."""
        module = backend.module
        httpx_adapter.patch(module)
        for cls in (module.Client, module.AsyncClient):
            wrapper = cls._send_single_request
            assert hasattr(wrapper, "__wrapped__")
            assert not hasattr(wrapper.__wrapped__, "__wrapped__")

    def test_unpatch_restores_the_original(self, backend: Backend) -> None:
        """unpatch puts the very original method back (and patch can be applied again)."""
        module = backend.module
        original = module.Client._send_single_request.__wrapped__
        httpx_adapter.unpatch(module)
        try:
            assert module.Client._send_single_request is original
            assert not hasattr(module.AsyncClient._send_single_request, "__wrapped__")
        finally:
            httpx_adapter.patch(module)
        assert module.Client._send_single_request.__wrapped__ is original

    def test_unpatched_client_is_not_guarded(
        self, backend: Backend, make_guard: Callable[..., Guard], store: str
    ) -> None:
        """The guard acts through the patch alone: unpatched, an over-cap call goes out."""
        make_guard(cap_tokens=1)
        backend.reply(_ark_chat(backend.module))
        httpx_adapter.unpatch(backend.module)
        try:
            with backend.client() as client:
                assert client.post(CHAT, json=_chat_body()).status_code == 200
        finally:
            httpx_adapter.patch(backend.module)
        assert _rows(store) == []

    def test_guard_is_per_process_and_replaceable(self, make_guard: Callable[..., Guard]) -> None:
        """set_guard installs the guard get_guard hands to every adapter."""
        guard = make_guard()
        assert get_guard() is guard


_NAMES = st.sampled_from(
    ["Content-Length", "content-length", "Transfer-Encoding", "Accept-Encoding", "X-A", "x-a", "Host"]
)


@pytest.mark.parametrize("module_name", ["httpx", "httpx2"])
@given(items=st.lists(st.tuples(_NAMES, st.sampled_from(["1", "gzip", "chunked", "v"])), max_size=8))
def test_body_headers_edits_the_entry_list_as_the_mapping_would(module_name: str, items: list[tuple[str, str]]) -> None:
    """The one-pass edit of httpx's entry list gives the headers that pop and set through the mapping give
    (same names, values and repeats; order aside), and leaves the caller's headers as they were."""
    module = importlib.import_module(module_name)
    headers = module.Headers(items)
    before = headers.multi_items()
    overrides = {"accept-encoding": "identity"}

    class Plain(dict[str, str]):  # lowercase names, no entry list: edited through the mapping
        def copy(self) -> Plain:
            return Plain(self)

    expected = headers.copy()
    for name in ("content-length", "transfer-encoding"):
        expected.pop(name, None)
    expected.update({**overrides, "content-length": "42"})
    fast = httpx_adapter.body_headers(headers, overrides, 42)
    assert sorted((k.lower(), v) for k, v in fast.multi_items()) == sorted(expected.multi_items())
    assert headers.multi_items() == before
    plain = httpx_adapter.body_headers(Plain({k.lower(): v for k, v in items}), overrides, 42)
    assert type(plain) is Plain and plain["content-length"] == "42" and plain["accept-encoding"] == "identity"
    assert all(name.lower() != "transfer-encoding" for name in plain)
