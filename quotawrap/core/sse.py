"""Server-sent event streams: which answers are one, and the reader that finds their usage. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from . import json_bytes
from .usage import Usage, model_in_payload, usage_in_payload

__all__ = ["SSEUsageReader", "is_event_stream"]


def is_event_stream(content_type: str | None) -> bool:
    """True for ``text/event-stream`` with or without parameters, in any letter case."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


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


def _size(usage: Usage) -> int:
    """How big a report is: a later, smaller report of a cumulative stream never replaces a larger one."""
    return max(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)


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
        found, top_level = usage_in_payload(obj)
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
