"""Hostile input through the real adapters: quotawrap answers with HTTP and never raises.

Generated request bodies (hostile numbers, wrong shapes, binary, JSON nested 100,000 deep),
request headers, response bodies with generated usage values and SSE streams cut anywhere go
through httpx (sync and async, respx-mocked) and requests (against an in-process HTTP server on
loopback). For every example:

* no exception leaves the client call or the reading of its body;
* an answer quotawrap made itself is a 400, 429 or 503 with an Ark-shaped error body;
* the ledger stays sane: no hold left open once the body is read, nothing in flight, every
  count a non-negative integer far below 2**53 (where doubles and, later, int64 counters fail).

Examples are bounded (see ``FUZZ``) so the file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import respx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.intercept import httpx_adapter, requests_adapter, set_guard
from quotawrap.ledger import model_day_key
from tests.redis_server import flushed, session_url

MOCK_BASE = "http://fuzz.test/api/v3"
PATHS = ["/chat/completions", "/responses", "/embeddings", "/completions", "/bots/chat/completions"]
SANE = 2**53
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)

# -- generated requests ---------------------------------------------------------------------------

HOSTILE_NUMBERS = st.one_of(
    st.sampled_from([1e30, 2**62, 1e19, 2**63, 2**64, 2**53, 2**40, -1, 0, 1, 0.5, -0.0, 1e308]),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALARS = st.one_of(st.none(), st.booleans(), HOSTILE_NUMBERS, st.text(max_size=12))
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=16,
)
FIELDS = st.sampled_from(
    [
        "max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of", "stream", "stream_options",
        "thinking", "tools", "messages", "input", "prompt", "instructions", "response_format", "model",
    ]
)  # fmt: skip


def _deep(depth: int) -> bytes:
    return b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}"


@st.composite
def request_bodies(draw: st.DrawFn) -> bytes:
    """Mostly a well-formed body of some kind with a few fields made hostile; sometimes garbage."""
    shape = draw(st.integers(0, 9))
    if shape == 0:
        return draw(st.binary(max_size=120))
    if shape == 1:
        return _deep(draw(st.sampled_from([50, 900, 5_000, 100_000])))
    text = draw(st.text(max_size=60))
    body: dict[str, Any] = {
        "model": draw(st.one_of(st.sampled_from(["doubao-seed-1-6-250615", "deepseek-v3-2-251201"]), st.text())),
        "messages": [{"role": "user", "content": text}],
        "input": text,
        "prompt": text,
        "max_tokens": draw(st.integers(1, 64)),
        "stream": draw(st.booleans()),
    }
    for name in draw(st.lists(FIELDS, max_size=4)):
        body[name] = draw(st.one_of(HOSTILE_NUMBERS, JSON_VALUES))
    return json.dumps(body, allow_nan=True).encode()


HEADERS = st.dictionaries(
    st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True).filter(
        lambda name: (
            name.lower()
            not in {"content-length", "transfer-encoding", "host", "connection", "expect", "content-encoding"}
        )
    ),
    st.from_regex(r"[!-~][ -~]{0,30}", fullmatch=True),
    max_size=4,
).map(lambda headers: {**headers, "content-type": "application/json"})


# -- generated answers ----------------------------------------------------------------------------

USAGE_KEYS = st.sampled_from(
    ["prompt_tokens", "completion_tokens", "total_tokens", "input_tokens", "output_tokens", "prompt_cache_hit_tokens"]
)


@st.composite
def usages(draw: st.DrawFn) -> Any:
    """A usage object with generated (often absurd) counts, or any JSON value at all."""
    if draw(st.integers(0, 5)) == 0:
        return draw(JSON_VALUES)
    usage: dict[str, Any] = {key: draw(HOSTILE_NUMBERS) for key in draw(st.lists(USAGE_KEYS, max_size=4))}
    if draw(st.booleans()):
        usage["completion_tokens_details"] = {"reasoning_tokens": draw(HOSTILE_NUMBERS)}
        usage["prompt_tokens_details"] = {"cached_tokens": draw(HOSTILE_NUMBERS)}
    return usage


def _frame(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, allow_nan=True).encode() + b"\n\n"


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """An SSE body: deltas, several usage reports, errors, junk lines, maybe [DONE], maybe cut short."""
    frames: list[bytes] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 5))
        if kind == 0:
            frames.append(_frame({"choices": [], "usage": draw(usages())}))
        elif kind == 1:
            frames.append(_frame({"choices": [{"delta": {"content": "x"}}], "usage": draw(usages())}))
        elif kind == 2:
            frames.append(_frame({"type": "response.completed", "response": {"usage": draw(usages())}}))
        elif kind == 3:
            frames.append(b"event: error\ndata: " + draw(st.binary(max_size=30)) + b"\n\n")
        elif kind == 4:
            frames.append(draw(st.binary(max_size=40)))
        else:
            frames.append(_frame({"choices": [{"delta": {"content": draw(st.text(max_size=10))}}]}))
    if draw(st.booleans()):
        frames.append(b"data: [DONE]\n\n")
    return b"".join(frames)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    chunks: list[bytes]


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    status = draw(st.sampled_from([200, 200, 200, 400, 429, 500, 503]))
    if draw(st.booleans()):
        body, content_type = draw(streams()), "text/event-stream"
    elif draw(st.integers(0, 4)) == 0:
        body, content_type = draw(st.binary(max_size=80)), "application/json"
    else:
        answer = {"choices": [{"message": {"content": "hi"}}], "usage": draw(usages())}
        body, content_type = json.dumps(answer, allow_nan=True).encode(), "application/json"
    headers = {"content-type": draw(st.sampled_from([content_type, content_type.upper() + "; charset=utf-8", ""]))}
    encoding = draw(st.sampled_from([None, None, "gzip", "deflate", "x-unknown"]))
    if encoding is not None:  # valid data only: a client's own decoding error is not quotawrap's
        if encoding == "gzip":
            body = gzip.compress(body)
        elif encoding == "deflate":
            body = zlib.compress(body)
        headers["content-encoding"] = encoding
    cuts = sorted(set(draw(st.lists(st.integers(1, max(len(body) - 1, 1)), max_size=6))))
    edges = [0, *[cut for cut in cuts if cut < len(body)], len(body)]
    chunks = [body[a:b] for a, b in itertools.pairwise(edges) if b > a]
    return Reply(status, headers, chunks)


# -- the checks -----------------------------------------------------------------------------------


def _check_answer(status: int, body: bytes, sent: bool) -> None:
    """An answer quotawrap made is an Ark-shaped 400, 429 or 503; any other came from the provider."""
    if sent:
        return
    assert status in (400, 429, 503), (status, body[:200])
    error = json.loads(body)["error"]
    assert error["code"].startswith("Quotawrap")


def _check_ledger(guard: Guard) -> None:
    """No hold left open, nothing in flight, every number a sane non-negative integer."""
    records = guard.ledger.call_records()
    assert all(record.state != "held" for record in records)
    for record in records:
        for value in (record.reserved, record.charged, record.prompt_tokens, record.completion_tokens):
            assert value is None or (isinstance(value, int) and 0 <= value < SANE), record
    keys = sorted({model_day_key(record.model, record.day) for record in records})
    for counters in guard.ledger.counters(keys).values():
        assert counters.in_flight == 0
        assert 0 <= counters.settled < SANE


# -- the fake providers ---------------------------------------------------------------------------


class _Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


class _Provider(BaseHTTPRequestHandler):
    """Answers every POST with the server's current reply, written in its chunks."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        reply: Reply = self.server.reply  # type: ignore[attr-defined]
        self.server.hits += 1  # type: ignore[attr-defined]
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        for chunk in reply.chunks:
            self.wfile.write(chunk)
            self.wfile.flush()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadingHTTPServer]:
    """A loopback HTTP server for the requests adapter (requests cannot be mocked below its adapter)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Provider)
    httpd.daemon_threads = True
    httpd.reply = Reply(200, {}, [])  # type: ignore[attr-defined]
    httpd.hits = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def guard(tmp_path: Path, server: ThreadingHTTPServer) -> Iterator[Guard]:
    """One guard (and ledger) for all examples of a test: the invariants must hold across them."""
    host, port = server.server_address[:2]
    local = f"http://{host!s}:{port}/api/v3"
    server.base = local  # type: ignore[attr-defined]
    guard = Guard(Settings(store=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", base_url=(MOCK_BASE, local)))
    set_guard(guard)
    for module, adapter in ((httpx, httpx_adapter), (requests, requests_adapter)):
        adapter.patch(module)
    yield guard
    httpx_adapter.unpatch(httpx)
    requests_adapter.unpatch(requests)
    set_guard(None)
    guard.retries.close()  # retries of refused examples: said now, not at the runner's exit


# -- the properties -------------------------------------------------------------------------------


@FUZZ
@given(path=st.sampled_from(PATHS), body=request_bodies(), headers=HEADERS, reply=replies())
def test_httpx_sync(guard: Guard, path: str, body: bytes, headers: dict[str, str], reply: Reply) -> None:
    """httpx.Client: every generated request and answer ends in an HTTP answer and a sane ledger."""
    with respx.mock(assert_all_called=False) as router:
        route = router.route(host="fuzz.test").mock(
            side_effect=lambda request: httpx.Response(
                reply.status, headers=reply.headers, stream=_Chunks(reply.chunks)
            )
        )
        with httpx.Client() as client:
            response = client.post(MOCK_BASE + path, content=body, headers=headers)
            content = response.read()
    _check_answer(response.status_code, content, route.called)
    _check_ledger(guard)


@FUZZ
@given(path=st.sampled_from(PATHS), body=request_bodies(), headers=HEADERS, reply=replies())
def test_httpx_async_streaming(guard: Guard, path: str, body: bytes, headers: dict[str, str], reply: Reply) -> None:
    """httpx.AsyncClient reading the body as a stream, piece by piece: the same guarantees."""

    async def call() -> tuple[int, bytes]:
        async with (
            httpx.AsyncClient() as client,
            client.stream("POST", MOCK_BASE + path, content=body, headers=headers) as response,
        ):
            pieces = [piece async for piece in response.aiter_bytes()]
        return response.status_code, b"".join(pieces)

    with respx.mock(assert_all_called=False) as router:
        route = router.route(host="fuzz.test").mock(
            side_effect=lambda request: httpx.Response(
                reply.status, headers=reply.headers, stream=_Chunks(reply.chunks)
            )
        )
        status, content = asyncio.run(call())
    _check_answer(status, content, route.called)
    _check_ledger(guard)


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    body=request_bodies(),
    headers=HEADERS,
    reply=replies(),
    streamed=st.booleans(),
)
def test_requests(
    guard: Guard,
    server: ThreadingHTTPServer,
    path: str,
    body: bytes,
    headers: dict[str, str],
    reply: Reply,
    streamed: bool,
) -> None:
    """requests against a real loopback server, read whole or streamed: the same guarantees."""
    server.reply = reply  # type: ignore[attr-defined]
    hits = server.hits  # type: ignore[attr-defined]
    with requests.Session() as session:
        response = session.post(server.base + path, data=body, headers=headers, stream=streamed, timeout=10)  # type: ignore[attr-defined]
        content = b"".join(response.iter_content(64)) if streamed else response.content
        response.close()
    _check_answer(response.status_code, content, server.hits > hits)  # type: ignore[attr-defined]
    _check_ledger(guard)


# -- the cases, by name -------------------------------------------------------------------

CHAT = {"model": "doubao-seed-1-6-250615", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_deep(100_000), id="json-nested-100k-deep"),
        pytest.param(json.dumps({**CHAT, "max_tokens": 1e30}).encode(), id="max_tokens-1e30"),
        pytest.param(json.dumps({**CHAT, "max_completion_tokens": 2**62}).encode(), id="max_completion_tokens-2^62"),
        pytest.param(json.dumps({**CHAT, "n": 1e19}).encode(), id="n-1e19"),
    ],
)
def test_bodies_it_cannot_judge_get_a_400(guard: Guard, body: bytes) -> None:
    """The issue's RecursionError and OverflowError bodies: a 400 answer, nothing sent or held."""
    with respx.mock(assert_all_called=False) as router:
        route = router.route(host="fuzz.test").mock(return_value=httpx.Response(200, json={}))
        response = httpx.post(MOCK_BASE + "/chat/completions", content=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "QuotawrapUnreadableRequest"
    assert not route.called
    assert guard.ledger.call_records() == []


@pytest.mark.parametrize("total", [2**63, 2**64 + 5, 2**53])
def test_a_usage_that_would_wrap_a_counter_is_charged_the_hold(
    guard: Guard, capsys: pytest.CaptureFixture[str], total: int
) -> None:
    """usage.total_tokens 2**63: the answer reaches the caller, the hold is charged, the anomaly is loud."""
    answer = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": total}}
    with respx.mock(assert_all_called=False) as router:
        router.route(host="fuzz.test").mock(return_value=httpx.Response(200, json=answer))
        response = httpx.post(MOCK_BASE + "/chat/completions", json={**CHAT, "max_tokens": 50})
    assert response.json() == answer
    [record] = guard.ledger.call_records()
    assert (record.state, record.charged) == ("unresolved", record.reserved)
    assert record.usage_anomaly == f"total_tokens {total!r} is not a plausible token count"
    assert guard.ledger.run_totals(record.run_id).totals.anomalous_calls == 1
    counters = guard.ledger.counters([model_day_key(record.model, record.day)])
    assert [c.settled for c in counters.values()] == [record.reserved]
    assert "usage anomaly" in capsys.readouterr().err


def test_a_later_smaller_stream_report_does_not_win(guard: Guard) -> None:
    """Two usage reports in one stream: the larger is charged, though the smaller came last."""
    stream = (
        _frame({"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 9, "completion_tokens": 700}})
        + _frame({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}})
        + b"data: [DONE]\n\n"
    )
    headers = {"content-type": "text/event-stream"}
    with respx.mock(assert_all_called=False) as router:
        router.route(host="fuzz.test").mock(return_value=httpx.Response(200, headers=headers, content=stream))
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", MOCK_BASE + "/chat/completions", json=body) as response:
            response.read()
    [record] = guard.ledger.call_records()
    assert (record.state, record.charged) == ("settled", 709)


def test_a_total_below_its_parts_is_raised(guard: Guard) -> None:
    """total_tokens 3 beside prompt 40 + completion 20: 60 is charged, not 3."""
    answer = {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 20, "total_tokens": 3}}
    with respx.mock(assert_all_called=False) as router:
        router.route(host="fuzz.test").mock(return_value=httpx.Response(200, json=answer))
        httpx.post(MOCK_BASE + "/chat/completions", json={**CHAT, "max_tokens": 50})
    [record] = guard.ledger.call_records()
    assert (record.state, record.charged) == ("settled", 60)


def test_a_huge_prompt_is_refused_after_counting_what_the_cap_needs(tmp_path: Path) -> None:
    """A 30 MB prompt under a 50,000-token cap: a 429 whose count passed the cap, not the whole text."""
    guard = Guard(Settings(store=f"sqlite:///{tmp_path / 'l.sqlite3'}", base_url=(MOCK_BASE,), cap_tokens=50_000))
    text = "The quick brown fox jumps over the lazy dog.\n" * 700_000  # 31.5 MB, about 7M tokens
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": text}]}).encode()
    call = guard.begin("POST", MOCK_BASE + "/chat/completions", {}, body)
    assert call is not None and call.blocked is not None and call.blocked.status == 429
    counted = int(
        json.loads(call.blocked.body)["error"]["message"].split("this call ")[1].split(" ")[0].replace(",", "")
    )
    assert 50_000 < counted < 50_000 + 4096 + 65_536  # one piece past the cap, plus the output allowance


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A private ledger of either kind (Redis: a private redis-server on loopback)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        return
    with session_url() as url:
        yield flushed(url)


def test_usage_of_2_63_leaves_the_limits_in_force(any_store: str) -> None:
    """Issue 14's check: after an answer claiming 2**63 tokens, a --daily-cap 1000 still refuses big calls."""
    guard = Guard(Settings(store=any_store, base_url=(MOCK_BASE,), daily_cap=1000, usage_wall=1000))
    set_guard(guard)
    httpx_adapter.patch(httpx)
    try:
        hostile = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2**63}}
        with respx.mock(assert_all_called=False) as router:
            route = router.route(host="fuzz.test").mock(return_value=httpx.Response(200, json=hostile))
            first = httpx.post(
                MOCK_BASE + "/chat/completions", json={**CHAT, "max_tokens": 50, "thinking": {"type": "disabled"}}
            )
            statuses = [
                httpx.post(MOCK_BASE + "/chat/completions", json={**CHAT, "max_tokens": 100_000}).status_code
                for _ in range(5)
            ]
        assert first.status_code == 200 and route.call_count == 1
        assert statuses == [429] * 5
        [record] = [r for r in guard.ledger.call_records() if r.state != "blocked"]
        counters = guard.ledger.counters([model_day_key(record.model, record.day)])
        assert [c.settled for c in counters.values()] == [record.reserved]
    finally:
        httpx_adapter.unpatch(httpx)
        set_guard(None)
        guard.retries.close()  # the refused retries above: said now, not at the runner's exit
