"""Tests for quotawrap.core.sse: event streams read in any split, and the injected usage-only chunk hidden."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotawrap.core.sse import SSEUsageReader, _worth_parsing, is_event_stream
from quotawrap.core.usage import (
    Usage,
)

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


def _event(obj: Any, *, eol: bytes = b"\n", name: str | None = None) -> bytes:
    head = b"event: " + name.encode() + eol if name else b""
    data = obj if isinstance(obj, bytes) else _json(obj)
    return head + b"data: " + data + eol + eol


def _delta(text: str, usage: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": "0217x",
        "object": "chat.completion.chunk",
        "model": "doubao-seed-1-6",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        "usage": usage,
    }


def _usage_chunk(prompt: int = 11, completion: int = 7) -> dict[str, Any]:
    return {
        "id": "0217x",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def _read(stream: bytes, pieces: Iterable[int] | None = None, *, hide: bool = False) -> tuple[bytes, SSEUsageReader]:
    """Feed ``stream`` cut at ``pieces`` (offsets) and return everything handed on, plus the reader."""
    reader = SSEUsageReader(hide_usage_only_chunk=hide)
    cuts = [0, *sorted(set(pieces or ())), len(stream)]
    out = [reader.feed(stream[a:b]) for a, b in itertools.pairwise(cuts)]
    out.append(reader.finish())
    return b"".join(out), reader


def _every_size(stream: bytes, size: int) -> list[int]:
    return list(range(size, len(stream), size))


# --------------------------------------------------------------------------- is_event_stream


class TestIsEventStream:
    @pytest.mark.parametrize(
        ("content_type", "expected"),
        [
            ("text/event-stream", True),
            ("text/event-stream; charset=utf-8", True),
            (" Text/Event-Stream ;charset=UTF-8", True),
            ("application/json", False),
            ("application/json; x=text/event-stream", False),
            ("", False),
            (None, False),
        ],
    )
    def test_table(self, content_type: str | None, expected: bool) -> None:
        """Only the text/event-stream media type counts, parameters and case aside."""
        assert is_event_stream(content_type) is expected


# --------------------------------------------------------------------------- SSE reading

OPENAI_STREAM = (
    _event(_delta("Hel"))
    + _event(_delta("lo"))
    + _event({**_delta(""), "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    + _event(_usage_chunk(11, 7))
    + b"data: [DONE]\n\n"
)
USAGE_EVENT = _event(_usage_chunk(11, 7))


class TestSSEUsageReader:
    def test_openai_include_usage(self) -> None:
        """The final usage-only chunk is read and [DONE] marks the stream done."""
        out, reader = _read(OPENAI_STREAM, _every_size(OPENAI_STREAM, 7))
        assert out == OPENAI_STREAM
        assert reader.usage == Usage(11, 7, 18)
        assert reader.done is True
        assert reader.error is None
        assert reader.events == 5

    def test_feed_returns_input_object(self) -> None:
        """Without hiding, feed hands back the very object it was given (zero-copy hot path)."""
        reader = SSEUsageReader()
        pieces = [OPENAI_STREAM[:50], OPENAI_STREAM[50:51], OPENAI_STREAM[51:]]
        assert all(reader.feed(piece) is piece for piece in pieces)
        assert reader.finish() == b""

    def test_chunk_include_usage_takes_last(self) -> None:
        """Ark chunk_include_usage reports cumulative usage on every chunk; the last one wins."""
        stream = b"".join(
            _event(_delta(str(i), {"prompt_tokens": 20, "completion_tokens": i, "total_tokens": 20 + i}))
            for i in range(1, 6)
        )
        stream += b"data: [DONE]\n\n"
        _, reader = _read(stream, _every_size(stream, 13))
        assert reader.usage == Usage(20, 5, 25)

    def test_an_earlier_larger_report_wins(self) -> None:
        """Several usage reports: a later, smaller one never lowers what the stream is charged."""
        stream = _event(_delta("a", {"prompt_tokens": 20, "completion_tokens": 900, "total_tokens": 920}))
        stream += _event(_usage_chunk(20, 3)) + b"data: [DONE]\n\n"
        _, reader = _read(stream, _every_size(stream, 7))
        assert reader.usage == Usage(20, 900, 920)

    def test_responses_stream(self) -> None:
        """A Responses stream ends with response.completed whose response.usage is read."""
        response = {
            "id": "resp_1",
            "object": "response",
            "status": "in_progress",
            "usage": None,
            "error": None,
        }
        stream = (
            _event({"type": "response.created", "response": response}, name="response.created")
            + _event({"type": "response.output_text.delta", "delta": "hi"}, name="response.output_text.delta")
            + _event(
                {
                    "type": "response.completed",
                    "response": {**response, "status": "completed", "usage": RESPONSES_USAGE},
                },
                name="response.completed",
            )
        )
        _, reader = _read(stream, _every_size(stream, 5))
        assert reader.usage == Usage(50, 80, 130, 20, 10)
        assert reader.done is True
        assert reader.error is None
        assert reader.events == 3

    def test_the_model_the_answer_names(self) -> None:
        """The model of the chunks it parses (the usage chunk names it; a Responses event, in its response)."""
        stream = _event(_delta("hi")) + _event({**_usage_chunk(11, 7), "model": "Deepseek-V4-Flash-260425"})
        _, reader = _read(stream + b"data: [DONE]\n\n", _every_size(stream, 9))
        assert reader.model == "Deepseek-V4-Flash-260425"
        completed = {"type": "response.completed", "response": {"model": "m-1", "usage": RESPONSES_USAGE}}
        _, reader = _read(_event(completed, name="response.completed"))
        assert reader.model == "m-1"
        _, reader = _read(_event(_delta("a delta is not parsed")))
        assert reader.model is None

    def test_responses_done_from_type_alone(self) -> None:
        """A terminal Responses event is recognised by its type even without an event: line."""
        _, reader = _read(_event({"type": "response.incomplete", "response": {"usage": None}}))
        assert reader.done is True
        assert reader.usage is None

    def test_responses_failed(self) -> None:
        """response.failed ends the stream and reports its error."""
        failed = {"type": "response.failed", "response": {"error": {"code": "server_error"}, "usage": None}}
        _, reader = _read(_event(failed, name="response.failed"))
        assert reader.done is True
        assert reader.error == failed

    def test_cut_before_usage(self) -> None:
        """A stream cut before its usage chunk leaves usage None and done False."""
        cut = OPENAI_STREAM[: OPENAI_STREAM.index(USAGE_EVENT) + 20]
        _, reader = _read(cut, _every_size(cut, 9))
        assert reader.usage is None
        assert reader.done is False

    def test_error_event(self) -> None:
        """An {"error": ...} payload is kept as the stream's error."""
        error = {"error": {"code": "ServerOverloaded", "message": "busy", "type": "TooManyRequests"}}
        stream = _event(_delta("a")) + _event(error)
        _, reader = _read(stream)
        assert reader.error == error
        assert reader.done is False
        assert reader.usage is None

    def test_named_error_event_with_text(self) -> None:
        """An `event: error` whose data is not JSON still records an error."""
        _, reader = _read(b"event: error\ndata: upstream died\n\n")
        assert reader.error == {"error": "upstream died"}

    def test_moonshot_choices_usage(self) -> None:
        """Usage inside choices[0] (Moonshot) is the fallback."""
        last = {
            "choices": [
                {
                    "index": 0,
                    "delta": {},
                    "finish_reason": "stop",
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4},
                }
            ]
        }
        _, reader = _read(_event(_delta("x")) + _event(last) + b"data: [DONE]\n\n")
        assert reader.usage == Usage(3, 4, 7)

    @pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
    def test_line_endings(self, eol: bytes) -> None:
        """LF, CRLF and CR streams give the same result for every piece size."""
        stream = OPENAI_STREAM.replace(b"\n", eol)
        for size in (1, 2, 3, 64):
            out, reader = _read(stream, _every_size(stream, size))
            assert out == stream
            assert (reader.usage, reader.done, reader.events) == (Usage(11, 7, 18), True, 5)

    def test_comments_fields_and_multiline_data(self) -> None:
        """Comments and other fields are ignored; multi-line data is joined with newlines."""
        stream = (
            b": keep-alive\n\n"
            b"id: 7\nretry: 100\n: note\nevent: message\n"
            b'data: {"choices": [],\ndata:  "usage": {"prompt_tokens": 2,\ndata:"completion_tokens": 5}}\n\n'
            b"data\n\n"
        )
        _, reader = _read(stream, [3, 40, 41])
        assert reader.usage == Usage(2, 5, 7)
        assert reader.events == 2

    def test_non_json_data(self) -> None:
        """Non-JSON data is counted as an event and otherwise ignored."""
        _, reader = _read(b"data: usage is {broken\n\ndata: [1,2]\n\n" + USAGE_EVENT)
        assert reader.events == 3
        assert reader.usage == Usage(11, 7, 18)

    def test_final_event_without_blank_line(self) -> None:
        """A last event lacking its blank line is read by finish()."""
        stream = _event(_delta("a")) + b"data: " + _json(_usage_chunk(1, 2))
        reader = SSEUsageReader()
        reader.feed(stream)
        assert reader.usage is None
        assert reader.finish() == b""
        assert reader.usage == Usage(1, 2, 3)

    def test_done_without_trailing_newline(self) -> None:
        """`data: [DONE]` at the very end, without a newline, still marks the stream done."""
        _, reader = _read(_event(_delta("a")) + b"data: [DONE]")
        assert reader.done is True

    def test_very_long_event(self) -> None:
        """A multi-megabyte response.completed line fed in 1 KiB pieces is parsed once complete."""
        text = "长" * 1_500_000
        completed = {
            "type": "response.completed",
            "response": {"output": [{"content": [{"text": text}]}], "usage": RESPONSES_USAGE},
        }
        stream = _event(completed, name="response.completed")
        out, reader = _read(stream, _every_size(stream, 1024))
        assert out == stream
        assert reader.usage == Usage(50, 80, 130, 20, 10)

    @pytest.mark.parametrize("size", [100, 10_000], ids=["split-line", "whole-line"])
    def test_oversized_event_is_skipped(self, size: int) -> None:
        """An event beyond max_event_bytes is counted but not parsed, and reading goes on."""
        reader = SSEUsageReader()
        reader.max_event_bytes = 1000
        huge = _event({"usage": {"prompt_tokens": 1}, "pad": "x" * 5000})
        for piece in (huge[i : i + size] for i in range(0, len(huge), size)):
            reader.feed(piece)
        assert reader.usage is None
        reader.feed(USAGE_EVENT)
        reader.finish()
        assert reader.usage == Usage(11, 7, 18)
        assert reader.events == 2

    @pytest.mark.parametrize(
        ("payload", "parse"),
        [
            (b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n', False),
            (b'data: {"choices":[{"delta":{"content":"hi"}}],"usage" :  null}\n\n', False),
            (b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', False),
            (b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n', True),
            # the last "usage" is null, an earlier one is not (or is a word of the text): parse
            (b'data: {"usage":{"prompt_tokens":1},"x":{"usage":null}}\n\n', True),
            (b'data: {"choices":[{"delta":{"content":"usage"}}],"usage":null}\n\n', True),
            (b'data: {"choices":[{"delta":{"content":"usage"}}],"usage":{"total_tokens":3}}\n\n', True),
            (b'data: {"usage":null,"choices":[{"delta":{"content":"hi"}}]}\n\n', False),
            (b'data: {"usage":"null-ish"}\n\n', True),
            (b'data: {"error":{"code":"x"}}\n\n', True),
            (b'data: {"type":"response.completed"}\n\n', True),
            (b'data: {"x":"usage"', True),  # cut short after the word: parse, never skip
        ],
    )
    def test_which_chunks_are_parsed(self, payload: bytes, parse: bool) -> None:
        """The hot path's byte test parses every chunk that may hold a usage, and skips the usage-null ones."""
        assert _worth_parsing(payload) is parse

    def test_null_usage_chunks_are_not_usage(self) -> None:
        """OpenAI's `"usage":null` on every chunk is not mistaken for a usage."""
        _, reader = _read(_event(_delta("a")) + _event(_delta("usage")))
        assert reader.usage is None
        assert reader.events == 2


# --------------------------------------------------------------------------- hiding

EXPECTED_HIDDEN = (
    b'data: {"id":"0217x","object":"chat.completion.chunk","model":"doubao-seed-1-6","choices":[{"index":0,'
    b'"delta":{"content":"Hel"},"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"0217x","object":"chat.completion.chunk","model":"doubao-seed-1-6","choices":[{"index":0,'
    b'"delta":{"content":"lo"},"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"0217x","object":"chat.completion.chunk","model":"doubao-seed-1-6","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}],"usage":null}\n\n'
    b"data: [DONE]\n\n"
)


class TestHideUsageOnlyChunk:
    def test_removes_exactly_the_usage_event(self) -> None:
        """Hiding drops the usage-only event and its blank line; the rest is byte-identical."""
        for size in (1, 5, 1024):
            out, reader = _read(OPENAI_STREAM, _every_size(OPENAI_STREAM, size), hide=True)
            assert out == EXPECTED_HIDDEN
            assert reader.usage == Usage(11, 7, 18)
            assert reader.done is True

    @pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
    def test_other_line_endings(self, eol: bytes) -> None:
        """The hidden event takes its own CRLF/CR endings with it, whatever the piece size."""
        stream, expected = OPENAI_STREAM.replace(b"\n", eol), EXPECTED_HIDDEN.replace(b"\n", eol)
        for size in (1, 2, 3, 7):
            out, _ = _read(stream, _every_size(stream, size), hide=True)
            assert out == expected

    def test_not_hiding_keeps_it(self) -> None:
        """Without the flag the usage-only event reaches the caller."""
        out, _ = _read(OPENAI_STREAM, hide=False)
        assert USAGE_EVENT in out

    def test_holds_back_incomplete_event(self) -> None:
        """Bytes of an unfinished event wait for its blank line, then go out together."""
        reader = SSEUsageReader(hide_usage_only_chunk=True)
        first = _event(_delta("a"))
        assert reader.feed(first[:-1]) == b""
        assert reader.feed(first[-1:]) == first

    @pytest.mark.parametrize(
        "chunk",
        [
            pytest.param({"choices": [], "usage": None, "prompt_filter_results": []}, id="azure-filter-no-usage"),
            pytest.param(_delta("a", {"prompt_tokens": 1, "completion_tokens": 1}), id="cumulative-with-choices"),
            pytest.param({"choices": [{"usage": {"prompt_tokens": 1}}], "usage": None}, id="moonshot"),
        ],
    )
    def test_keeps_other_chunks(self, chunk: dict[str, Any]) -> None:
        """Only `choices: []` with a usable top-level usage is hidden."""
        stream = _event(chunk) + b"data: [DONE]\n\n"
        out, _ = _read(stream, hide=True)
        assert out == stream

    def test_hides_unterminated_final_usage_event(self) -> None:
        """A usage-only event cut off before its blank line is hidden by finish()."""
        head = _event(_delta("a"))
        out, reader = _read(head + b"data: " + _json(_usage_chunk()) + b"\n", hide=True)
        assert out == head
        assert reader.usage == Usage(11, 7, 18)

    def test_long_event_is_released_early(self) -> None:
        """An event longer than max_held_bytes is handed on before its end, never held whole."""
        reader = SSEUsageReader(hide_usage_only_chunk=True)
        line = b"data: " + _json(_delta("x" * 300_000)) + b"\n"
        handed = b"".join(reader.feed(line[i : i + 1024]) for i in range(0, len(line), 1024))
        assert len(handed) >= len(line) - reader.max_held_bytes - 1024
        assert handed + reader.feed(b"\n") + reader.finish() == line + b"\n"

    def test_usage_event_after_released_event_in_same_piece(self) -> None:
        """A usage-only event is still hidden when it shares a piece with the end of a released long event."""
        reader = SSEUsageReader(hide_usage_only_chunk=True)
        reader.max_held_bytes = 100
        long_event = _event(_delta("y" * 1000))
        handed = reader.feed(long_event[:500])
        assert handed  # released early: too long to be the usage-only chunk
        handed += reader.feed(long_event[500:] + USAGE_EVENT + b"data: [DONE]\n\n") + reader.finish()
        assert handed == long_event + b"data: [DONE]\n\n"

    def test_sdk_sees_the_same_events(self) -> None:
        """openai's own SSE decoder yields the same events from the hidden stream as without injection."""
        streaming = pytest.importorskip("openai._streaming")
        out, _ = _read(OPENAI_STREAM, _every_size(OPENAI_STREAM, 3), hide=True)
        decoded = [e.data for e in streaming.SSEDecoder().iter_bytes(iter([out]))]
        without = OPENAI_STREAM.replace(USAGE_EVENT, b"")
        assert decoded == [e.data for e in streaming.SSEDecoder().iter_bytes(iter([without]))]
        assert len(decoded) == 4


# --------------------------------------------------------------------------- properties


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, bytes, Usage | None, bool]:
    """A chat event stream; returns (stream, stream minus its usage-only event, usage, done)."""
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    texts = draw(st.lists(st.text(max_size=40), max_size=12))
    cumulative = draw(st.booleans())
    blocks: list[bytes] = []
    usage: Usage | None = None
    for n, text in enumerate(texts, start=1):
        per_chunk = {"prompt_tokens": 9, "completion_tokens": n} if cumulative else None
        if per_chunk:
            usage = Usage(9, n, 9 + n)
        if draw(st.booleans()):
            blocks.append(b": ping" + eol + eol)
        if draw(st.integers(0, 4)) == 0:  # the same chunk as multi-line data
            body = _json(_delta(text, per_chunk)).replace(b',"', b"," + eol + b'data: "', 1)
            blocks.append(b"data: " + body + eol + eol)
        else:
            blocks.append(_event(_delta(text, per_chunk), eol=eol, name=draw(st.sampled_from([None, "message"]))))
        if draw(st.integers(0, 6)) == 0:
            blocks.append(eol)  # a stray blank line
    hidden_index = None
    if draw(st.booleans()):
        prompt, completion = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
        hidden_index = len(blocks)
        blocks.append(_event(_usage_chunk(prompt, completion), eol=eol))
        if usage is None or prompt + completion >= usage.total_tokens:  # the largest report wins
            usage = Usage(prompt, completion, prompt + completion)
    done = draw(st.booleans())
    if done:
        blocks.append(b"data: [DONE]" + eol + eol)
    if blocks and blocks[-1].endswith(eol + eol) and draw(st.booleans()):
        # the server closed without the final blank line, or without the final line ending too
        blocks[-1] = blocks[-1][: -len(eol) * draw(st.sampled_from([1, 2]))]
    stream = b"".join(blocks)
    visible = b"".join(block for index, block in enumerate(blocks) if index != hidden_index)
    return stream, visible, usage, done


def _splits(stream: bytes) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, len(stream)), max_size=40)


class TestProperties:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_passthrough_for_any_split(self, data: st.DataObject) -> None:
        """Without hiding, any split hands on the input unchanged and reads the one-shot usage."""
        stream, _, usage, done = data.draw(_streams())
        cuts = data.draw(_splits(stream))
        out, reader = _read(stream, cuts)
        _, whole = _read(stream)
        assert out == stream
        assert (reader.usage, reader.done, reader.events) == (whole.usage, whole.done, whole.events)
        assert reader.usage == usage
        assert reader.done == done

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_hiding_for_any_split(self, data: st.DataObject) -> None:
        """With hiding, every split gives the same bytes: the input minus the usage-only event."""
        stream, visible, usage, _ = data.draw(_streams())
        cuts = data.draw(_splits(stream))
        out, reader = _read(stream, cuts, hide=True)
        assert out == visible
        assert reader.usage == usage
