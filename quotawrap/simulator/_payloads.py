"""Response bodies and SSE frames in Ark's (OpenAI-compatible) wire shapes. Pure: no I/O, no clock.

The answer is `answer_tokens` words "tok " and the reasoning `reasoning_tokens` words "think ",
so a test can predict every byte; streams send `tokens_per_chunk` words per delta.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from typing import Any

from ._plan import Plan

__all__ = [
    "ANSWER_WORD",
    "DONE_FRAME",
    "REASONING_WORD",
    "ark_error",
    "chat_completion",
    "chat_stream_frames",
    "chat_usage",
    "embedding_response",
    "response_object",
    "response_stream_frames",
    "responses_usage",
    "sse_data",
    "sse_event",
    "text_completion",
    "text_completion_stream_frames",
]

ANSWER_WORD = "tok "
REASONING_WORD = "think "
DONE_FRAME = b"data: [DONE]\n\n"
EMBEDDING_DIMENSIONS = 8


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse_data(obj: Any) -> bytes:
    """One `data:` SSE frame (chat and completions streams)."""
    return b"data: " + _dumps(obj) + b"\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    """One `event:` + `data:` SSE frame (Responses streams name the event after its `type`)."""
    event_type: str = obj["type"]
    return b"event: " + event_type.encode() + b"\n" + sse_data(obj)


def ark_error(code: str, message: str, param: str, type_: str) -> dict[str, Any]:
    """Ark's error body, which the SDKs unwrap from `body["error"]`."""
    return {"error": {"code": code, "message": message, "param": param, "type": type_}}


def chat_usage(prompt: int, reasoning: int, answer: int) -> dict[str, Any]:
    """Chat/completions usage; reasoning is part of completion_tokens, as on Ark and OpenAI."""
    completion = reasoning + answer
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def _plan_usage(plan: Plan) -> dict[str, Any]:
    return chat_usage(plan.prompt_tokens, plan.reasoning_tokens, plan.answer_tokens)


def _pieces(word: str, count: int, per_chunk: int) -> list[tuple[str, int]]:
    return [(word * min(per_chunk, count - i), min(per_chunk, count - i)) for i in range(0, count, per_chunk)]


def chat_completion(ident: str, created: int, model: str, plan: Plan, *, with_usage: bool) -> dict[str, Any]:
    """A non-stream `chat.completion`."""
    message: dict[str, Any] = {"role": "assistant", "content": ANSWER_WORD * plan.answer_tokens}
    if plan.reasoning_tokens:
        message["reasoning_content"] = REASONING_WORD * plan.reasoning_tokens
    body: dict[str, Any] = {
        "id": ident,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "service_tier": "default",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": plan.finish_reason}],
    }
    if with_usage:
        body["usage"] = _plan_usage(plan)
    return body


def chat_stream_frames(
    ident: str,
    created: int,
    model: str,
    plan: Plan,
    *,
    tokens_per_chunk: int,
    include_usage: bool,
    chunk_include_usage: bool,
    with_usage: bool,
) -> list[bytes]:
    """A `chat.completion.chunk` stream, ending with `[DONE]`.

    Every chunk has `usage: null`, except: with `chunk_include_usage` each chunk carries the
    cumulative usage so far; with `include_usage` one extra last chunk has `choices: []` and usage.
    """
    reasoning_sent = answer_sent = 0

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        usage = None
        if chunk_include_usage and with_usage:
            usage = chat_usage(plan.prompt_tokens, reasoning_sent, answer_sent)
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse_data(_chunk_envelope(ident, created, model, [choice], usage))

    frames = [chunk({"role": "assistant", "content": ""})]
    for text, count in _pieces(REASONING_WORD, plan.reasoning_tokens, tokens_per_chunk):
        reasoning_sent += count
        frames.append(chunk({"content": "", "reasoning_content": text}))
    for text, count in _pieces(ANSWER_WORD, plan.answer_tokens, tokens_per_chunk):
        answer_sent += count
        frames.append(chunk({"content": text}))
    frames.append(chunk({"content": ""}, plan.finish_reason))
    if include_usage and with_usage:
        frames.append(sse_data(_chunk_envelope(ident, created, model, [], _plan_usage(plan))))
    frames.append(DONE_FRAME)
    return frames


def _chunk_envelope(
    ident: str, created: int, model: str, choices: list[Any], usage: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "service_tier": "default",
        "choices": choices,
        "usage": usage,
    }


def text_completion(ident: str, created: int, model: str, plan: Plan, *, with_usage: bool) -> dict[str, Any]:
    """A non-stream legacy `text_completion`."""
    choice = {"text": ANSWER_WORD * plan.answer_tokens, "index": 0, "logprobs": None}
    body: dict[str, Any] = {
        "id": ident,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{**choice, "finish_reason": plan.finish_reason}],
    }
    if with_usage:
        body["usage"] = chat_usage(plan.prompt_tokens, 0, plan.answer_tokens)
    return body


def text_completion_stream_frames(
    ident: str,
    created: int,
    model: str,
    plan: Plan,
    *,
    tokens_per_chunk: int,
    include_usage: bool,
    with_usage: bool,
) -> list[bytes]:
    """A legacy completions stream: text deltas, a finish chunk, optional usage chunk, `[DONE]`."""

    def chunk(choices: list[Any], usage: dict[str, Any] | None = None) -> bytes:
        envelope = {"id": ident, "object": "text_completion", "created": created, "model": model}
        return sse_data({**envelope, "choices": choices, "usage": usage})

    def choice(text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}

    frames = [chunk([choice(text, None)]) for text, _ in _pieces(ANSWER_WORD, plan.answer_tokens, tokens_per_chunk)]
    frames.append(chunk([choice("", plan.finish_reason)]))
    if include_usage and with_usage:
        frames.append(chunk([], chat_usage(plan.prompt_tokens, 0, plan.answer_tokens)))
    frames.append(DONE_FRAME)
    return frames


def responses_usage(plan: Plan) -> dict[str, Any]:
    """Responses API usage: input/output naming, reasoning inside output_tokens."""
    return {
        "input_tokens": plan.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": plan.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": plan.reasoning_tokens},
        "total_tokens": plan.total_tokens,
    }


def _reasoning_item(ident: str, text: str, status: str) -> dict[str, Any]:
    summary = [{"type": "summary_text", "text": text}] if text else []
    return {"type": "reasoning", "id": f"rs_{ident}", "summary": summary, "status": status}


def _message_item(ident: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "type": "message",
        "id": f"msg_{ident}",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def response_object(
    ident: str,
    created: int,
    model: str,
    plan: Plan,
    *,
    with_usage: bool,
    done: bool = True,
    max_output_tokens: int | None = None,
) -> dict[str, Any]:
    """A Responses API `response`; a capped generation ends `incomplete` (reason max_output_tokens)."""
    output: list[dict[str, Any]] = []
    if done:
        if plan.reasoning_tokens:
            output.append(_reasoning_item(ident, REASONING_WORD * plan.reasoning_tokens, "completed"))
        output.append(_message_item(ident, ANSWER_WORD * plan.answer_tokens, _final_status(plan)))
    status = _final_status(plan) if done else "in_progress"
    return {
        "id": f"resp_{ident}",
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if done and plan.truncated else None,
        "max_output_tokens": max_output_tokens,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "service_tier": "default",
        "text": {"format": {"type": "text"}},
        "usage": responses_usage(plan) if done and with_usage else None,
    }


def _final_status(plan: Plan) -> str:
    return "incomplete" if plan.truncated else "completed"


def response_stream_frames(
    ident: str,
    created: int,
    model: str,
    plan: Plan,
    *,
    tokens_per_chunk: int,
    with_usage: bool,
    max_output_tokens: int | None = None,
) -> list[bytes]:
    """A Responses stream of `event:` frames, ending with response.completed (or .incomplete).

    No `[DONE]`: OpenAI's Responses streams end with the terminal event, and both SDKs stop
    at the end of the body either way.
    """
    events: list[dict[str, Any]] = []

    def emit(type_: str, **fields: Any) -> None:
        events.append({"type": type_, "sequence_number": len(events), **fields})

    def snapshot(done: bool) -> dict[str, Any]:
        return response_object(
            ident, created, model, plan, with_usage=with_usage, done=done, max_output_tokens=max_output_tokens
        )

    emit("response.created", response=snapshot(False))
    emit("response.in_progress", response=snapshot(False))
    index = 0
    if plan.reasoning_tokens:
        item_id = f"rs_{ident}"
        emit("response.output_item.added", output_index=index, item=_reasoning_item(ident, "", "in_progress"))
        part = {"type": "summary_text", "text": ""}
        emit(
            "response.reasoning_summary_part.added",
            item_id=item_id,
            output_index=index,
            summary_index=0,
            part=part,
        )
        for text, _ in _pieces(REASONING_WORD, plan.reasoning_tokens, tokens_per_chunk):
            emit(
                "response.reasoning_summary_text.delta",
                item_id=item_id,
                output_index=index,
                summary_index=0,
                delta=text,
            )
        full = REASONING_WORD * plan.reasoning_tokens
        emit(
            "response.reasoning_summary_text.done",
            item_id=item_id,
            output_index=index,
            summary_index=0,
            text=full,
        )
        part = {"type": "summary_text", "text": full}
        emit(
            "response.reasoning_summary_part.done",
            item_id=item_id,
            output_index=index,
            summary_index=0,
            part=part,
        )
        emit("response.output_item.done", output_index=index, item=_reasoning_item(ident, full, "completed"))
        index += 1
    item_id = f"msg_{ident}"
    emit("response.output_item.added", output_index=index, item=_message_item(ident, None, "in_progress"))
    empty_part = {"type": "output_text", "text": "", "annotations": []}
    emit("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=empty_part)
    for text, _ in _pieces(ANSWER_WORD, plan.answer_tokens, tokens_per_chunk):
        emit(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )
    full = ANSWER_WORD * plan.answer_tokens
    emit(
        "response.output_text.done",
        item_id=item_id,
        output_index=index,
        content_index=0,
        text=full,
        logprobs=[],
    )
    done_part = {"type": "output_text", "text": full, "annotations": []}
    emit("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=done_part)
    emit("response.output_item.done", output_index=index, item=_message_item(ident, full, _final_status(plan)))
    terminal = "response.incomplete" if plan.truncated else "response.completed"
    emit(terminal, response=snapshot(True))
    return [sse_event(event) for event in events]


def _embedding_vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round(b / 127.5 - 1.0, 6) for b in digest[:EMBEDDING_DIMENSIONS]]


def embedding_response(
    ident: str,
    created: int,
    model: str,
    inputs: list[str],
    prompt_tokens: int,
    *,
    base64_format: bool,
    with_usage: bool,
) -> dict[str, Any]:
    """An embeddings `list`: one deterministic 8-float vector per input (base64 float32 if asked)."""
    data = []
    for index, text in enumerate(inputs):
        vector: Any = _embedding_vector(text)
        if base64_format:
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": vector})
    body: dict[str, Any] = {"id": ident, "object": "list", "created": created, "model": model, "data": data}
    if with_usage:
        body["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return body
