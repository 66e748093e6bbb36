"""The Ark API simulator: wire shapes, usage arithmetic, faults, the bill, control and billing APIs."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from volcenginesdkarkruntime import Ark

import quotawrap.simulator as simulator
from quotawrap.simulator import ArkSimulator, PackageSpec, SimConfig, SimConfigError, count_text, serve
from quotawrap.simulator._billing import BillRecord, list_resource_packages, report_packages
from quotawrap.simulator._config import apply_headers, apply_patch, format_utc, parse_utc
from quotawrap.simulator._plan import chat_prompt_tokens, plan_generation
from tests.unit.conftest import FakeClock

MODEL = "deepseek-v3-2-251201"
EMB = "doubao-embedding-text-240715"
AUTH = {"Authorization": "Bearer test-key"}
HELLO = [{"role": "user", "content": "hello"}]
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sim() -> Iterator[ArkSimulator]:
    with ArkSimulator() as running:
        yield running


@pytest.fixture
def client(sim: ArkSimulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.url, headers=AUTH, timeout=10) as http:
        yield http


def hello_prompt_tokens(model: str = MODEL) -> int:
    return count_text(model, "hello") + 3 + 3


def chat(client: httpx.Client, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return client.post("/chat/completions", json={"model": MODEL, "messages": HELLO, **body}, headers=headers)


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def stream_chunks(client: httpx.Client, headers: dict[str, str] | None = None, **body: Any) -> list[Any]:
    """Chat stream payloads, the trailing "[DONE]" kept as the string."""
    response = chat(client, headers, stream=True, **body)
    assert response.status_code == 200, response.text
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in sse_data(response.text)]


def billing_post(sim: ArkSimulator, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", {"Authorization": "HMAC-SHA256 Credential=AK/20260101/cn-beijing/billing/request"})
    url = sim.base_url + "/?Action=ListResourcePackages&Version=2022-01-01"
    return httpx.post(url, json=body, headers=headers, **kwargs)


class TestPublicApi:
    def test_all_names_resolve(self) -> None:
        """__all__ lists each public name once and every one of them exists."""
        assert len(set(simulator.__all__)) == len(simulator.__all__)
        assert all(hasattr(simulator, name) for name in simulator.__all__)
        assert {"ArkSimulator", "SimConfig", "run_forever", "serve"} <= set(simulator.__all__)


class TestSimConfig:
    def test_headers_override_typed_fields(self) -> None:
        """x-sim-* headers coerce to each field's type; 'none' clears an optional field."""
        base = SimConfig(fault="cut")
        config = apply_headers(base, [("X-Sim-Reply-Tokens", "7"), ("x-sim-fault", "none"), ("x-sim-latency-s", "0.5")])
        assert (config.reply_tokens, config.fault, config.latency_s) == (7, None, 0.5)

    def test_unknown_header_names_itself(self) -> None:
        """A misspelt x-sim-* header is rejected, naming the header."""
        with pytest.raises(SimConfigError) as caught:
            apply_headers(SimConfig(), [("x-sim-reply-token", "7")])
        assert caught.value.param == "x-sim-reply-token"

    def test_bad_header_value_names_header(self) -> None:
        """A header value of the wrong type is rejected with the header as param."""
        with pytest.raises(SimConfigError) as caught:
            apply_headers(SimConfig(), [("x-sim-reply-tokens", "many")])
        assert caught.value.param == "x-sim-reply-tokens"

    def test_unknown_fault_rejected(self) -> None:
        """Only the documented faults are accepted."""
        with pytest.raises(SimConfigError):
            SimConfig(fault="explode")

    def test_packages_accept_iso_times(self) -> None:
        """Package times may be yyyy-MM-ddTHH:mm:ssZ strings or epoch seconds."""
        config = apply_patch(
            SimConfig(),
            {"packages": [{"model": "m", "total": 5, "effective_time": "2026-01-01T00:00:00Z", "expiry_time": 2e9}]},
        )
        assert config.packages[0].effective_time == parse_utc("2026-01-01T00:00:00Z")
        assert format_utc(config.packages[0].effective_time) == "2026-01-01T00:00:00Z"

    def test_to_json_round_trips(self) -> None:
        """A config's JSON form patches back into an equal config."""
        config = SimConfig(reply_tokens=3, packages=(PackageSpec("m", 10, 1.5, 2.5),))
        assert apply_patch(SimConfig(), config.to_json()) == config


class TestPlanGeneration:
    def test_max_tokens_caps_only_the_answer(self) -> None:
        """max_tokens bounds the answer; reasoning is outside it (Ark semantics)."""
        plan = plan_generation(10, reply_tokens=20, reasoning_tokens=30, max_tokens=5)
        assert (plan.reasoning_tokens, plan.answer_tokens, plan.finish_reason) == (30, 5, "length")

    def test_max_total_caps_reasoning_first(self) -> None:
        """max_completion_tokens is spent on reasoning first, the rest on the answer."""
        plan = plan_generation(10, reply_tokens=20, reasoning_tokens=30, max_tokens=1, max_total=35)
        assert (plan.reasoning_tokens, plan.answer_tokens, plan.total_tokens) == (30, 5, 45)

    @given(
        reply=st.integers(0, 500),
        reasoning=st.integers(0, 500),
        max_tokens=st.none() | st.integers(0, 600),
        max_total=st.none() | st.integers(0, 1200),
    )
    def test_caps_hold_and_length_means_capped(
        self, reply: int, reasoning: int, max_tokens: int | None, max_total: int | None
    ) -> None:
        """Completion never exceeds its caps, and finish_reason is "length" exactly when a cap bit."""
        plan = plan_generation(
            7, reply_tokens=reply, reasoning_tokens=reasoning, max_tokens=max_tokens, max_total=max_total
        )
        if max_total is not None:
            assert plan.completion_tokens <= max_total
        elif max_tokens is not None:
            assert plan.answer_tokens <= max_tokens
        capped = (plan.answer_tokens, plan.reasoning_tokens) != (reply, reasoning)
        assert (plan.finish_reason == "length") == capped
        assert plan.total_tokens == 7 + plan.reasoning_tokens + plan.answer_tokens


class TestChatPromptTokens:
    def test_text_parts_images_and_overheads(self) -> None:
        """Prompt = text tokens + 1000 per image + 3 per message + 3."""
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url"}]},
        ]
        expected = count_text(MODEL, "be brief") + count_text(MODEL, "what is this") + 1000 + 3 * 2 + 3
        assert chat_prompt_tokens(MODEL, messages) == expected


class TestLifecycle:
    def test_urls_name_the_bound_port(self, sim: ArkSimulator) -> None:
        """Port 0 picks a free port; url adds /api/v3 to base_url."""
        assert sim.port > 0
        assert sim.base_url == f"http://127.0.0.1:{sim.port}"
        assert sim.url == sim.base_url + "/api/v3"

    def test_stop_releases_the_port(self) -> None:
        """After stop() nothing listens any more."""
        running = serve()
        base = running.base_url
        running.stop()
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/_sim/health")

    def test_stop_ends_idle_keep_alive_handlers(self) -> None:
        """stop() closes connections a client keeps idle, so no handler thread outlives the server."""
        running = serve()
        with httpx.Client(base_url=running.url, headers=AUTH) as http:
            assert chat(http).status_code == 200  # the pooled connection now idles in a handler thread
            server = running._server
            running.stop()
            deadline = time.monotonic() + 10
            while server is not None and server._open and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server is not None and not server._open

    def test_keep_alive_reuses_one_connection(self, sim: ArkSimulator) -> None:
        """Several requests travel over one HTTP/1.1 connection."""
        peers = set()
        with httpx.Client(base_url=sim.url, headers=AUTH, limits=httpx.Limits(max_connections=1)) as http:
            for _ in range(3):
                with http.stream("POST", "/chat/completions", json={"model": MODEL, "messages": HELLO}) as response:
                    peers.add(response.extensions["network_stream"].get_extra_info("client_addr"))
                    response.read()
        assert len(peers) == 1


class TestChatCompletions:
    def test_non_stream_shape_and_usage(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """A chat.completion with deterministic content and Ark's usage shape."""
        body = chat(client).json()
        assert body["object"] == "chat.completion"
        assert body["model"] == MODEL
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "tok " * 20}
        assert choice["finish_reason"] == "stop"
        prompt = hello_prompt_tokens()
        assert body["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": 20,
            "total_tokens": prompt + 20,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
        assert sim.billed_total() == prompt + 20
        assert sim.billed_by_model() == {MODEL: prompt + 20}

    def test_bots_path_answers_like_chat(self, client: httpx.Client) -> None:
        """/bots/chat/completions is served with the same shape."""
        response = client.post("/bots/chat/completions", json={"model": "bot-1", "messages": HELLO})
        assert response.json()["usage"]["completion_tokens"] == 20

    def test_reply_tokens_per_request_header(self, client: httpx.Client) -> None:
        """x-sim-reply-tokens changes the answer length of one request."""
        body = chat(client, {"x-sim-reply-tokens": "3"}).json()
        assert body["choices"][0]["message"]["content"] == "tok tok tok "

    @pytest.mark.parametrize(
        ("body", "code", "param"),
        [
            ({"messages": HELLO}, "MissingParameter", "model"),
            ({"model": MODEL}, "MissingParameter", "messages"),
            ({"model": MODEL, "messages": []}, "InvalidParameter", "messages"),
            ({"model": MODEL, "messages": HELLO, "max_tokens": -1}, "InvalidParameter", "max_tokens"),
        ],
    )
    def test_validation_errors_are_ark_shaped_and_free(
        self, sim: ArkSimulator, client: httpx.Client, body: dict[str, Any], code: str, param: str
    ) -> None:
        """Invalid bodies get 400 in Ark's error shape and are not billed."""
        response = client.post("/chat/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (code, param, "BadRequest")
        assert "Request id:" in error["message"]
        assert sim.calls() == 0

    def test_unparseable_json_is_invalid_parameter(self, client: httpx.Client) -> None:
        """A body that is not JSON is a 400 InvalidParameter."""
        response = client.post("/chat/completions", content=b"{nope", headers={"Content-Type": "application/json"})
        assert (response.status_code, response.json()["error"]["code"]) == (400, "InvalidParameter")

    def test_missing_bearer_is_401(self, sim: ArkSimulator) -> None:
        """No Authorization header: 401 AuthenticationError, any key would do."""
        response = httpx.post(sim.url + "/chat/completions", json={"model": MODEL, "messages": HELLO})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "AuthenticationError"
        assert sim.calls() == 0

    def test_unknown_path_is_ark_404(self, client: httpx.Client) -> None:
        """Paths the simulator does not serve answer 404 in Ark's shape."""
        response = client.post("/audio/speech", json={})
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "NotFound"


class TestChatStream:
    def test_chunks_carry_null_usage_and_end_with_done(self, client: httpx.Client) -> None:
        """Role chunk, ceil(20/4) content chunks, a finish chunk, then [DONE]; usage null throughout."""
        chunks = stream_chunks(client)
        assert chunks[-1] == "[DONE]"
        data = chunks[:-1]
        assert len(data) == 1 + 5 + 1
        assert data[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in data)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in data) == "tok " * 20
        assert data[-1]["choices"][0]["finish_reason"] == "stop"

    def test_include_usage_adds_one_usage_chunk(self, client: httpx.Client) -> None:
        """include_usage appends exactly one chunk with empty choices and the full usage."""
        plain = stream_chunks(client)
        with_usage = stream_chunks(client, stream_options={"include_usage": True})
        assert len(with_usage) == len(plain) + 1
        usage_chunk = with_usage[-2]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["total_tokens"] == hello_prompt_tokens() + 20
        assert all(c["usage"] is None for c in with_usage[:-2])

    def test_chunk_include_usage_is_cumulative(self, client: httpx.Client) -> None:
        """chunk_include_usage puts the usage so far on every chunk, prompt counted from the start."""
        data = stream_chunks(client, {"x-sim-reasoning-tokens": "6"}, stream_options={"chunk_include_usage": True})[:-1]
        prompt = hello_prompt_tokens()
        assert all(c["usage"]["prompt_tokens"] == prompt for c in data)
        completions = [c["usage"]["completion_tokens"] for c in data]
        assert completions == sorted(completions)
        assert completions[0] == 0
        assert completions[-1] == 26
        assert data[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


class TestReasoning:
    def test_reasoning_counts_in_completion(self, client: httpx.Client) -> None:
        """reasoning_tokens > 0 adds reasoning_content and counts inside completion_tokens."""
        body = chat(client, {"x-sim-reasoning-tokens": "10"}).json()
        assert body["choices"][0]["message"]["reasoning_content"] == "think " * 10
        assert body["usage"]["completion_tokens"] == 30
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 10

    def test_thinking_disabled_means_no_reasoning(self, client: httpx.Client) -> None:
        """thinking: {type: disabled} drops reasoning entirely."""
        body = chat(client, {"x-sim-reasoning-tokens": "10"}, thinking={"type": "disabled"}).json()
        assert "reasoning_content" not in body["choices"][0]["message"]
        assert body["usage"]["completion_tokens"] == 20

    def test_stream_reasoning_deltas(self, client: httpx.Client) -> None:
        """A thinking stream sends reasoning_content deltas before the content."""
        data = stream_chunks(client, {"x-sim-reasoning-tokens": "5"})[:-1]
        reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in data)
        assert reasoning == "think " * 5


class TestCaps:
    def test_max_tokens_truncates_with_length(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """max_tokens below reply_tokens: shorter answer, finish_reason length, billed as answered."""
        body = chat(client, max_tokens=4).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4
        assert sim.billed_total() == body["usage"]["total_tokens"]

    def test_max_completion_tokens_covers_reasoning(self, client: httpx.Client) -> None:
        """max_completion_tokens caps reasoning + answer together, reasoning first."""
        body = chat(client, {"x-sim-reasoning-tokens": "8"}, max_completion_tokens=10).json()
        details = body["usage"]["completion_tokens_details"]
        assert (details["reasoning_tokens"], body["usage"]["completion_tokens"]) == (8, 10)
        assert body["choices"][0]["message"]["content"] == "tok tok "

    def test_both_bounds_are_refused_as_ark_refuses_them(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """max_tokens beside max_completion_tokens: Ark's 400 (as quoted in HKUDS/nanobot#2548), nothing billed."""
        response = chat(client, max_tokens=64, max_completion_tokens=500)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"], error["type"]) == ("InvalidParameter", "max_tokens", "BadRequest")
        assert error["message"].startswith(
            "The parameter `max_tokens` specified in the request are not valid: max_tokens and max_completion_tokens"
            " cannot be set at the same time. Request id: "
        )
        assert sim.billed_total() == 0


class TestFaults:
    def test_cut_stream_breaks_and_bills_in_full(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """A cut stream ends without [DONE] mid-body, and the planned usage is still billed."""
        received: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError):  # noqa: SIM117
            with client.stream(
                "POST",
                "/chat/completions",
                json={"model": MODEL, "messages": HELLO, "stream": True},
                headers={"x-sim-fault": "cut"},
            ) as response:
                received.extend(response.iter_lines())
        assert not any("[DONE]" in line for line in received)
        assert sim.calls() == 1
        assert sim.billed_total() == hello_prompt_tokens() + 20

    def test_cut_non_stream_closes_after_headers(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """A cut non-stream answer sends headers, no body, and is billed."""
        with pytest.raises(httpx.RemoteProtocolError):
            chat(client, {"x-sim-fault": "cut"})
        assert sim.calls() == 1

    @pytest.mark.parametrize(("fault", "status"), [("error_500", 500), ("error_429", 429), ("error_400", 400)])
    def test_error_faults_are_not_billed(
        self, sim: ArkSimulator, client: httpx.Client, fault: str, status: int
    ) -> None:
        """error_* faults answer in Ark's error shape and cost nothing."""
        response = chat(client, {"x-sim-fault": fault})
        assert response.status_code == status
        assert set(response.json()["error"]) == {"code", "message", "param", "type"}
        assert (sim.calls(), sim.billed_total()) == (0, 0)
        assert sim.requests_by_path() == {"/api/v3/chat/completions": 1}

    def test_error_code_override(self, client: httpx.Client) -> None:
        """error_code replaces the fault's Ark code (e.g. QuotaExceeded)."""
        response = chat(client, {"x-sim-fault": "error_429", "x-sim-error-code": "QuotaExceeded"})
        assert response.json()["error"]["code"] == "QuotaExceeded"

    def test_no_usage_omits_usage_but_bills(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """no_usage hides usage from the client; the provider still bills it."""
        body = chat(client, {"x-sim-fault": "no_usage"}).json()
        chunks = stream_chunks(client, {"x-sim-fault": "no_usage"}, stream_options={"include_usage": True})
        assert "usage" not in body
        assert all(c["usage"] is None for c in chunks[:-1])
        assert all(c["choices"] for c in chunks[:-1])
        assert sim.billed_total() == 2 * (hello_prompt_tokens() + 20)

    def test_hang_holds_headers_and_bills(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """hang sends headers then nothing; the client times out and the call is billed."""
        with pytest.raises(httpx.ReadTimeout):
            client.post(
                "/chat/completions",
                json={"model": MODEL, "messages": HELLO},
                headers={"x-sim-fault": "hang", "x-sim-hang-s": "30"},
                timeout=httpx.Timeout(10, read=0.3),
            )
        assert sim.calls() == 1

    def test_error_rate_one_always_fails(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """error_rate 1.0 turns every call into an unbilled 500."""
        sim.configure(error_rate=1.0)
        assert [chat(client).status_code for _ in range(3)] == [500, 500, 500]
        assert sim.calls() == 0


class TestClientDisconnect:
    def test_abandoned_stream_is_billed_once_and_server_lives(
        self, sim: ArkSimulator, client: httpx.Client, capfd: pytest.CaptureFixture[str]
    ) -> None:
        """A client leaving mid-stream is billed once, leaks no handler and breaks nothing."""
        body = {"model": MODEL, "messages": HELLO, "stream": True}
        with client.stream("POST", "/chat/completions", json=body, headers={"x-sim-chunk-delay-s": "0.02"}) as r:
            next(r.iter_lines())
        client.close()
        deadline = time.monotonic() + 10
        while sim._server is not None and sim._server._open and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sim._server is not None and not sim._server._open
        assert sim.calls() == 1
        assert httpx.post(sim.url + "/chat/completions", json=body, headers=AUTH).status_code == 200
        assert sim.calls() == 2
        assert "Traceback" not in capfd.readouterr().err


class TestResponsesApi:
    def test_non_stream_response_object(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """A completed response with one output_text message and input/output usage."""
        items = [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]
        body = client.post("/responses", json={"model": MODEL, "input": items, "instructions": "be brief"}).json()
        assert (body["object"], body["status"]) == ("response", "completed")
        assert body["output"][-1]["content"][0] == {
            "type": "output_text",
            "text": "tok " * 20,
            "annotations": [],
        }
        prompt = count_text(MODEL, "be brief") + count_text(MODEL, "hello") + 3 * 2 + 3
        usage = body["usage"]
        assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (
            prompt,
            20,
            prompt + 20,
        )
        assert usage["input_tokens_details"] == {"cached_tokens": 0}
        assert sim.billed_total() == prompt + 20

    def test_stream_ends_with_completed_usage(self, client: httpx.Client) -> None:
        """Stream: event-named frames from response.created to response.completed, no [DONE]."""
        text = client.post("/responses", json={"model": MODEL, "input": "hello", "stream": True}).text
        events = [line[len("event: ") :] for line in text.splitlines() if line.startswith("event: ")]
        data = [json.loads(d) for d in sse_data(text)]
        assert events[0] == "response.created" and events[-1] == "response.completed"
        assert [d["type"] for d in data] == events
        deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
        assert deltas == "tok " * 20
        assert data[-1]["response"]["usage"]["total_tokens"] == hello_prompt_tokens() + 20
        assert "[DONE]" not in text

    def test_max_output_tokens_makes_it_incomplete(self, client: httpx.Client) -> None:
        """max_output_tokens caps reasoning + answer; the response is incomplete."""
        body = client.post(
            "/responses",
            json={"model": MODEL, "input": "hi", "max_output_tokens": 7},
            headers={"x-sim-reasoning-tokens": "5"},
        ).json()
        assert body["status"] == "incomplete"
        assert body["usage"]["output_tokens"] == 7
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 5


class TestEmbeddings:
    def test_list_input_usage_and_vectors(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """One 8-float vector per input; usage has prompt and total tokens only."""
        body = client.post("/embeddings", json={"model": EMB, "input": ["a b", "c"]}).json()
        assert [d["index"] for d in body["data"]] == [0, 1]
        assert all(len(d["embedding"]) == 8 for d in body["data"])
        expected = count_text(EMB, "a b") + count_text(EMB, "c")
        assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected}
        assert sim.billed_by_model() == {EMB: expected}

    def test_base64_encoding(self, client: httpx.Client) -> None:
        """encoding_format base64 returns the same vector as little-endian float32."""
        floats = client.post("/embeddings", json={"model": EMB, "input": "x"}).json()["data"][0]["embedding"]
        packed = client.post("/embeddings", json={"model": EMB, "input": "x", "encoding_format": "base64"}).json()
        decoded = struct.unpack("<8f", base64.b64decode(packed["data"][0]["embedding"]))
        assert decoded == pytest.approx(floats, abs=1e-6)


class TestLegacyCompletions:
    def test_text_and_usage(self, client: httpx.Client) -> None:
        """choices[0].text carries the answer; usage counts the prompt."""
        body = client.post("/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2}).json()
        assert body["choices"][0]["text"] == "tok tok "
        assert body["usage"]["total_tokens"] == count_text(MODEL, "hello") + 2

    def test_stream_with_usage_chunk(self, client: httpx.Client) -> None:
        """The legacy stream ends with a usage chunk (include_usage) then [DONE]."""
        body = {"model": MODEL, "prompt": "hello", "stream": True, "stream_options": {"include_usage": True}}
        payloads = sse_data(client.post("/completions", json=body).text)
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 20


class TestOpenAISdk:
    @pytest.fixture
    def sdk(self, sim: ArkSimulator) -> openai.OpenAI:
        return openai.OpenAI(base_url=sim.url, api_key="x", max_retries=0)

    def test_non_stream_parses(self, sim: ArkSimulator, sdk: openai.OpenAI) -> None:
        """openai (httpx2) parses the completion and its usage details."""
        completion = sdk.chat.completions.create(model=MODEL, messages=HELLO)  # type: ignore[arg-type]
        assert completion.usage is not None
        assert completion.usage.total_tokens == sim.billed_total()
        assert completion.usage.completion_tokens_details is not None

    def test_stream_include_usage_adds_one_chunk(self, sdk: openai.OpenAI) -> None:
        """include_usage yields exactly one more chunk, with empty choices and usage."""
        plain = list(sdk.chat.completions.create(model=MODEL, messages=HELLO, stream=True))  # type: ignore[arg-type]
        counted = list(
            sdk.chat.completions.create(
                model=MODEL,
                messages=HELLO,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert len(plain) == 1 + math.ceil(20 / 4) + 1
        assert len(counted) == len(plain) + 1
        assert counted[-1].choices == [] and counted[-1].usage is not None
        assert counted[-1].usage.completion_tokens == 20

    def test_responses_stream_usage(self, sdk: openai.OpenAI) -> None:
        """The SDK's Responses stream ends with a completed event carrying usage."""
        events = list(sdk.responses.create(model=MODEL, input="hello", stream=True))
        assert events[-1].type == "response.completed"
        assert events[-1].response.usage is not None
        assert events[-1].response.usage.total_tokens == hello_prompt_tokens() + 20

    def test_embeddings_default_base64(self, sdk: openai.OpenAI) -> None:
        """openai asks for base64 embeddings by default and decodes them to 8 floats."""
        response = sdk.embeddings.create(model=EMB, input="hello")
        assert len(response.data[0].embedding) == 8

    def test_cut_stream_raises(self, sim: ArkSimulator, sdk: openai.OpenAI) -> None:
        """A cut stream surfaces as APIConnectionError in the SDK, and is billed."""
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=HELLO,  # type: ignore[arg-type]
            stream=True,
            extra_headers={"x-sim-fault": "cut"},
        )
        with pytest.raises(openai.APIConnectionError):
            list(stream)
        assert sim.calls() == 1

    def test_error_500_raises_unbilled(self, sim: ArkSimulator, sdk: openai.OpenAI) -> None:
        """error_500 is an InternalServerError and costs nothing."""
        with pytest.raises(openai.InternalServerError):
            sdk.chat.completions.create(
                model=MODEL,
                messages=HELLO,  # type: ignore[arg-type]
                extra_headers={"x-sim-fault": "error_500"},
            )
        assert sim.billed_total() == 0


class TestArkSdk:
    @pytest.fixture
    def ark(self, sim: ArkSimulator) -> Ark:
        return Ark(base_url=sim.url, api_key="x", max_retries=0)

    def test_non_stream_parses(self, sim: ArkSimulator, ark: Ark) -> None:
        """volcengine-ark-runtime (httpx) parses usage with Ark's details."""
        completion = ark.chat.completions.create(
            model=MODEL, messages=HELLO, extra_headers={"x-sim-reasoning-tokens": "4"}
        )
        assert completion.usage.completion_tokens_details.reasoning_tokens == 4
        assert completion.choices[0].message.reasoning_content == "think " * 4
        assert completion.usage.total_tokens == sim.billed_total()

    def test_stream_include_usage_adds_one_chunk(self, ark: Ark) -> None:
        """Ark's stream yields one extra, choice-less usage chunk under include_usage."""
        plain = list(ark.chat.completions.create(model=MODEL, messages=HELLO, stream=True))
        counted = list(
            ark.chat.completions.create(
                model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True}
            )
        )
        assert len(counted) == len(plain) + 1
        assert counted[-1].choices == [] and counted[-1].usage.total_tokens == hello_prompt_tokens() + 20

    def test_chunk_include_usage(self, ark: Ark) -> None:
        """chunk_include_usage gives every parsed chunk a cumulative usage."""
        chunks = list(
            ark.chat.completions.create(
                model=MODEL, messages=HELLO, stream=True, stream_options={"chunk_include_usage": True}
            )
        )
        assert [c.usage.completion_tokens for c in chunks] == [0, 4, 8, 12, 16, 20, 20]

    def test_responses(self, ark: Ark) -> None:
        """Ark's Responses client parses the object and its usage."""
        response = ark.responses.create(model=MODEL, input="hello")
        assert response.usage.output_tokens == 20
        assert response.status == "completed"

    def test_cut_stream_raises(self, ark: Ark) -> None:
        """Ark's SDK lets httpx's protocol error through on a cut stream."""
        stream = ark.chat.completions.create(
            model=MODEL, messages=HELLO, stream=True, extra_headers={"x-sim-fault": "cut"}
        )
        with pytest.raises(httpx.RemoteProtocolError):
            list(stream)


class TestConcurrentBilling:
    def test_bill_equals_sum_of_usages(self, sim: ArkSimulator) -> None:
        """32 concurrent calls (stream and not): billed_total is the sum of reported usages."""
        limits = httpx.Limits(max_connections=32)
        with httpx.Client(base_url=sim.url, headers=AUTH, limits=limits, timeout=30) as http:

            def one(i: int) -> int:
                headers = {"x-sim-reply-tokens": str(i % 7 + 1)}
                if i % 2:
                    chunks = stream_chunks(http, headers, stream_options={"include_usage": True})
                    return int(chunks[-2]["usage"]["total_tokens"])
                return int(chat(http, headers).json()["usage"]["total_tokens"])

            with concurrent.futures.ThreadPoolExecutor(32) as pool:
                totals = list(pool.map(one, range(32)))
        assert sim.calls() == 32
        assert sim.billed_total() == sum(totals)

    def test_sixty_four_connections_at_once(self, sim: ArkSimulator) -> None:
        """64 clients holding a connection open each at the same time all get answers."""
        barrier = threading.Barrier(64)

        def one(_: int) -> int:
            with httpx.Client(base_url=sim.url, headers=AUTH, timeout=30) as http:
                barrier.wait()
                return chat(http, {"x-sim-latency-s": "0.2"}).status_code

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            statuses = list(pool.map(one, range(64)))
        assert statuses == [200] * 64


class TestControlApi:
    def test_stats_reports_the_bill(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """GET /_sim/stats mirrors billed_total, billed_by_model, calls and requests_by_path."""
        chat(client)
        chat(client, {"x-sim-fault": "error_500"})
        stats = httpx.get(sim.base_url + "/_sim/stats").json()
        total = hello_prompt_tokens() + 20
        assert stats == {
            "billed_total": total,
            "billed_by_model": {MODEL: total},
            "calls": 1,
            "requests_by_path": {"/api/v3/chat/completions": 2},
        }

    def test_reset_clears_the_bill(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """POST /_sim/reset zeroes the bill and the request counts."""
        chat(client)
        httpx.post(sim.base_url + "/_sim/reset")
        assert (sim.billed_total(), sim.calls(), sim.requests_by_path()) == (0, 0, {})

    def test_config_patch_changes_behaviour(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """POST /_sim/config patches fields and returns the new config."""
        returned = httpx.post(sim.base_url + "/_sim/config", json={"reply_tokens": 2, "fault": None}).json()
        assert returned["reply_tokens"] == 2
        assert chat(client).json()["usage"]["completion_tokens"] == 2

    def test_bad_config_patch_is_400(self, sim: ArkSimulator) -> None:
        """An unknown field or bad value is refused and the config stays."""
        response = httpx.post(sim.base_url + "/_sim/config", json={"fault": "explode"})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "fault"
        assert sim.config.fault is None

    def test_packages_over_http(self, sim: ArkSimulator) -> None:
        """POST /_sim/packages replaces the packages and returns the billing view."""
        spec = {"model": MODEL, "total": 500000, "effective_time": 0, "expiry_time": 4e9}
        body = httpx.post(sim.base_url + "/_sim/packages", json={"packages": [spec]}).json()
        assert sim.config.packages == (PackageSpec(MODEL, 500000, 0.0, 4e9),)
        assert body["report"][0]["AvailableAmount"] == "500000"


class TestEndpoints:
    EP = "ep-20250101123456-abcde"

    def test_an_endpoint_is_served_as_its_foundation_model(self) -> None:
        """A call through an endpoint id is answered with the foundation model's id, streamed or not, and billed
        as that model; a call naming the model itself is the same model."""
        with ArkSimulator(SimConfig(endpoints=((self.EP, "deepseek-v4-flash-260425"),))) as ep_sim:
            with httpx.Client(base_url=ep_sim.url, headers=AUTH, timeout=10) as http:
                plain = http.post("/chat/completions", json={"model": self.EP, "messages": HELLO}).json()
                chunks = stream_chunks(http, model=self.EP)
            assert plain["model"] == "deepseek-v4-flash-260425"
            assert {chunk["model"] for chunk in chunks if chunk != "[DONE]"} == {"deepseek-v4-flash-260425"}
            assert set(ep_sim.billed_by_model()) == {"deepseek-v4-flash-260425"}

    @pytest.mark.parametrize(
        "given",
        [
            ["ep-1=m-1", "ep-2=m-2"],
            "ep-1=m-1,ep-2=m-2",
            {"ep-1": "m-1", "ep-2": "m-2"},
            [("ep-1", "m-1"), ("ep-2", "m-2")],
        ],
    )
    def test_pairs_are_read_in_every_form(self, given: Any) -> None:
        """The command line's ID=MODEL, a JSON object, a header's comma list, or pairs."""
        assert SimConfig(endpoints=given).endpoints == (("ep-1", "m-1"), ("ep-2", "m-2"))

    def test_a_pair_that_is_none_is_refused(self) -> None:
        """ID=MODEL with either side missing is a config error naming the field."""
        with pytest.raises(SimConfigError, match="endpoints"):
            SimConfig(endpoints=("ep-1",))

    def test_the_management_api_lists_them(self) -> None:
        """ListEndpoints (service ark, 2024-01-01) pages the pairs, each model split into Name and ModelVersion."""
        pairs = tuple((f"ep-{i}", f"deepseek-v4-flash-26042{i}") for i in range(3))
        with ArkSimulator(SimConfig(endpoints=pairs)) as ep_sim:
            url = ep_sim.base_url + "/?Action=ListEndpoints&Version=2024-01-01"
            headers = {"Authorization": "HMAC-SHA256 Credential=AK/20260101/cn-beijing/ark/request"}
            first = httpx.post(url, json={"PageNumber": 1, "PageSize": 2}, headers=headers).json()["Result"]
            second = httpx.post(url, json={"PageNumber": 2, "PageSize": 2}, headers=headers).json()["Result"]
            unsigned = httpx.post(url, json={})
        assert first["TotalCount"] == 3 and [item["Id"] for item in first["Items"] + second["Items"]] == [
            "ep-0",
            "ep-1",
            "ep-2",
        ]
        foundation = first["Items"][0]["ModelReference"]["FoundationModel"]
        assert foundation == {"Name": "deepseek-v4-flash", "ModelVersion": "260420"}
        assert unsigned.status_code == 401


class TestBillingApi:
    @pytest.fixture
    def billed_sim(self, clock: FakeClock) -> Iterator[ArkSimulator]:
        with ArkSimulator(clock=clock) as running:
            yield running

    def test_items_are_all_strings_with_model_in_name(self, billed_sim: ArkSimulator, clock: FakeClock) -> None:
        """Each item has the documented fields as strings; ConfigurationName names the model."""
        billed_sim.set_packages([PackageSpec("deepseek-v4-flash", 500000, clock.now - 10, clock.now + 86400)])
        body = billing_post(billed_sim, {"ResourceType": "Package", "MaxResults": "20", "NextToken": ""}).json()
        assert body["ResponseMetadata"]["Action"] == "ListResourcePackages"
        item = body["Result"]["List"][0]
        assert all(isinstance(v, str) for v in item.values())
        assert item["ConfigurationName"] == "deepseek-v4-flash 免费资源包"
        assert (item["Unit"], item["Status"], item["Product"]) == ("token", "Effective", "ark")
        assert item["ExpiryTime"] == format_utc(clock.now + 86400)

    def test_paging_honours_max_results(self, billed_sim: ArkSimulator, clock: FakeClock) -> None:
        """MaxResults pages the list and NextToken runs out empty."""
        billed_sim.set_packages([PackageSpec(f"m{i}", 100, clock.now - i, clock.now + 1e6) for i in range(5)])
        seen, token, pages = [], "", 0
        while True:
            result = billing_post(
                billed_sim, {"ResourceType": "Package", "MaxResults": "2", "NextToken": token}
            ).json()["Result"]
            pages += 1
            seen += [item["InstanceNo"] for item in result["List"]]
            token = result["NextToken"]
            if not token:
                break
        assert pages == 3
        assert len(set(seen)) == 5

    @pytest.mark.parametrize(
        ("body", "code"),
        [
            ({"ResourceType": "Package", "MaxResults": "21"}, "InvalidParameter"),
            ({"ResourceType": "Package"}, "MissingParameter"),
            ({"MaxResults": "20"}, "MissingParameter"),
            ({"ResourceType": "Package", "MaxResults": "5", "Status": "Sleeping"}, "InvalidParameter"),
        ],
    )
    def test_invalid_requests_rejected(self, billed_sim: ArkSimulator, body: dict[str, Any], code: str) -> None:
        """Requests the real API would refuse get a 400 Volcengine error."""
        response = billing_post(billed_sim, body)
        assert response.status_code == 400
        assert response.json()["ResponseMetadata"]["Error"]["Code"] == code

    def test_unsigned_request_is_401(self, billed_sim: ArkSimulator) -> None:
        """A billing call without Authorization is refused."""
        response = billing_post(billed_sim, {"ResourceType": "Package", "MaxResults": "20"}, headers={})
        assert response.status_code == 401

    def test_balance_lags_behind_the_bill(self, billed_sim: ArkSimulator, clock: FakeClock) -> None:
        """Usage shows in AvailableAmount only balance_lag_s after it was billed."""
        billed_sim.configure(balance_lag_s=60)
        billed_sim.set_packages([PackageSpec(MODEL, 1000, clock.now - 10, clock.now + 86400)])
        used = httpx.post(billed_sim.url + "/chat/completions", json={"model": MODEL, "messages": HELLO}, headers=AUTH)
        total = used.json()["usage"]["total_tokens"]
        clock.now += 59
        assert billed_sim.package_report()[0]["AvailableAmount"] == "1000"
        clock.now += 2
        alias = httpx.post(
            billed_sim.base_url + "/billing/ListResourcePackages",
            json={"ResourceType": "Package", "MaxResults": "20"},
            headers={"Authorization": "x"},
        )
        assert alias.json()["Result"]["List"][0]["AvailableAmount"] == str(1000 - total)

    def test_expired_package_reports_zero(self, billed_sim: ArkSimulator, clock: FakeClock) -> None:
        """After expiry a package is Expired with AvailableAmount "0"; the Status filter sees it."""
        billed_sim.set_packages([PackageSpec(MODEL, 1000, clock.now - 10, clock.now + 100)])
        clock.now += 100
        body = {"ResourceType": "Package", "MaxResults": "20", "Status": "Expired"}
        (item,) = billing_post(billed_sim, body).json()["Result"]["List"]
        assert (item["Status"], item["AvailableAmount"], item["TotalAmount"]) == ("Expired", "0", "1000")
        body["Status"] = "Effective"
        assert billing_post(billed_sim, body).json()["Result"]["List"] == []

    def test_fifo_draws_earliest_effective_first(self) -> None:
        """A bill empties the older package before touching the newer; overflow is post-paid."""
        old, new = PackageSpec("m", 100, 0, 1e9), PackageSpec("m", 100, 50, 1e9)
        items = report_packages([new, old], [BillRecord(60, "m", "/x", 120, 30)], now=70, balance_lag_s=0)
        by_effective = {item["EffectiveTime"]: item for item in items}
        assert by_effective[format_utc(0)]["Status"] == "UsedUp"
        assert by_effective[format_utc(50)]["AvailableAmount"] == "50"
        overflow = report_packages([old], [BillRecord(60, "m", "/x", 300, 0)], now=70, balance_lag_s=0)
        assert overflow[0]["AvailableAmount"] == "0"

    def test_bills_before_effective_time_do_not_draw(self) -> None:
        """Only packages effective at billing time are drawn from."""
        later = PackageSpec("m", 100, 500, 1e9)
        items = report_packages([later], [BillRecord(10, "m", "/x", 40, 0)], now=600, balance_lag_s=0)
        assert items[0]["AvailableAmount"] == "100"

    @given(
        bills=st.lists(st.tuples(st.floats(0, 1000), st.integers(0, 300)), max_size=20),
        totals=st.lists(st.integers(0, 500), min_size=1, max_size=4),
        now=st.floats(0, 2000),
        lag=st.floats(0, 100),
    )
    def test_available_stays_within_total(
        self, bills: list[tuple[float, int]], totals: list[int], now: float, lag: float
    ) -> None:
        """Reported AvailableAmount is always between 0 and TotalAmount."""
        specs = [PackageSpec("m", total, i * 100.0, 1500.0) for i, total in enumerate(totals)]
        records = [BillRecord(t, "m", "/x", tokens, 0) for t, tokens in bills]
        for item in report_packages(specs, records, now, lag):
            assert 0 <= int(item["AvailableAmount"]) <= int(item["TotalAmount"])

    def test_other_resource_types_are_empty(self) -> None:
        """RI and RSC requests are valid but list no token packages."""
        items = [{"Status": "Effective", "Product": "ark"}]
        assert list_resource_packages(items, {"ResourceType": "RI", "MaxResults": "5"}) == {
            "List": [],
            "NextToken": "",
        }


class TestRunForever:
    def test_prints_url_and_stops_on_event(self) -> None:
        """run_forever prints the URL line, serves, and stops the simulator once `stop` is set."""
        sim = ArkSimulator()
        stop = threading.Event()
        printed = io.StringIO()
        runner = threading.Thread(target=simulator.run_forever, args=(sim,), kwargs={"stop": stop, "out": printed})
        runner.start()
        try:
            deadline = time.monotonic() + 30
            while not printed.getvalue() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert printed.getvalue() == f"Ark simulator listening on {sim.url}\n"
            assert httpx.get(sim.base_url + "/_sim/health").json() == {"ok": True}
        finally:
            stop.set()
            runner.join(timeout=30)
        assert sim._server is None

    def test_sigterm_exits_cleanly(self) -> None:
        """In a real process, SIGTERM ends run_forever with exit code 0."""
        code = "from quotawrap.simulator import serve, run_forever; run_forever(serve())"
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            url = line.rsplit(" ", 1)[-1]
            assert line.startswith("Ark simulator listening on ") and url.endswith("/api/v3")
            response = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": HELLO}, headers=AUTH)
            assert response.status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
