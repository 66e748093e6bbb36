"""Token usage from LLM API responses: where each shape keeps it, and whether it may be charged. Pure, no I/O.

:func:`usage_from_body` reads a complete JSON body (chat completion, Responses API ``Response``,
embeddings) and never raises; :class:`quotawrap.core.sse.SSEUsageReader` reads each event of a stream
with :func:`usage_in_payload`.

Where usage hides, by shape:

* chat: top-level ``usage`` with ``prompt_tokens``/``completion_tokens``/``total_tokens`` and
  optional ``prompt_tokens_details.cached_tokens``/``completion_tokens_details.reasoning_tokens``;
* responses: ``input_tokens``/``output_tokens`` with ``*_details``, at the top of a ``Response``
  or under ``response`` in a ``response.completed`` event;
* embeddings: ``prompt_tokens`` and ``total_tokens`` only;
* Moonshot: inside ``choices[0].usage``;
* images: ``generated_images`` beside ``output_tokens``/``total_tokens``;
* video task (GET once succeeded): ``completion_tokens`` and ``total_tokens``;
* bots: ``bot_usage`` beside ``usage``: ``model_usage[]`` (every model the bot called; when
  they add up to more than ``usage`` they are what is billed) and ``action_usage[]`` (plugin
  calls, each ``search_count`` times, billed per call);
* Ark ``chunk_include_usage``: on every chunk, cumulative; the largest report wins.

:func:`check_usage` is the one rule for whether a usage may be charged at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final, NamedTuple

from . import json_bytes
from .records import Record

__all__ = [
    "MODEL_MAX_OUTPUT",
    "MODEL_WINDOW",
    "TOKEN_CEILING",
    "Checked",
    "Usage",
    "UsageBound",
    "check_usage",
    "model_in_payload",
    "model_of_body",
    "usage_from_body",
    "usage_from_mapping",
    "usage_in_payload",
]

#: No single call reads or writes this many tokens; any count at or above it is implausible. Sums
#: of thousands of such counts stay below 2**53, where doubles (Redis Lua numbers, JSON readers)
#: stop counting exactly, and far below the 2**63 at which SQLite and Redis integers wrap.
TOKEN_CEILING: Final = 2**40
#: Generous ceilings of what one model reads (context window) and writes (answer plus reasoning)
#: in one call, for usage the request itself does not bound (server-side conversation state,
#: reasoning that ``max_tokens`` does not limit). Generous on purpose: an implausible usage is
#: charged the hold, which may be less than the truth, so a real usage must never look implausible.
MODEL_WINDOW: Final = 2**21
MODEL_MAX_OUTPUT: Final = 2**18


class Usage(Record, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int  # what is billed: reasoning included
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    images: int = 0  # generated images (billed per image)
    actions: tuple[tuple[str, int], ...] = ()  # bot plugin calls: (plugin name, calls)


# --------------------------------------------------------------------------- validation


class UsageBound(NamedTuple):  # not a frozen record: one per guarded call, and a NamedTuple is made faster
    """The most usage one call could have produced, from its request (see ``estimate.usage_bound``)."""

    prompt: int
    completion: int


class Checked(NamedTuple):  # as UsageBound
    """A usage fit to charge, or None (charge the hold) with the reason it was not."""

    usage: Usage | None
    anomaly: str | None = None


def _resolved(usage: Usage) -> Usage:
    """Inconsistent parts resolved upward: no part may claim less than what another part implies."""
    prompt = max(usage.prompt_tokens, usage.cached_tokens)
    completion = max(usage.completion_tokens, usage.reasoning_tokens)
    total = max(usage.total_tokens, prompt + completion)
    if (prompt, completion, total) == (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens):
        return usage
    return replace(usage, prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


def check_usage(usage: Usage | None, bound: UsageBound | None = None) -> Checked:
    """The one rule for what usage may be charged. Pure; never raises.

    Counts must be non-negative integers below :data:`TOKEN_CEILING` and, given the call's
    ``bound``, no more than it could have produced; otherwise the usage is an anomaly and the
    hold is charged instead. A total below prompt + completion (or a prompt below its cached
    part, a completion below its reasoning part) is raised to what the parts imply.
    """
    if usage is None:
        return Checked(None)
    counts = (
        ("prompt_tokens", usage.prompt_tokens),
        ("completion_tokens", usage.completion_tokens),
        ("total_tokens", usage.total_tokens),
        ("reasoning_tokens", usage.reasoning_tokens),
        ("cached_tokens", usage.cached_tokens),
    )
    for name, value in counts:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < TOKEN_CEILING:
            return Checked(None, f"{name} {value!r} is not a plausible token count")
    resolved = _resolved(usage)
    if bound is not None:
        if resolved.prompt_tokens > bound.prompt:
            return Checked(None, f"prompt_tokens {resolved.prompt_tokens:,} > {bound.prompt:,} this request can read")
        if resolved.completion_tokens > bound.completion:
            return Checked(
                None, f"completion_tokens {resolved.completion_tokens:,} > {bound.completion:,} it can write"
            )
        if resolved.total_tokens > bound.prompt + bound.completion:
            most = bound.prompt + bound.completion
            return Checked(None, f"total_tokens {resolved.total_tokens:,} > {most:,} this request can use")
    return Checked(resolved)


# --------------------------------------------------------------------------- JSON shapes


class _Unusable(Exception):
    """A count is present but is not a non-negative integer: the whole usage is untrustworthy."""


def _count(value: Any) -> int | None:
    """A token count, None when absent (JSON null counts as absent); raises _Unusable when invalid."""
    if value is None:
        return None
    if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):  # `true` is no count
        if value < 0:
            raise _Unusable
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    raise _Unusable


def _first_count(obj: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        found = _count(obj.get(key))
        if found is not None:
            return found
    return None


def _detail(obj: Mapping[str, Any], sections: tuple[str, ...], key: str) -> int:
    """An optional ``*_details`` count: any malformation means 0, never an unusable usage."""
    for section in sections:
        details = obj.get(section)
        if type(details) is dict or isinstance(details, Mapping):  # json.loads' dict spared the ABC check
            try:
                found = _count(details.get(key))
            except _Unusable:
                continue
            if found is not None:
                return found
    return 0


def usage_from_mapping(obj: Mapping[str, Any]) -> Usage | None:
    """Read a ``usage`` object of chat (prompt/completion) or responses (input/output) shape.

    A missing total is the sum of the parts; a missing part is derived from the total. Returns
    None for anything that is not a usable usage: not a mapping, no counts at all, or a count
    that is not a non-negative integer.
    """
    if type(obj) is not dict and not isinstance(obj, Mapping):  # as in _detail
        return None
    try:
        prompt = _first_count(obj, "prompt_tokens", "input_tokens")
        completion = _first_count(obj, "completion_tokens", "output_tokens")
        total = _count(obj.get("total_tokens"))
    except _Unusable:
        return None
    if prompt is None and completion is None and total is None:
        return None
    if total is None:
        total = (prompt or 0) + (completion or 0)
    if prompt is None:
        prompt = max(total - (completion or 0), 0)
    if completion is None:
        # embeddings report prompt and total only; whatever the total adds is output
        completion = max(total - prompt, 0)
    reasoning = _detail(obj, ("completion_tokens_details", "output_tokens_details"), "reasoning_tokens")
    cached = _detail(obj, ("prompt_tokens_details", "input_tokens_details"), "cached_tokens")
    if not cached:
        try:  # DeepSeek's own API spells the cache hit as a top-level count
            cached = _count(obj.get("prompt_cache_hit_tokens")) or 0
        except _Unusable:
            cached = 0
    try:
        images = _count(obj.get("generated_images")) or 0
    except _Unusable:
        return None
    return Usage(prompt, completion, total, reasoning, cached, images)


def _with_bot_usage(usage: Usage, bot_usage: object) -> Usage:
    """Fold a bot answer's ``bot_usage`` into its usage; a malformed part adds nothing."""
    if not isinstance(bot_usage, Mapping):
        return usage
    models = [usage_from_mapping(entry) for entry in _entries(bot_usage.get("model_usage"))]
    found = [entry for entry in models if entry is not None]
    if found and sum(entry.total_tokens for entry in found) > usage.total_tokens:
        usage = replace(
            usage,
            prompt_tokens=sum(entry.prompt_tokens for entry in found),
            completion_tokens=sum(entry.completion_tokens for entry in found),
            total_tokens=sum(entry.total_tokens for entry in found),
        )
    actions = []
    for entry in _entries(bot_usage.get("action_usage")):
        try:
            calls = _count(entry.get("search_count", entry.get("count")))
        except _Unusable:
            continue
        if calls:
            actions.append((str(entry.get("name") or "unknown"), calls))
    return replace(usage, actions=tuple(actions)) if actions else usage


def _entries(value: object) -> list[Mapping[str, Any]]:
    return [entry for entry in value if isinstance(entry, Mapping)] if isinstance(value, list) else []


def usage_in_payload(obj: Mapping[str, Any]) -> tuple[Usage | None, bool]:
    """The usage carried by one JSON payload, and whether it sat at the top level."""
    found = _usage_at(obj)
    if found is not None:
        if "bot_usage" in obj:
            found = _with_bot_usage(found, obj["bot_usage"])
        return found, True
    response = obj.get("response")  # Responses API stream events wrap the Response
    if isinstance(response, Mapping):
        found = _usage_at(response)
        if found is not None:
            return found, False
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return _usage_at(choices[0]), False  # Moonshot
    return None, False


def _usage_at(holder: Mapping[str, Any]) -> Usage | None:
    usage = holder.get("usage")
    return usage_from_mapping(usage) if type(usage) is dict or isinstance(usage, Mapping) else None


def model_in_payload(obj: Mapping[str, Any]) -> object:
    """The ``model`` an answer names (what Ark used: quotawrap.core.identity): at the top level (chat, completions,
    embeddings, a Responses body), or in the Response a Responses stream event wraps."""
    model = obj.get("model")
    response = obj.get("response")
    if model is None and isinstance(response, Mapping):
        model = response.get("model")
    return model


def model_of_body(body: bytes) -> object:
    """:func:`model_in_payload` of a complete JSON body; None when it is not a JSON object. Never raises."""
    try:
        obj = json_bytes.loads(body)
    except Exception:  # a guard must not break the caller over a body it cannot read
        return None
    return model_in_payload(obj) if isinstance(obj, dict) else None


def usage_from_body(body: bytes | str | Mapping[str, Any]) -> Usage | None:
    """Usage of a complete JSON response body; None when it has none or is not JSON. Never raises."""
    try:
        obj: Any = json_bytes.loads(body) if type(body) is bytes or not isinstance(body, Mapping) else body
        if type(obj) is not dict and not isinstance(obj, Mapping):
            return None
        return usage_in_payload(obj)[0]
    except Exception:  # a guard must not break the caller over a body it cannot read
        return None
