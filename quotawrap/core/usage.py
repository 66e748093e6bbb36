"""Token usage from LLM API responses: pure parsing, no I/O.

Two entry points feed the guard's reconciliation step:

* :func:`usage_from_body` reads a complete JSON body (chat completion, Responses API
  ``Response``, embeddings) and never raises;
* :class:`SSEUsageReader` is fed the raw (already decompressed) bytes of an event stream in
  whatever pieces the transport delivers, hands them on unchanged (or minus the one
  usage-only chunk that quotawrap caused by injecting ``stream_options.include_usage``), and
  keeps the best usage seen so far.

Where usage hides, by shape (see notes/injection.md, pitfall 16):

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
    "SSEUsageReader",
    "Usage",
    "UsageBound",
    "check_usage",
    "is_event_stream",
    "model_in_payload",
    "model_of_body",
    "usage_from_body",
    "usage_from_mapping",
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


def _size(usage: Usage) -> int:
    return max(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)


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


def _usage_in_payload(obj: Mapping[str, Any]) -> tuple[Usage | None, bool]:
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
        return _usage_in_payload(obj)[0]
    except Exception:  # a guard must not break the caller over a body it cannot read
        return None


def is_event_stream(content_type: str | None) -> bool:
    """True for ``text/event-stream`` with or without parameters, in any letter case."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


# --------------------------------------------------------------------------- SSE

# Responses API ends; Seedream's image stream ends with image_generation.completed (its usage) before [DONE].
_TERMINAL_TYPES: Final = frozenset(
    {"response.completed", "response.failed", "response.incomplete", "image_generation.completed"}
)
_TERMINAL_EVENTS: Final = frozenset(t.encode() for t in _TERMINAL_TYPES)
_LF: Final = 10
_CR: Final = 13

# What to do with a "\n" at the start of the next chunk that completes a "\r\n" split across chunks.
_LF_HELD: Final = 0  # the "\r" ended an ordinary line: the "\n" belongs to the block still being built
_LF_EMIT: Final = 1  # the "\r" ended a block that was handed on: hand the "\n" on too
_LF_DROP: Final = 2  # the "\r" ended the hidden block: the "\n" is hidden with it


def _worth_parsing(payload: bytes) -> bool:
    """Cheap byte test that skips json.loads for the ordinary delta chunks (the hot path).

    Parses whenever usage, an error or a terminal Responses event might be present. A single
    ``"usage":null`` (OpenAI puts it on every chunk under include_usage) is no usage. It may
    say yes needlessly (a delta whose text says "response."), never no wrongly; each test is
    one C scan, which matters at a few hundred chunks per answer.
    """
    if b"error" in payload or b"response." in payload:
        return True
    at = payload.rfind(b"usage")  # from the end: a chunk's usage is its last key
    if at < 0:
        return False
    null = payload.startswith(b'":null', at + 5) or payload[at + 5 : at + 14].replace(b" ", b"").startswith(b'":null')
    return not null or payload.find(b"usage", 0, at) >= 0  # a usage, or a second one: parse


class SSEUsageReader:
    """Incremental SSE reader fed with the raw (already decompressed) body bytes in arbitrary splits.

    Without hiding, :meth:`feed` returns its argument itself: the reader only watches. With
    ``hide_usage_only_chunk=True`` it holds back the bytes of the event being received until
    the blank line that ends it, then either hands them on or, for a ``{"choices": [],
    "usage": {...}}`` chunk, drops them (data lines, any comment or field lines of the same
    event, and the terminating blank line). An SDK decodes an event only at that blank line,
    so holding back costs the caller no latency. Events longer than ``max_held_bytes`` cannot
    be that small chunk and are handed on as they arrive.

    Every line is inspected once and each event's data is joined once, so the work is
    O(total bytes) however the stream is split.
    """

    #: An event whose data exceeds this is counted but not parsed (bounded memory).
    max_event_bytes: int = 64 * 1024 * 1024
    #: While hiding, an event held back beyond this is handed on and can no longer be hidden.
    max_held_bytes: int = 64 * 1024

    usage: Usage | None  # the largest usable usage seen (cumulative reports grow; a smaller later one never wins)
    model: object = None  # the model named by the last event parsed (the usage chunk names it): model_in_payload
    done: bool  # saw [DONE] or a terminal Responses event (completed / failed / incomplete)
    error: Mapping[str, Any] | None  # the payload of the last error event
    events: int  # events that carried data, [DONE] and hidden ones included

    def __init__(self, *, hide_usage_only_chunk: bool = False) -> None:
        self.usage = None
        self.done = False
        self.error = None
        self.events = 0
        self._hide = hide_usage_only_chunk
        # line assembly
        self._partial: list[bytes] = []
        self._partial_len = 0
        self._skip_lf = False
        self._line_overflow = False
        # event assembly
        self._data: list[bytes] = []
        self._data_len = 0
        self._has_data = False
        self._event_overflow = False
        self._event_name = b""
        # hiding: raw bytes of the current block (event lines up to and including its blank line)
        self._held: list[bytes] = []
        self._held_len = 0
        self._hideable = True
        self._lf_fate = _LF_HELD
        self._idle = True  # between events: nothing partial, pending or held (the hot path's premise)

    # ------------------------------------------------------------------ public

    def feed(self, data: bytes) -> bytes:
        """Read the next piece of the body; returns the bytes to hand on to the caller.

        The hot path: servers write one event at a time, so most pieces are one whole ``data:``
        delta chunk. When the reader is between events (``_idle``), such a piece needs no line
        splitting, no holding back (it is not the usage-only chunk) and no JSON: count it and
        hand it on, after a few C-level scans of its bytes and no copy. Anything else, or any
        doubt, takes the general path, which starts from the same state.
        """
        if (
            self._idle
            and data.endswith(b"\n\n")
            and data.startswith(b"data:")
            and data.find(b"\n") == len(data) - 2
            and b"\r" not in data
            and not data.startswith(b"[DONE]", 6 if data[5] == 32 else 5)  # 32: b" "; an O(1) test
            and not _worth_parsing(data)  # the "data:" prefix and blank line hold none of its words
        ):
            self.events += 1
            if self._hide:
                self._hideable = True  # the next block starts fresh, as after any handed-on block
            return data
        if not data:
            return data
        if self._hide:
            out = self._feed_hiding(data)
        else:
            self._scan(data, None)
            out = data
        self._idle = not (
            self._partial or self._skip_lf or self._has_data or self._event_name or self._held or self._line_overflow
        )
        return out

    def finish(self) -> bytes:
        """End of stream: read a last event that lacks its blank line and flush held-back bytes."""
        if self._partial or self._line_overflow:
            self._complete_line(b"")
        self._skip_lf = False
        hidden = self._end_event()
        held, self._held, self._held_len, self._hideable = self._held, [], 0, True
        self._idle = True
        if not self._hide or hidden:
            return b""
        return b"".join(held)

    # ------------------------------------------------------------------ bytes -> lines

    def _scan(self, data: bytes, block_ends: list[tuple[int, bool]] | None) -> None:
        """Split ``data`` into lines and process them; when hiding, record where blocks end."""
        offset = 0
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == _LF:  # second half of a "\r\n" split across pieces
                if len(data) == 1:
                    return
                offset = 1
                data = data[1:]
        lines = data.splitlines(keepends=True)
        last = len(lines) - 1
        position = offset
        for index, raw in enumerate(lines):
            position += len(raw)
            end = raw[-1]
            if end == _LF:
                cut = 2 if len(raw) > 1 and raw[-2] == _CR else 1
            elif end == _CR:
                cut = 1
                if index == last:
                    self._skip_lf = True
            else:  # only the last piece can lack a line ending
                self._add_partial(raw)
                return
            if self._partial or self._line_overflow:
                self._complete_line(raw[:-cut])
            elif len(raw) > cut:
                self._field_line(raw[:-cut])
            else:
                hidden = self._end_event()
                if block_ends is not None:
                    block_ends.append((position, hidden))
                    self._hideable = True  # the next block starts fresh

    def _add_partial(self, piece: bytes) -> None:
        if self._line_overflow:
            return
        self._partial.append(piece)
        self._partial_len += len(piece)
        if self._partial_len > self.max_event_bytes:
            line = b"".join(self._partial)
            self._partial, self._partial_len = [], 0
            self._line_overflow = True
            if line.startswith(b"data"):
                self._overflow_event()

    def _complete_line(self, tail: bytes) -> None:
        if self._line_overflow:
            self._line_overflow = False  # already accounted for when it overflowed
            return
        self._partial.append(tail)
        line = b"".join(self._partial)  # never empty: a partial holds at least one byte
        self._partial, self._partial_len = [], 0
        self._field_line(line)

    # ------------------------------------------------------------------ lines -> events

    def _field_line(self, line: bytes) -> None:
        if line.startswith(b"data"):
            value = line[4:]
            if not value or value[0] == 58:  # "data" or "data:..."
                value = value[1:]
                if value[:1] == b" ":
                    value = value[1:]
                self._add_data(value)
                return
        if line[0] == 58:  # ":" comment, e.g. keep-alives
            return
        field, _, value = line.partition(b":")
        if field == b"event":
            self._event_name = value[1:] if value[:1] == b" " else value

    def _add_data(self, value: bytes) -> None:
        self._has_data = True
        if self._event_overflow:
            return
        self._data.append(value)
        self._data_len += len(value) + 1
        if self._data_len > self.max_event_bytes:
            self._overflow_event()

    def _overflow_event(self) -> None:
        self._has_data = True
        self._event_overflow = True
        self._data, self._data_len = [], 0

    def _end_event(self) -> bool:
        """Dispatch the event a blank line ends; True if it is the usage-only chunk to hide."""
        name = self._event_name
        self._event_name = b""
        if not self._has_data:
            return False
        data, overflow = self._data, self._event_overflow
        self._data, self._data_len, self._has_data, self._event_overflow = [], 0, False, False
        self.events += 1
        if name in _TERMINAL_EVENTS:
            self.done = True
        if overflow:
            return False
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        if payload.startswith(b"[DONE]"):
            self.done = True
            return False
        if name != b"error" and not _worth_parsing(payload):
            return False
        try:
            obj = json_bytes.loads(payload)
        except (ValueError, RecursionError):
            if name == b"error":
                self.error = {"error": payload.decode("utf-8", "replace")}
            return False
        if not isinstance(obj, dict):
            return False
        return self._absorb(obj, name)

    def _absorb(self, obj: dict[str, Any], name: bytes) -> bool:
        model = model_in_payload(obj)
        if model is not None:
            self.model = model
        kind = obj.get("type")
        if kind in _TERMINAL_TYPES:
            self.done = True
        response = obj.get("response")
        if (
            obj.get("error")
            or name == b"error"
            or kind == "error"
            or (isinstance(response, Mapping) and response.get("error"))
        ):
            self.error = obj
        found, top_level = _usage_in_payload(obj)
        if found is None:
            return False
        if self.usage is None or _size(found) >= _size(self.usage):
            self.usage = found
        return self._hide and self._hideable and top_level and obj.get("choices") == []

    # ------------------------------------------------------------------ hiding

    def _feed_hiding(self, data: bytes) -> bytes:
        out: list[bytes] = []
        start = 0
        if self._skip_lf and data[0] == _LF:
            if self._lf_fate == _LF_DROP:
                start = 1
            elif self._lf_fate == _LF_EMIT:
                out.append(data[:1])
                start = 1
        block_ends: list[tuple[int, bool]] = []
        self._scan(data, block_ends)
        for end, hidden in block_ends:
            if not hidden:
                out.extend(self._held)
                out.append(data[start:end])
            self._held, self._held_len = [], 0
            start = end
        if start < len(data):
            tail = data[start:] if start else data
            if self._hideable:
                self._held.append(tail)
                self._held_len += len(tail)
                if self._held_len > self.max_held_bytes:
                    out.extend(self._held)
                    self._held, self._held_len, self._hideable = [], 0, False
            else:
                out.append(tail)
        if self._skip_lf:
            if block_ends and block_ends[-1][0] == len(data):
                self._lf_fate = _LF_DROP if block_ends[-1][1] else _LF_EMIT
            else:
                self._lf_fate = _LF_HELD
        if len(out) == 1:
            return out[0]
        return b"".join(out)
