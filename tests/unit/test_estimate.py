from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotawrap.core.estimate import (
    Estimate,
    EstimateSettings,
    Kind,
    bounded,
    bounded_output,
    estimate_request,
    output_allowance,
    thinking_disabled,
    usage_bound,
)
from quotawrap.core.tokens import count_tokens
from quotawrap.core.usage import MODEL_MAX_OUTPUT, MODEL_WINDOW, UsageBound

DEFAULTS = EstimateSettings()
OVERHEAD = DEFAULTS.per_message_overhead
PRIMING = DEFAULTS.reply_priming
IMAGE = DEFAULTS.image_tokens


def by_chars(model: str, text: str) -> int:
    """A stand-in tokenizer, one token per character, so expected sums can be written by hand."""
    return len(text)


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "doubao-seed", "messages": list(messages), **extra}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


class TestSeedThinkingCase:
    """Seed §7.6: "彩虹有几种颜色", max_tokens 16, reserved 34, billed 167 (answer ~16 + reasoning)."""

    BODY = chat(user("彩虹有几种颜色"), max_tokens=16)

    def test_input_matches_the_seed(self) -> None:
        """cl100k plus one message's overhead and reply priming gives the seed's 18 input tokens."""
        assert estimate_request("chat", self.BODY).input_tokens == 18

    def test_old_reserve_was_34(self) -> None:
        """The pre-fix formula, input + declared max_tokens, reproduces the seed's 34."""
        assert estimate_request("chat", self.BODY).input_tokens + self.BODY["max_tokens"] == 34

    @pytest.mark.parametrize("model", ["doubao-seed", "deepseek-v4-flash"])
    def test_new_reserve_covers_actual_167(self, model: str) -> None:
        """With the thinking floor the reserve covers the 167 tokens actually billed."""
        estimate = estimate_request("chat", {**self.BODY, "model": model})
        assert estimate.output_allowance == 4096
        assert estimate.total >= 167


class TestSeedLargeInput:
    """Seed §7.6: one 176k request at usage 1.8M broke the 2M cap; a 200k input must now be blocked."""

    USAGE, CAP, OLD_RESERVE = 1_800_000, 2_000_000, 50_000

    def test_200k_input_blocked_at_1_8m(self) -> None:
        """A 200k-token input with max_tokens unset reserves >= 200k + 4096 and no longer fits."""
        estimate = estimate_request("chat", chat(user("x" * 200_000)), count=by_chars)
        assert estimate.total >= 200_000 + 4096
        assert self.USAGE + estimate.total > self.CAP
        assert self.USAGE + self.OLD_RESERVE < self.CAP  # what the old blind reserve let through

    @pytest.mark.parametrize("model", ["doubao-seed", "deepseek-v4-flash"])
    def test_real_chinese_input_counted_in_full(self, model: str) -> None:
        """A real ~200k-token Chinese prompt is counted by the real tokenizer, not capped or sampled."""
        text = "天空中出现了一道美丽的彩虹，它有七种颜色。" * 20_000
        tokens = count_tokens(model, text)
        estimate = estimate_request("chat", chat(user(text), model=model))
        assert estimate.input_tokens == tokens + OVERHEAD + PRIMING
        assert estimate.total >= tokens + 4096


class TestOutputAllowance:
    @pytest.mark.parametrize(
        ("kind", "body", "expected"),
        [
            ("chat", {}, 4096),
            ("chat", {"max_tokens": 16}, 4096),
            ("chat", {"max_tokens": 8000}, 8000),
            ("chat", {"max_completion_tokens": 500}, 500),
            ("chat", {"max_completion_tokens": 500, "max_tokens": 8000}, 500),
            ("chat", {"max_completion_tokens": 100, "thinking": {"type": "disabled"}}, 100),
            ("chat", {"max_tokens": 16, "thinking": {"type": "disabled"}}, 16),
            ("chat", {"thinking": {"type": "disabled"}}, 4096),
            ("chat", {"max_tokens": 16, "thinking": {"type": "enabled"}}, 4096),
            ("chat", {"max_tokens": 16, "thinking": {"type": "auto"}}, 4096),
            ("chat", {"max_tokens": 0}, 4096),
            ("chat", {"max_tokens": None, "max_completion_tokens": None}, 4096),
            ("chat", {"max_tokens": 16.0, "thinking": {"type": "disabled"}}, 16),
            ("chat", {"max_tokens": 8000, "n": 3}, 24_000),
            ("chat", {"max_completion_tokens": 500, "n": 2}, 1000),
            ("completions", {"max_tokens": 8000, "n": 1, "best_of": 2}, 16_000),
            ("completions", {"max_tokens": 16, "thinking": {"type": "disabled"}}, 16),
            ("responses", {"max_output_tokens": 300}, 300),
            ("responses", {}, 4096),
            ("responses", {"max_tokens": 16, "max_output_tokens": 300}, 300),
            ("embeddings", {"max_tokens": 100}, 0),
        ],
    )
    def test_table(self, kind: Kind, body: dict[str, Any], expected: int) -> None:
        """The output bound each request shape can be billed for."""
        assert output_allowance(kind, body, DEFAULTS) == expected

    def test_floor_and_default_are_settings(self) -> None:
        """A lower default with the 4096 floor: thinking keeps the floor, disabled thinking the default."""
        custom = EstimateSettings(default_max_tokens=1000, thinking_floor=4096)
        assert output_allowance("chat", {}, custom) == 4096
        assert output_allowance("chat", {"thinking": {"type": "disabled"}}, custom) == 1000
        assert output_allowance("responses", {"thinking": {"type": "disabled"}}, custom) == 1000
        assert output_allowance("chat", {}, EstimateSettings(thinking_floor=0, default_max_tokens=100)) == 100


class TestThinkingDisabled:
    @pytest.mark.parametrize(
        ("body", "expected"),
        [
            ({"thinking": {"type": "disabled"}}, True),
            ({"thinking": {"type": "enabled"}}, False),
            ({"thinking": {"type": "auto"}}, False),
            ({"thinking": "disabled"}, False),
            ({"thinking": None}, False),
            ({}, False),
        ],
    )
    def test_only_explicit_disabled_counts(self, body: dict[str, Any], expected: bool) -> None:
        """Only thinking {"type": "disabled"} removes the floor; anything unclear may think."""
        assert thinking_disabled(body) is expected


class TestEstimate:
    def test_total_is_input_plus_output(self) -> None:
        """total is the reservation: input tokens plus output allowance."""
        assert Estimate(input_tokens=18, output_allowance=4096).total == 4114


class TestEstimateSettings:
    @pytest.mark.parametrize("field", ["thinking_floor", "default_max_tokens", "image_tokens"])
    @pytest.mark.parametrize("value", [-1, 1.5, True, "10"])
    def test_rejects_bad_values(self, field: str, value: object) -> None:
        """Settings are non-negative integers; anything else is a ValueError."""
        with pytest.raises(ValueError, match=field):
            EstimateSettings(**{field: value})  # type: ignore[arg-type]


class TestChatInput:
    def test_string_content_and_overheads(self) -> None:
        """Each message adds its text plus per-message overhead; the reply adds priming once."""
        body = chat({"role": "system", "content": "abc"}, user("hello"))
        assert estimate_request("chat", body, count=by_chars).input_tokens == 3 + 5 + 2 * OVERHEAD + PRIMING

    def test_text_parts(self) -> None:
        """Every text part of a list content is counted."""
        body = chat(user([{"type": "text", "text": "abc"}, {"type": "text", "text": "de"}]))
        assert estimate_request("chat", body, count=by_chars).input_tokens == 5 + OVERHEAD + PRIMING

    def test_image_parts_are_flat(self) -> None:
        """Each image counts image_tokens, however long its (data) URL."""
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 50_000}}
        body = chat(user([{"type": "text", "text": "abc"}, image, image]))
        assert estimate_request("chat", body, count=by_chars).input_tokens == 3 + 2 * IMAGE + OVERHEAD + PRIMING

    def test_image_tokens_setting(self) -> None:
        """The per-image figure comes from the settings."""
        body = chat(user([{"type": "image_url", "image_url": {"url": "u"}}]))
        custom = EstimateSettings(image_tokens=100)
        assert estimate_request("chat", body, custom, count=by_chars).input_tokens == 100 + OVERHEAD + PRIMING

    @pytest.mark.parametrize(
        "part",
        [
            {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "file", "file": {"file_id": "f"}},
            {"type": "something_new"},
        ],
    )
    def test_other_parts_are_at_least_an_image(self, part: dict[str, Any]) -> None:
        """Video, audio, file and unknown parts cost at least image_tokens."""
        body = chat(user([part]))
        assert estimate_request("chat", body, count=by_chars).input_tokens >= IMAGE + OVERHEAD + PRIMING

    def test_large_other_part_counts_its_json(self) -> None:
        """An inline video larger than an image counts the tokens of its JSON form."""
        part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + "B" * 10_000}}
        body = chat(user([part]))
        expected = len(json.dumps(part, ensure_ascii=False)) + OVERHEAD + PRIMING
        assert estimate_request("chat", body, count=by_chars).input_tokens == expected

    def test_assistant_reasoning_and_tool_calls(self) -> None:
        """reasoning_content and each tool call's name and arguments are counted; null content is 0."""
        assistant = {
            "role": "assistant",
            "content": None,
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a":1}'}},
                {"id": "c2", "type": "function", "function": {"name": "put", "arguments": "{}"}},
            ],
        }
        tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}
        body = chat(assistant, tool)
        expected = 5 + 3 + 7 + 3 + 2 + 2 + 2 * OVERHEAD + PRIMING
        assert estimate_request("chat", body, count=by_chars).input_tokens == expected

    def test_legacy_function_call_and_decoded_arguments(self) -> None:
        """A legacy function_call is counted, and arguments given as an object count as JSON."""
        assistant = {"role": "assistant", "function_call": {"name": "f", "arguments": {"x": 1}}}
        expected = 1 + len('{"x": 1}') + OVERHEAD + PRIMING
        assert estimate_request("chat", chat(assistant), count=by_chars).input_tokens == expected

    def test_name_fields(self) -> None:
        """A message's name field is counted."""
        body = chat({"role": "user", "name": "alice", "content": "hi"})
        assert estimate_request("chat", body, count=by_chars).input_tokens == 5 + 2 + OVERHEAD + PRIMING

    @pytest.mark.parametrize("field", ["tools", "functions", "response_format"])
    def test_definitions_count_as_json(self, field: str) -> None:
        """tools / functions / response_format count as their JSON text (non-ASCII kept as is)."""
        definition = [{"type": "function", "function": {"name": "查询", "parameters": {"type": "object"}}}]
        body = chat(user("hi"), **{field: definition})
        expected = 2 + len(json.dumps(definition, ensure_ascii=False)) + OVERHEAD + PRIMING
        assert estimate_request("chat", body, count=by_chars).input_tokens == expected

    def test_counter_gets_the_model(self) -> None:
        """The request's model is what the counter is asked to tokenize for."""
        seen: set[str] = set()

        def spy(model: str, text: str) -> int:
            seen.add(model)
            return len(text)

        estimate_request("chat", chat(user("hi"), model="deepseek-v3"), count=spy)
        assert seen == {"deepseek-v3"}

    def test_default_counter_is_the_model_tokenizer(self) -> None:
        """Without a count argument the real tokenizer of the model is used."""
        text = "彩虹有几种颜色"
        for model in ("deepseek-chat", "doubao-seed"):
            estimate = estimate_request("chat", chat(user(text), model=model))
            assert estimate.input_tokens == count_tokens(model, text) + OVERHEAD + PRIMING


class TestResponsesInput:
    def test_string_input_and_instructions(self) -> None:
        """A string input and the instructions each count as one message."""
        body = {"model": "m", "input": "hello", "instructions": "be brief"}
        assert estimate_request("responses", body, count=by_chars).input_tokens == 5 + 8 + 2 * OVERHEAD + PRIMING

    def test_message_items_with_parts(self) -> None:
        """Messages (typed or not) with input_text, output_text and input_image parts."""
        body = {
            "model": "m",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "abc"},
                        {"type": "input_image", "image_url": "u"},
                    ],
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "de"}]},
                {"role": "user", "content": "fgh"},
            ],
        }
        expected = 3 + IMAGE + 2 + 3 + 3 * OVERHEAD + PRIMING
        assert estimate_request("responses", body, count=by_chars).input_tokens == expected

    def test_function_call_items(self) -> None:
        """function_call name/arguments and function_call_output output are counted."""
        body = {
            "model": "m",
            "input": [
                {"type": "function_call", "call_id": "c", "name": "get", "arguments": '{"a":1}'},
                {"type": "function_call_output", "call_id": "c", "output": "42"},
            ],
        }
        expected = 3 + 7 + 2 + 2 * OVERHEAD + PRIMING
        assert estimate_request("responses", body, count=by_chars).input_tokens == expected

    def test_reasoning_and_unknown_items(self) -> None:
        """Reasoning summaries count their text; an unknown item costs at least an image."""
        body = {
            "model": "m",
            "input": [
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "why"}]},
                {"type": "item_reference", "id": "msg_1"},
            ],
        }
        expected = 3 + IMAGE + 2 * OVERHEAD + PRIMING
        assert estimate_request("responses", body, count=by_chars).input_tokens == expected

    @pytest.mark.parametrize("field", ["tools", "text"])
    def test_tools_and_text_format_count_as_json(self, field: str) -> None:
        """Tool definitions and the structured-output format count as JSON."""
        value: Any = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
        body = {"model": "m", "input": "hi", field: value}
        expected = 2 + len(json.dumps(value)) + OVERHEAD + PRIMING
        assert estimate_request("responses", body, count=by_chars).input_tokens == expected


class TestEmbeddingsInput:
    @pytest.mark.parametrize(
        ("given", "expected"),
        [
            ("hello", 5),
            (["hello", "abc"], 8),
            ([1, 2, 3], 3),
            ([[1, 2, 3], [4, 5]], 5),
            ([{"type": "text", "text": "abc"}, {"type": "image_url", "image_url": {"url": "u"}}], 3 + IMAGE),
        ],
    )
    def test_input_shapes(self, given: Any, expected: int) -> None:
        """Strings, token ids, token-id lists and multimodal parts; no chat overhead, no output."""
        estimate = estimate_request("embeddings", {"model": "m", "input": given}, count=by_chars)
        assert estimate == Estimate(input_tokens=expected, output_allowance=0)


class TestCompletionsInput:
    @pytest.mark.parametrize(
        ("body", "expected"),
        [
            ({"prompt": "hello"}, 5),
            ({"prompt": ["hello", "abc"]}, 8),
            ({"prompt": [1, 2, 3, 4]}, 4),
            ({"prompt": [[1, 2], [3]]}, 3),
            ({"prompt": "hello", "suffix": "end"}, 8),
        ],
    )
    def test_prompt_shapes(self, body: dict[str, Any], expected: int) -> None:
        """A prompt string, list of strings, token ids or token-id lists, plus any suffix."""
        assert estimate_request("completions", {"model": "m", **body}, count=by_chars).input_tokens == expected


class TestMalformed:
    @pytest.mark.parametrize(
        ("kind", "body", "fragment"),
        [
            ("chat", ["not", "a", "dict"], "JSON object"),
            ("chat", {"model": "m"}, "messages"),
            ("chat", {"messages": "hello"}, "'messages' must be a list"),
            ("chat", {"messages": {"role": "user"}}, "'messages' must be a list"),
            ("chat", {"messages": 5}, "'messages' must be a list"),
            ("chat", {"messages": ["hello"]}, r"messages\[0\] must be a JSON object"),
            ("chat", {"messages": [{"content": 5}]}, r"messages\[0\].content"),
            ("chat", {"messages": [{"content": [5]}]}, r"messages\[0\].content\[0\]"),
            ("chat", {"messages": [{"content": [{"type": "text", "text": 5}]}]}, r"content\[0\].text"),
            ("chat", {"messages": [{"content": "x", "name": 5}]}, "name"),
            ("chat", {"messages": [{"tool_calls": "x"}]}, "tool_calls"),
            ("chat", {"messages": [{"tool_calls": [5]}]}, r"tool_calls\[0\]"),
            ("chat", {"messages": [], "tools": [object()]}, "tools"),
            ("chat", {"messages": [], "max_tokens": "16"}, "max_tokens"),
            ("chat", {"messages": [], "max_tokens": -1}, "max_tokens"),
            ("chat", {"messages": [], "max_completion_tokens": True}, "max_completion_tokens"),
            ("chat", {"messages": [], "n": "2"}, "'n'"),
            ("chat", {"messages": [], "model": 5}, "model"),
            ("responses", {"input": {"role": "user"}}, "'input'"),
            ("responses", {"input": [5]}, r"input\[0\]"),
            ("responses", {"input": "hi", "instructions": ["x"]}, "instructions"),
            ("responses", {"input": "hi", "max_output_tokens": 1.5}, "max_output_tokens"),
            ("embeddings", {"input": 5}, "'input'"),
            ("embeddings", {"input": [1, "a"]}, r"input'\[0\]"),
            ("embeddings", {"input": [[1, "a"]]}, "token ids"),
            ("completions", {"prompt": None}, "prompt"),
            ("audio", {"prompt": "x"}, "unknown request kind"),
            ("images", {"prompt": "x", "size": 1024}, "size"),
            ("video", {"content": [], "duration": "5"}, "duration"),
        ],
    )
    def test_value_error_with_clear_message(self, kind: Any, body: Any, fragment: str) -> None:
        """Bad shapes raise ValueError naming the field, never a bare TypeError or KeyError."""
        with pytest.raises(ValueError, match=fragment):
            estimate_request(kind, body, count=by_chars)


# -- properties ---------------------------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40) | st.sampled_from(
    ["彩虹有几种颜色", "床前明月光，疑是地上霜。", "hello world", ""]
)
PART = st.one_of(
    st.builds(lambda text: {"type": "text", "text": text}, TEXT),
    st.just({"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}),
)
CONTENT = TEXT | st.lists(PART, max_size=4)
MESSAGE = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["system", "user", "assistant"]),
    CONTENT,
)
MODEL = st.sampled_from(["deepseek-v4-flash", "doubao-seed-1-6"])


def texts_of(messages: list[dict[str, Any]]) -> list[str]:
    found: list[str] = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            found.append(content)
        else:
            found.extend(part["text"] for part in content if part["type"] == "text")
    return found


class TestProperties:
    @settings(max_examples=150, deadline=None)
    @given(model=MODEL, messages=st.lists(MESSAGE, max_size=6), extra=MESSAGE, position=st.integers(0, 6))
    def test_adding_a_message_never_lowers_the_estimate(
        self, model: str, messages: list[dict[str, Any]], extra: dict[str, Any], position: int
    ) -> None:
        """Inserting a message anywhere raises input by at least the per-message overhead."""
        before = estimate_request("chat", {"model": model, "messages": messages})
        grown = [*messages[:position], extra, *messages[position:]]
        after = estimate_request("chat", {"model": model, "messages": grown})
        assert after.input_tokens >= before.input_tokens + OVERHEAD
        assert after.total > before.total

    @settings(max_examples=150, deadline=None)
    @given(model=MODEL, messages=st.lists(MESSAGE, max_size=6), max_tokens=st.none() | st.integers(1, 10_000))
    def test_never_below_the_text_tokens(
        self, model: str, messages: list[dict[str, Any]], max_tokens: int | None
    ) -> None:
        """Input is at least the tokens of all its texts, and the total adds at least the thinking floor."""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens}
        estimate = estimate_request("chat", body)
        text_tokens = sum(count_tokens(model, text) for text in texts_of(messages))
        assert estimate.input_tokens >= text_tokens
        assert estimate.total >= text_tokens + max(max_tokens or 0, DEFAULTS.thinking_floor)


class TestHostileNumbers:
    @pytest.mark.parametrize(
        "extra",
        [
            pytest.param({"max_tokens": 1e30}, id="max_tokens-1e30"),
            pytest.param({"max_completion_tokens": 2**62}, id="max_completion_tokens-2^62"),
            pytest.param({"n": 1e19}, id="n-1e19"),
            pytest.param({"max_tokens": 2**40}, id="max_tokens-at-the-ceiling"),
            pytest.param({"n": 2**30, "max_tokens": 2**20}, id="product-beyond-the-ceiling"),
        ],
    )
    def test_more_than_any_call_can_use_is_refused(self, extra: dict[str, Any]) -> None:
        """A count no call can use is a ValueError (a 400), never a number handed to a counter."""
        with pytest.raises(ValueError, match="more than any call can use"):
            estimate_request("chat", chat(user("hi"), **extra), count=by_chars)

    def test_large_but_possible_is_estimated(self) -> None:
        """A large request below the ceiling is estimated (the caps, not the estimate, refuse it)."""
        estimate = estimate_request("chat", chat(user("hi"), max_tokens=10**9, n=1000), count=by_chars)
        assert estimate.output_allowance == 10**12

    def test_deeply_nested_tool_schema_is_a_value_error(self) -> None:
        """A structure too deep to serialise is a ValueError naming the field, not a RecursionError."""
        deep: Any = []
        for _ in range(100_000):
            deep = [deep]
        with pytest.raises(ValueError, match="'tools'"):
            estimate_request("chat", chat(user("hi"), tools=deep), count=by_chars)

    def test_unhashable_part_type_is_an_unknown_part(self) -> None:
        """A part whose "type" is a list is estimated as an opaque part, not a TypeError."""
        part = {"type": ["text"], "text": "hello"}
        estimate = estimate_request("chat", chat(user([part])), count=by_chars)
        assert estimate.input_tokens >= IMAGE


class TestUsageBound:
    def test_bound_covers_the_estimate_generously(self) -> None:
        """The prompt bound is at least 4x the input or a whole context window; output per choice."""
        body = chat(user("x" * 1_000_000), max_completion_tokens=300_000, n=2)
        estimate = estimate_request("chat", body, count=by_chars)
        bound = usage_bound("chat", body, estimate)
        assert bound.prompt == 4 * estimate.input_tokens
        assert bound.completion == 600_000

    def test_small_request_still_allows_server_state_and_reasoning(self) -> None:
        """A short question may still read a context window and think up to a model's maximum."""
        body = chat(user("hi"), max_tokens=16, n=3)
        bound = usage_bound("chat", body, estimate_request("chat", body, count=by_chars))
        assert bound == UsageBound(prompt=MODEL_WINDOW, completion=3 * MODEL_MAX_OUTPUT)


class Recorder:
    """A stand-in tokenizer (one token per character) that remembers what it was asked to count."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, model: str, text: str) -> int:
        self.texts.append(text)
        return len(text)


class TestCheapAndEarly:
    def test_short_input_never_reaches_the_tokenizer(self) -> None:
        """Under exact_above the UTF-8 bound is the estimate and the tokenizer is never called."""
        recorder = Recorder()
        body = chat(user("彩虹有几种颜色"))
        estimate = estimate_request("chat", body, count=recorder, exact_above=1_000)
        assert recorder.texts == []
        assert estimate.input_tokens == len("彩虹有几种颜色".encode()) + OVERHEAD + PRIMING

    def test_input_over_the_share_is_counted_exactly(self) -> None:
        """Above exact_above the real tokenizer counts (the UTF-8 bound would waste too much)."""
        recorder = Recorder()
        text = "彩虹" * 600
        estimate = estimate_request("chat", chat(user(text)), count=recorder, exact_above=1_000)
        assert recorder.texts == [text]
        assert estimate.input_tokens == len(text) + OVERHEAD + PRIMING

    def test_counting_stops_once_over_every_limit(self) -> None:
        """With stop_above, later texts are not counted once the input already exceeds it."""
        recorder = Recorder()
        body = chat(*(user("x" * 100) for _ in range(50)))
        estimate = estimate_request("chat", body, count=recorder, stop_above=250)
        assert len(recorder.texts) == 3
        assert estimate.input_tokens > 250

    def test_long_text_stops_inside_itself(self) -> None:
        """The bundled counter stops inside one long text: the partial count passes the limit only just."""
        text = "word " * 2_000_000  # 10 MB, about 2M tokens
        estimate = estimate_request("chat", chat(user(text)), stop_above=50_000)
        assert 50_000 < estimate.input_tokens < 50_000 + 2 * 65_536


_CHOICE_VALUES = st.one_of(
    st.none(), st.integers(-2, 9), st.sampled_from([2.0, 2.5, True, "3", 10**12]), st.integers(0, 3).map(float)
)


@settings(max_examples=300)
@given(
    kind=st.sampled_from(["chat", "responses", "embeddings"]),
    n=_CHOICE_VALUES,
    max_tokens=st.one_of(st.none(), st.integers(1, 9000)),
    allowance=st.one_of(st.integers(-1, 70_000), st.sampled_from([10**12, True, 3.0])),
)
def test_bounded_output_is_the_allowance_of_the_bounded_body(
    kind: str, n: object, max_tokens: object, allowance: object
) -> None:
    """``bounded_output`` answers what ``output_allowance`` answers of the body ``bounded`` makes, or refuses
    (ValueError) where building and judging that body would: the planner asks it without building the body."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if n is not None:
        body["n"] = n
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    try:
        expected: object = output_allowance(kind, bounded(kind, body, allowance), EstimateSettings())  # type: ignore[arg-type]
        if not (isinstance(allowance, int) and not isinstance(allowance, bool) and allowance >= 1):
            expected = "refused"  # a bound below 1 (or not a count) is never set: the planner sends at least 1
    except ValueError:
        expected = "refused"
    try:
        got: object = bounded_output(kind, body, allowance)  # type: ignore[arg-type]
    except ValueError:
        got = "refused"
    assert got == expected
