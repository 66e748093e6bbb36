"""Ark inference endpoints: validate a request body and decide the generation it asks for. Pure.

Each endpoint turns (body, config) into a `Generation`, whose `plan` is what will be billed and
whose `body()` / `frames()` render the answer, or raises `ArkError` (never billed).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..core.records import Record
from . import _payloads as payloads
from ._config import SimConfig
from ._contract import (
    ArkError,
    check_chat,
    check_count,
    check_messages,
    check_required,
    check_thinking,
    served_model,
    status_type,
)
from ._plan import (
    Plan,
    chat_prompt_tokens,
    embedding_prompt_tokens,
    plan_generation,
    responses_prompt_tokens,
    text_prompt_tokens,
    thinking_disabled,
)

__all__ = ["API_PREFIX", "ENDPOINTS", "ArkError", "Generation", "fault_error", "status_type"]

API_PREFIX = "/api/v3"


_FAULT_ERRORS = {
    "error_400": (
        400,
        "InvalidParameter",
        "A parameter specified in the request is not valid (simulated fault).",
    ),
    "error_429": (
        429,
        "RateLimitExceeded.EndpointTPMExceeded",
        "Your account has exceeded the tokens per minute (TPM) limit (simulated fault).",
    ),
    "error_500": (
        500,
        "InternalServiceError",
        "The service encountered an unexpected internal error (simulated fault).",
    ),
}


def fault_error(fault: str, code_override: str | None) -> ArkError | None:
    """The error an `error_*` fault answers with, or None for other faults."""
    if fault not in _FAULT_ERRORS:
        return None
    status, code, message = _FAULT_ERRORS[fault]
    return ArkError(status, code_override or code, message)


class Generation(Record, frozen=True):
    """A validated request: what it costs and how to render it."""

    model: str
    plan: Plan
    stream: bool
    body: Callable[[bool], dict[str, Any]]  # with_usage -> JSON body
    frames: Callable[[bool], list[bytes]]  # with_usage -> SSE frames


def _model(body: dict[str, Any], cfg: SimConfig, *, bot: bool = False) -> str:
    """The model that serves the request (an endpoint id's foundation model); Ark's 4xx when there is none."""
    model = check_required(body, "model")
    if not isinstance(model, str):
        raise _invalid("model", f"expected a string, but got `{model!r}` instead.")
    return served_model(model, cfg, bot=bot)


def _required(body: dict[str, Any], name: str) -> Any:
    return check_required(body, name)


def _invalid(name: str, why: str) -> ArkError:
    return ArkError(
        400, "InvalidParameter", f"The parameter `{name}` specified in the request are not valid: {why}", name
    )


def _opt_count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _invalid(name, f"expected a non-negative integer, but got `{value!r}` instead.")
    return value


def _flag(obj: Any, name: str) -> bool:
    return isinstance(obj, dict) and obj.get(name) is True


def _stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("stream", "must be a boolean")
    return bool(stream)


def _chat(
    body: dict[str, Any], cfg: SimConfig, ident: str, created: int, context_tokens: int = 0, *, bot: bool = False
) -> Generation:
    model = _model(body, cfg, bot=bot)
    messages = check_messages(body, cfg)
    max_tokens, max_completion_tokens = check_chat(body, model, cfg)
    plan = plan_generation(
        chat_prompt_tokens(model, messages) + context_tokens,
        reply_tokens=cfg.reply_tokens,
        reasoning_tokens=0 if thinking_disabled(body) else cfg.reasoning_tokens,
        max_tokens=max_tokens,
        max_total=max_completion_tokens,
    )
    options = body.get("stream_options")
    chat_id = f"02{ident}"  # Ark's chat ids are its request ids
    return Generation(
        model=model,
        plan=plan,
        stream=_stream(body),
        body=lambda with_usage: payloads.chat_completion(chat_id, created, model, plan, with_usage=with_usage),
        frames=lambda with_usage: payloads.chat_stream_frames(
            chat_id,
            created,
            model,
            plan,
            tokens_per_chunk=cfg.tokens_per_chunk,
            include_usage=_flag(options, "include_usage"),
            chunk_include_usage=_flag(options, "chunk_include_usage"),
            with_usage=with_usage,
        ),
    )


def _completions(body: dict[str, Any], cfg: SimConfig, ident: str, created: int) -> Generation:
    model = _model(body, cfg)
    prompt = _required(body, "prompt")
    plan = plan_generation(
        text_prompt_tokens(model, prompt),
        reply_tokens=cfg.reply_tokens,
        reasoning_tokens=0,  # legacy completions never think
        max_tokens=check_count(body, "max_tokens", cfg),
    )
    options = body.get("stream_options")
    cmpl_id = f"cmpl-{ident}"
    return Generation(
        model=model,
        plan=plan,
        stream=_stream(body),
        body=lambda with_usage: payloads.text_completion(cmpl_id, created, model, plan, with_usage=with_usage),
        frames=lambda with_usage: payloads.text_completion_stream_frames(
            cmpl_id,
            created,
            model,
            plan,
            tokens_per_chunk=cfg.tokens_per_chunk,
            include_usage=_flag(options, "include_usage"),
            with_usage=with_usage,
        ),
    )


def _responses(body: dict[str, Any], cfg: SimConfig, ident: str, created: int) -> Generation:
    model = _model(body, cfg)
    input_ = _required(body, "input")
    if not isinstance(input_, (str, list)):
        raise _invalid("input", "expected a string or a list of items.")
    max_output_tokens = check_count(body, "max_output_tokens", cfg)
    check_thinking(body, model, cfg)
    plan = plan_generation(
        responses_prompt_tokens(model, input_, body.get("instructions")),
        reply_tokens=cfg.reply_tokens,
        reasoning_tokens=0 if thinking_disabled(body) else cfg.reasoning_tokens,
        max_total=max_output_tokens,
    )
    return Generation(
        model=model,
        plan=plan,
        stream=_stream(body),
        body=lambda with_usage: payloads.response_object(
            ident, created, model, plan, with_usage=with_usage, max_output_tokens=max_output_tokens
        ),
        frames=lambda with_usage: payloads.response_stream_frames(
            ident,
            created,
            model,
            plan,
            tokens_per_chunk=cfg.tokens_per_chunk,
            with_usage=with_usage,
            max_output_tokens=max_output_tokens,
        ),
    )


def _embeddings(body: dict[str, Any], cfg: SimConfig, ident: str, created: int) -> Generation:
    model = _model(body, cfg)
    input_ = _required(body, "input")
    if isinstance(input_, list) and not input_:
        raise _invalid("input", "expected a non-empty list.")
    inputs = [one if isinstance(one, str) else str(one) for one in (input_ if isinstance(input_, list) else [input_])]
    if isinstance(input_, list) and input_ and all(isinstance(x, int) for x in input_):
        inputs = [str(input_)]  # one pre-tokenised input
    prompt = embedding_prompt_tokens(model, input_)
    plan = Plan(prompt, 0, 0, truncated=False)
    base64_format = body.get("encoding_format") == "base64"
    emb_id = f"02{ident}"

    def render(with_usage: bool) -> dict[str, Any]:
        return payloads.embedding_response(
            emb_id, created, model, inputs, prompt, base64_format=base64_format, with_usage=with_usage
        )

    def no_stream(with_usage: bool) -> list[bytes]:
        raise AssertionError("embeddings never stream")

    return Generation(model=model, plan=plan, stream=False, body=render, frames=no_stream)


Endpoint = Callable[[dict[str, Any], SimConfig, str, int], Generation]


def _bot_chat(body: dict[str, Any], cfg: SimConfig, ident: str, created: int) -> Generation:
    """Chat, plus Ark's ``bot_usage``: the model calls and the plugin (web_search) calls behind it."""
    generation = _chat(body, cfg, ident, created, bot=True)
    plan = generation.plan
    bot_usage: dict[str, Any] = {
        "model_usage": [
            {
                "name": generation.model,
                "prompt_tokens": plan.prompt_tokens,
                "completion_tokens": plan.completion_tokens,
                "total_tokens": plan.total_tokens,
            }
        ],
        "action_usage": [{"name": "web_search", "search_count": cfg.bot_searches}] if cfg.bot_searches else [],
    }

    def render(with_usage: bool) -> dict[str, Any]:
        answer = generation.body(with_usage)
        if with_usage:
            answer["bot_usage"] = bot_usage
        return answer

    return Generation(generation.model, plan, generation.stream, render, generation.frames)


def _context_chat(body: dict[str, Any], cfg: SimConfig, ident: str, created: int) -> Generation:
    """Chat that also reads a cached context: its tokens (carried in the id the create gave) are prompt."""
    context_id = _required(body, "context_id")
    found = re.search(r"-t(\d+)$", context_id) if isinstance(context_id, str) else None
    if found is None:
        raise ArkError(404, "NotFound", f"The context {context_id} does not exist or has expired.", "context_id")
    return _chat(body, cfg, ident, created, context_tokens=int(found.group(1)))


ENDPOINTS: dict[str, Endpoint] = {
    f"{API_PREFIX}/chat/completions": _chat,
    f"{API_PREFIX}/bots/chat/completions": _bot_chat,
    f"{API_PREFIX}/batch/chat/completions": _chat,
    f"{API_PREFIX}/context/chat/completions": _context_chat,
    f"{API_PREFIX}/completions": _completions,
    f"{API_PREFIX}/responses": _responses,
    f"{API_PREFIX}/embeddings": _embeddings,
    f"{API_PREFIX}/batch/embeddings": _embeddings,
}
