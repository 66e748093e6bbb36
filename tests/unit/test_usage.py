"""Tests for quotawrap.core.usage: where each answer's shape keeps its usage, and whether it may be charged."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotawrap.core.usage import (
    TOKEN_CEILING,
    Checked,
    Usage,
    UsageBound,
    check_usage,
    model_of_body,
    usage_from_body,
    usage_from_mapping,
)

ARK_USAGE: dict[str, Any] = {
    "prompt_tokens": 120,
    "completion_tokens": 350,
    "total_tokens": 470,
    "prompt_tokens_details": {"cached_tokens": 100, "provisioned_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 300},
}
RESPONSES_USAGE: dict[str, Any] = {
    "input_tokens": 50,
    "input_tokens_details": {"cached_tokens": 10},
    "output_tokens": 80,
    "output_tokens_details": {"reasoning_tokens": 20},
    "total_tokens": 130,
    "tool_usage": {"web_search": 1},
}


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


# --------------------------------------------------------------------------- usage_from_mapping


class TestUsageFromMapping:
    @pytest.mark.parametrize(
        ("usage", "expected"),
        [
            pytest.param(ARK_USAGE, Usage(120, 350, 470, 300, 100), id="ark-chat-with-details"),
            pytest.param(RESPONSES_USAGE, Usage(50, 80, 130, 20, 10), id="responses-input-output"),
            pytest.param({"prompt_tokens": 9, "total_tokens": 9}, Usage(9, 0, 9), id="embeddings"),
            pytest.param({"prompt_tokens": 3, "completion_tokens": 4}, Usage(3, 4, 7), id="missing-total"),
            pytest.param({"input_tokens": 3, "output_tokens": 4}, Usage(3, 4, 7), id="responses-missing-total"),
            pytest.param({"completion_tokens": 4, "total_tokens": 10}, Usage(6, 4, 10), id="prompt-from-total"),
            pytest.param({"total_tokens": 10}, Usage(10, 0, 10), id="total-only"),
            pytest.param(
                {"prompt_tokens": 1, "completion_tokens": None, "total_tokens": 3},
                Usage(1, 2, 3),
                id="null-count-is-absent",
            ),
            pytest.param(
                {
                    "prompt_tokens": 1,
                    "completion_tokens": 2,
                    "total_tokens": 3,
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
                Usage(1, 2, 3),
                id="null-details",
            ),
            pytest.param(
                {
                    "prompt_tokens": 1,
                    "completion_tokens": 2,
                    "total_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": "many"},
                    "completion_tokens_details": {"reasoning_tokens": -4},
                },
                Usage(1, 2, 3),
                id="malformed-details-are-zero",
            ),
            pytest.param(
                {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_cache_hit_tokens": 4},
                Usage(5, 2, 7, 0, 4),
                id="deepseek-cache-hit",
            ),
            pytest.param({"prompt_tokens": 5.0, "completion_tokens": 2}, Usage(5, 2, 7), id="integral-float"),
            pytest.param(
                {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 9},
                Usage(5, 2, 9),
                id="server-total-wins",
            ),
        ],
    )
    def test_shapes(self, usage: Mapping[str, Any], expected: Usage) -> None:
        """Every documented usage shape maps to the same Usage fields."""
        assert usage_from_mapping(usage) == expected

    @pytest.mark.parametrize(
        "usage",
        [
            pytest.param(None, id="null"),
            pytest.param([], id="list"),
            pytest.param("usage", id="string"),
            pytest.param({}, id="empty"),
            pytest.param({"tool_usage": {"web_search": 1}}, id="no-counts"),
            pytest.param({"prompt_tokens": -1, "completion_tokens": 2}, id="negative"),
            pytest.param({"prompt_tokens": "5", "completion_tokens": 2}, id="string-count"),
            pytest.param({"prompt_tokens": True, "completion_tokens": 2}, id="bool-count"),
            pytest.param({"prompt_tokens": 1.5, "completion_tokens": 2}, id="fractional"),
            pytest.param({"prompt_tokens": float("nan")}, id="nan"),
            pytest.param({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": -3}, id="negative-total"),
        ],
    )
    def test_unusable(self, usage: Any) -> None:
        """Null, wrong types and negative numbers give None rather than a wrong charge."""
        assert usage_from_mapping(usage) is None


# --------------------------------------------------------------------------- check_usage

BOUND = UsageBound(prompt=1_000, completion=500)


class TestCheckUsage:
    @pytest.mark.parametrize(
        ("usage", "expected"),
        [
            pytest.param(None, Usage(0, 0, 0), id="no-usage"),
            pytest.param(Usage(10, 5, 15), Usage(10, 5, 15), id="consistent"),
            pytest.param(Usage(10, 5, 3), Usage(10, 5, 15), id="total-below-parts-raised"),
            pytest.param(Usage(10, 5, 40), Usage(10, 5, 40), id="total-above-parts-kept"),
            pytest.param(Usage(10, 5, 15, reasoning_tokens=9), Usage(10, 9, 19, 9), id="reasoning-above-completion"),
            pytest.param(Usage(10, 5, 15, cached_tokens=30), Usage(30, 5, 35, 0, 30), id="cached-above-prompt"),
            pytest.param(Usage(1_000, 500, 1_500), Usage(1_000, 500, 1_500), id="exactly-the-bound"),
        ],
    )
    def test_believed(self, usage: Usage | None, expected: Usage) -> None:
        """Plausible usage is charged, its inconsistent parts resolved upward (never downward)."""
        checked = check_usage(usage, BOUND)
        assert checked.anomaly is None
        assert checked.usage == (None if usage is None else expected)

    @pytest.mark.parametrize(
        ("usage", "named"),
        [
            pytest.param(Usage(1_001, 0, 1_001), "prompt_tokens", id="prompt-over-bound"),
            pytest.param(Usage(0, 501, 501), "completion_tokens", id="completion-over-bound"),
            pytest.param(Usage(0, 0, 1_501), "total_tokens", id="total-over-bound"),
            pytest.param(Usage(10, 5, 2**63), "total_tokens", id="wraps-int64"),
            pytest.param(Usage(10, 5, 2**53), "total_tokens", id="beyond-exact-doubles"),
            pytest.param(Usage(10, 5, 15, reasoning_tokens=2**64), "reasoning_tokens", id="huge-detail"),
            pytest.param(Usage(-1, 5, 4), "prompt_tokens", id="negative"),
            pytest.param(Usage(1.5, 5, 15), "prompt_tokens", id="float"),  # type: ignore[arg-type]
            pytest.param(Usage(True, 5, 15), "prompt_tokens", id="bool"),
            pytest.param(Usage(0, 400, 400, reasoning_tokens=600), "completion_tokens", id="reasoning-over-bound"),
        ],
    )
    def test_anomalies(self, usage: Usage, named: str) -> None:
        """Implausible usage is not charged (the hold is), and the anomaly names the count."""
        checked = check_usage(usage, BOUND)
        assert checked.usage is None
        assert checked.anomaly is not None and named in checked.anomaly

    def test_ceiling_without_a_bound(self) -> None:
        """With no request bound known, a count at the ceiling is still refused, one below it is not."""
        assert check_usage(Usage(0, 0, TOKEN_CEILING)).usage is None
        assert check_usage(Usage(0, 0, TOKEN_CEILING - 1)) == Checked(Usage(0, 0, TOKEN_CEILING - 1))

    @settings(max_examples=300, deadline=None)
    @given(
        st.builds(
            Usage,
            st.integers(0, 2**70),
            st.integers(0, 2**70),
            st.integers(0, 2**70),
            st.integers(0, 2**70),
            st.integers(0, 2**70),
        ),
        st.builds(UsageBound, st.integers(0, TOKEN_CEILING), st.integers(0, TOKEN_CEILING)),
    )
    def test_charged_usage_is_always_sane(self, usage: Usage, bound: UsageBound) -> None:
        """Whatever is reported, a charged usage is consistent, within its bound and below 2**53."""
        charged = check_usage(usage, bound).usage
        if charged is None:
            return
        assert charged.total_tokens >= charged.prompt_tokens + charged.completion_tokens
        assert charged.total_tokens >= usage.total_tokens
        assert charged.prompt_tokens <= bound.prompt and charged.completion_tokens <= bound.completion
        assert charged.total_tokens <= bound.prompt + bound.completion < 2**53


# --------------------------------------------------------------------------- usage_from_body

CHAT_BODY: dict[str, Any] = {
    "id": "0217abc",
    "object": "chat.completion",
    "model": "deepseek-v3-2-251201",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "你好", "reasoning_content": "…"},
            "finish_reason": "stop",
        }
    ],
    "usage": ARK_USAGE,
}


class TestUsageFromBody:
    @pytest.mark.parametrize(
        ("body", "expected"),
        [
            pytest.param(_json(CHAT_BODY), Usage(120, 350, 470, 300, 100), id="chat-bytes"),
            pytest.param(_json(CHAT_BODY).decode(), Usage(120, 350, 470, 300, 100), id="chat-str"),
            pytest.param(CHAT_BODY, Usage(120, 350, 470, 300, 100), id="chat-mapping"),
            pytest.param(
                b'\xef\xbb\xbf{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}',
                Usage(1, 1, 2),
                id="utf8-bom",
            ),
            pytest.param(
                {
                    "id": "resp_1",
                    "object": "response",
                    "status": "completed",
                    "output": [],
                    "usage": RESPONSES_USAGE,
                },
                Usage(50, 80, 130, 20, 10),
                id="responses",
            ),
            pytest.param(
                {
                    "object": "list",
                    "data": [{"object": "embedding", "embedding": [0.1], "index": 0}],
                    "usage": {"prompt_tokens": 9, "total_tokens": 9},
                },
                Usage(9, 0, 9),
                id="embeddings",
            ),
            pytest.param(
                {"choices": [{"index": 0, "message": {}, "usage": {"prompt_tokens": 4, "completion_tokens": 6}}]},
                Usage(4, 6, 10),
                id="moonshot-choices-usage",
            ),
            pytest.param(
                {
                    "choices": [{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 6},
                },
                Usage(4, 6, 10),
                id="top-level-beats-choices",
            ),
            pytest.param(
                {"type": "response.completed", "response": {"usage": RESPONSES_USAGE}},
                Usage(50, 80, 130, 20, 10),
                id="completed-event",
            ),
        ],
    )
    def test_shapes(self, body: bytes | str | Mapping[str, Any], expected: Usage) -> None:
        """Chat, responses, embeddings and Moonshot bodies yield their usage."""
        assert usage_from_body(body) == expected

    @pytest.mark.parametrize(
        "body",
        [
            pytest.param({**CHAT_BODY, "usage": None}, id="null-usage"),
            pytest.param({"choices": []}, id="no-usage"),
            pytest.param({"choices": [None]}, id="odd-choices"),
            pytest.param({"choices": "x", "response": 3}, id="wrong-containers"),
            pytest.param(b'{"error": {"code": "QuotaExceeded", "message": "quota"}}', id="error-body"),
            pytest.param(b"\x00\xffnot json at all", id="garbage-bytes"),
            pytest.param(b"", id="empty"),
            pytest.param(_json(CHAT_BODY)[:-5], id="truncated"),
            pytest.param(b"[1, 2]", id="json-list"),
            pytest.param(b"42", id="json-number"),
            pytest.param(b'"usage"', id="json-string"),
            pytest.param(b"null", id="json-null"),
            pytest.param(b"[" * 100_000, id="deep-nesting"),
            pytest.param(b'data: {"usage": {"prompt_tokens": 1}}\n\n', id="sse-is-not-json"),
        ],
    )
    def test_none(self, body: bytes | Mapping[str, Any]) -> None:
        """Bodies without a usable usage give None."""
        assert usage_from_body(body) is None

    @pytest.mark.parametrize("body", [123, None, object(), memoryview(b"{}")])
    def test_never_raises(self, body: Any) -> None:
        """Even a value of the wrong type gives None instead of an exception."""
        assert usage_from_body(body) is None


class TestModelOfBody:
    @pytest.mark.parametrize(
        ("body", "model"),
        [
            (b'{"model": "deepseek-v4-flash-260425", "usage": {}}', "deepseek-v4-flash-260425"),
            (b'{"response": {"model": "m-1"}}', "m-1"),
            (b'{"usage": {}}', None),
            (b"[1]", None),
            (b"not json", None),
        ],
    )
    def test_table(self, body: bytes, model: str | None) -> None:
        """The model a complete JSON answer names, or None; never raises."""
        assert model_of_body(body) == model


class TestEndpointUsage:
    def test_images_carry_their_count(self) -> None:
        """Seedream's usage: generated_images beside output and total tokens."""
        body = b'{"usage": {"generated_images": 2, "output_tokens": 8192, "total_tokens": 8192}}'
        assert usage_from_body(body) == Usage(0, 8192, 8192, images=2)

    def test_a_succeeded_video_task(self) -> None:
        """A task GET once succeeded: completion_tokens and total_tokens, no prompt."""
        body = b'{"id": "cgt-1", "status": "succeeded", "usage": {"completion_tokens": 48600, "total_tokens": 48600}}'
        assert usage_from_body(body) == Usage(0, 48600, 48600)

    def test_bot_plugin_calls_are_kept(self) -> None:
        """bot_usage.action_usage becomes (plugin, calls) pairs; zero calls are dropped."""
        body = {
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            "bot_usage": {
                "action_usage": [{"name": "web_search", "search_count": 2}, {"name": "link", "search_count": 0}]
            },
        }
        assert usage_from_body(body) == Usage(10, 5, 15, actions=(("web_search", 2),))

    def test_bot_model_calls_beyond_the_main_usage_are_billed(self) -> None:
        """When the bot's model_usage adds up to more than usage, the sum is what was spent."""
        body = {
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            "bot_usage": {
                "model_usage": [
                    {"name": "main", "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                    {"name": "summary", "prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
                ]
            },
        }
        assert usage_from_body(body) == Usage(110, 25, 135)

    def test_malformed_bot_usage_adds_nothing(self) -> None:
        """A bot_usage of the wrong shape leaves the usage as it was."""
        body = {"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "bot_usage": {"action_usage": "x"}}
        assert usage_from_body(body) == Usage(1, 1, 2)

    def test_a_bad_image_count_makes_the_usage_unusable(self) -> None:
        """generated_images that is no count is as untrustworthy as a bad token count."""
        assert usage_from_body(b'{"usage": {"generated_images": -1, "output_tokens": 5}}') is None
