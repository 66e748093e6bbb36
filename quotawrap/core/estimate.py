"""Pessimistic token estimate of one API request, made before it is sent.

``reserve = input estimate + output allowance`` (seed §7.6). Both halves lean high on purpose:
an estimate that is too low lets a call through that the ledger cannot afford, one that is too
high only blocks a little early, and the hold is settled from the response's real usage anyway.

Output allowance:

* ``max_completion_tokens`` bounds answer and reasoning together, so it is the allowance;
* otherwise ``max_tokens`` (or Ark's default 4096) bounds only the answer, and a thinking model
  spends reasoning tokens on top (the seed's 18-token question that cost 167): the allowance is
  ``max(max_tokens or default, thinking_floor)`` unless ``thinking: {"type": "disabled"}``. A guarded
  call that may think is not reserved at this: ``admission.plan_output`` plans what it sends and holds;
* the Responses API's ``max_output_tokens`` includes reasoning, like ``max_completion_tokens``;
* ``n`` (and ``best_of`` for completions) choices each get the full allowance;
* embeddings and context create produce no output tokens;
* images and video tasks bill output only, bounded by what the request asks for
  (:mod:`quotawrap.core.media`); classification answers one of its labels.

Bounding: ``max_tokens`` leaves reasoning to the model's own ceiling, so the guard may send the field
that bounds the whole output instead (``bounded``). Never beside ``max_tokens``: Ark refuses a request
with both (400 InvalidParameter "max_tokens and max_completion_tokens cannot be set at the same time"),
so ``bounded`` takes ``max_tokens`` out. Which request shape is sent and reserved how is
``admission.plan_output``'s; the allowance it learns from a model's settled calls is ``learned_allowance``.

A limit of 0 is treated as absent: what a server does with it is not documented, and reading it
as "no limit given" is the safe side.

Input estimate: tokens of every text the model reads, plus per-message template overhead; images
are a flat ``image_tokens`` each (Ark does not publish its formula, seed §9); any other part type
(video, audio, file, unknown) counts as the tokens of its JSON form, at least ``image_tokens``.
Not estimable offline: conversation state the server adds itself (``previous_response_id``).

A body of the wrong shape raises ``ValueError`` naming the offending field, and so does one that
asks for :data:`~quotawrap.core.usage.TOKEN_CEILING` tokens or more (``max_tokens`` 1e30, ``n`` 1e19):
no call can use that many, and no counter may be handed such a number.

Counting is cheap where it can be (``exact_above``): every text is first bounded by its UTF-8
bytes, which needs no tokenizer, and the tokenizers run only when that bound exceeds what the
caller can spare. Counting stops once the input passes ``stop_above`` (the call is refused anyway).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Final, Literal, get_args

from . import media
from .records import Record
from .tokens import count_tokens, utf8_bound
from .usage import MODEL_MAX_OUTPUT, MODEL_WINDOW, TOKEN_CEILING, UsageBound

__all__ = [
    "MAX_OUTPUT_TOKENS",
    "REASONING_RESERVES",
    "Estimate",
    "EstimateSettings",
    "Kind",
    "ReasoningReserve",
    "bound_field",
    "bounded",
    "bounded_output",
    "estimate_request",
    "learned_allowance",
    "output_allowance",
    "thinking_disabled",
    "unbounded_thinking",
    "usage_bound",
]

# Ark accepts max_completion_tokens in [0, 65536]: no model's whole output can be larger.
MAX_OUTPUT_TOKENS = 65_536

Kind = Literal["chat", "responses", "embeddings", "completions", "images", "video", "context", "classification"]
# What the guard reserves for a call that may think and bounds only its answer (max_tokens): see
# admission/room.py: plan_output and README "What the guard sends and reserves".
ReasoningReserve = Literal["ceiling", "learned", "cut"]
REASONING_RESERVES: Final[tuple[str, ...]] = get_args(ReasoningReserve)
Count = Callable[[str, str], int]


class EstimateSettings(Record, frozen=True):
    thinking_floor: int = 4096  # seed THINKING_RESERVE_FLOOR
    default_max_tokens: int = 4096  # Ark's default max_tokens when the request gives none
    image_tokens: int = 2000  # per image part, conservative (Ark doesn't publish its formula; seed §9)
    per_message_overhead: int = 4  # chat template tokens per message (role markers etc.)
    reply_priming: int = 3

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"EstimateSettings.{field.name} must be a non-negative integer, got {value!r}")


class Estimate(Record, frozen=True):
    input_tokens: int
    output_allowance: int

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_allowance


def thinking_disabled(body: Mapping[str, Any]) -> bool:
    """True only for an explicit ``thinking: {"type": "disabled"}``; anything else may think."""
    _check_body(body)
    return _thinking_off(body)


def _thinking_off(body: Mapping[str, Any]) -> bool:
    """:func:`thinking_disabled` of a body checked already (every guarded call asks, twice)."""
    thinking = body.get("thinking")
    # None (the usual case) short of the Mapping check: an ABC isinstance costs far more than an identity test
    return thinking is not None and isinstance(thinking, Mapping) and thinking.get("type") == "disabled"


def output_allowance(kind: Kind, body: Mapping[str, Any], settings: EstimateSettings = EstimateSettings()) -> int:
    """Most output tokens the request can be billed for (see the module docstring)."""
    _check_kind(kind)
    _check_body(body)
    return _output_allowance(kind, body, settings)


def _output_allowance(kind: Kind, body: Mapping[str, Any], settings: EstimateSettings) -> int:
    """:func:`output_allowance` of a kind and body checked already (:func:`estimate_request` checks them)."""
    if kind in ("embeddings", "context"):
        return 0
    if kind == "images":
        return media.image_count(body) * media.image_tokens_each(body)
    if kind == "video":
        return media.video_tokens(body)
    if kind == "classification":
        return _classification_allowance(body)
    if kind == "responses":
        bound = _limit(body, "max_output_tokens")
        return bound if bound is not None else _answer_plus_thinking(None, body, settings)
    bound = _limit(body, "max_completion_tokens")
    per_choice = bound if bound is not None else _answer_plus_thinking(_limit(body, "max_tokens"), body, settings)
    return per_choice * _choices(kind, body)


_BOUND_FIELDS: Final[Mapping[str, str]] = {"chat": "max_completion_tokens", "responses": "max_output_tokens"}


def bound_field(kind: Kind) -> str | None:
    """The request field that bounds reasoning and answer together, if the endpoint has one."""
    return _BOUND_FIELDS.get(kind)


def unbounded_thinking(kind: Kind, body: Mapping[str, Any]) -> bool:
    """Whether the model may think without any field bounding its whole output (reasoning + answer)."""
    _check_kind(kind)
    _check_body(body)
    field = bound_field(kind)
    return field is not None and _limit(body, field) is None and not _thinking_off(body)


def bounded(kind: Kind, body: Mapping[str, Any], allowance: int) -> dict[str, Any]:
    """The body with its whole output bounded at ``allowance`` tokens (per choice).

    Chat's ``max_tokens`` goes: Ark answers 400 to a request that sets it beside
    ``max_completion_tokens`` (docs/82379/1449737: "不可同时设置，会直接报错"; real answers quoted in
    HKUDS/nanobot#2548). The caller's dict is left as it was.
    """
    field = bound_field(kind)
    if field is None:
        raise ValueError(f"a {kind} request has no field bounding its output")
    if kind == "chat" and "max_tokens" in body:
        return {**{key: value for key, value in body.items() if key != "max_tokens"}, field: allowance}
    return {**body, field: allowance}


def bounded_output(kind: Kind, body: Mapping[str, Any], allowance: int) -> int:
    """``output_allowance(kind, bounded(kind, body, allowance))`` without building that body (every bounded
    call asks, twice): ``allowance`` (at least 1) per choice, times the choices where the field bounds each."""
    field = bound_field(kind)
    if field is None:
        raise ValueError(f"a {kind} request has no field bounding its output")
    _check_body(body)
    if isinstance(allowance, bool) or not isinstance(allowance, int) or not 1 <= allowance < TOKEN_CEILING:
        raise ValueError(f"an output bound must be a whole number of tokens from 1, got {allowance!r}")
    return allowance if kind == "responses" else allowance * _choices(kind, body)


def learned_allowance(outputs: Sequence[int], *, floor: int, ceiling: int = MAX_OUTPUT_TOKENS) -> int | None:
    """The output allowance a model's settled history asks for: its p99 output, within [floor, ceiling].

    ``outputs`` are whole outputs (completion tokens, reasoning included, as Ark reports them).
    Nearest-rank p99: with fewer than 100 calls that is the largest seen. None without history.
    """
    if not outputs:
        return None
    rank = max(1, -(-99 * len(outputs) // 100))  # ceil(0.99 n)
    # the (n - rank + 1)-th largest: a heap of 1% of the values, not a sort of all (every bounded call asks)
    return min(ceiling, max(floor, heapq.nlargest(len(outputs) - rank + 1, outputs)[-1]))


def estimate_request(
    kind: Kind,
    body: Mapping[str, Any],
    settings: EstimateSettings = EstimateSettings(),
    *,
    count: Count = count_tokens,
    exact_above: int = 0,
    stop_above: int | None = None,
) -> Estimate:
    """Pessimistic input tokens and output allowance of one request body.

    ``exact_above``: an input whose UTF-8 bound is at most this is estimated by that bound alone
    (no tokenizer). ``stop_above``: counting stops once the input exceeds it; the estimate is then
    a partial count, already above ``stop_above``.
    """
    _check_kind(kind)
    _check_body(body)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ValueError(f"'model' must be a string, got {_type_name(model)}")
    allowance = _output_allowance(kind, body, settings)
    estimator = _INPUT_ESTIMATORS[kind]
    input_tokens = None
    if exact_above > 0 and count is not _bytes:
        cheap = estimator(body, _Counter(model, settings, _bytes))
        if cheap <= exact_above:
            input_tokens = cheap
    if input_tokens is None:
        counter = _Counter(model, settings, count, stop_above)
        try:
            input_tokens = estimator(body, counter)
        except _Enough:
            input_tokens = counter.counted
    if input_tokens + allowance >= TOKEN_CEILING:
        raise ValueError(f"it asks for {input_tokens + allowance:,} tokens, more than any call can use")
    return Estimate(input_tokens=input_tokens, output_allowance=allowance)


def usage_bound(kind: Kind, body: Mapping[str, Any], estimate: Estimate) -> UsageBound:
    """The most usage a call of this request could report (see ``usage.check_usage``).

    Generous: the input as estimated, four times over (tokenizers differ; images and other
    parts are flat guesses), or a whole context window (the server may add conversation state);
    the output allowance, or each choice's most a model writes (reasoning is not bounded by
    ``max_tokens``). ``body`` must have passed :func:`estimate_request`.
    """
    prompt = max(4 * estimate.input_tokens, MODEL_WINDOW)
    completion = max(estimate.output_allowance, _choices(kind, body) * MODEL_MAX_OUTPUT)
    return UsageBound(prompt=min(prompt, TOKEN_CEILING), completion=min(completion, TOKEN_CEILING))


# -- output -------------------------------------------------------------------------------------


def _answer_plus_thinking(max_tokens: int | None, body: Mapping[str, Any], settings: EstimateSettings) -> int:
    answer = max_tokens if max_tokens is not None else settings.default_max_tokens
    if _thinking_off(body):  # the body was checked by whoever asks
        return answer
    # max_tokens bounds only the answer and nothing bounds reasoning, so the floor is the seed's
    # allowance for typical reasoning (§7.6: 167 billed for a 16-token answer), not a hard bound
    return max(answer, settings.thinking_floor)


def _limit(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    number = _whole_number(value, name)
    if number < 0:
        raise ValueError(f"'{name}' must not be negative, got {value!r}")
    return number or None


def _choices(kind: Kind, body: Mapping[str, Any]) -> int:
    names = ("n", "best_of") if kind == "completions" else ("n",)
    choices = 1
    for name in names:
        value = body.get(name)
        if value is not None:
            choices = max(choices, _whole_number(value, name))
    return choices


def _whole_number(value: object, name: str) -> int:
    # JSON decoders may hand over 16.0 for 16; a server would accept it, so must we
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{name}' must be an integer, got {value!r}")
    if value >= TOKEN_CEILING:
        raise ValueError(f"'{name}' {value:,} is more than any call can use")
    return value


# -- input --------------------------------------------------------------------------------------


def _bytes(_model: str, text: str) -> int:
    return utf8_bound(text)


class _Enough(Exception):
    """The input already exceeds ``stop_above``: counting the rest would change no decision."""


class _Counter:
    """Counts the pieces of one request with its model's tokenizer and the settings' flat rates."""

    def __init__(self, model: str, settings: EstimateSettings, count: Count, stop_above: int | None = None) -> None:
        self.model = model
        self.settings = settings
        self._count = count
        self._stop_above = stop_above
        self.counted = 0  # every token counted so far, flat rates included: a lower bound of the input

    def _tokens(self, text: str) -> int:
        if self._stop_above is None:
            return self._count(self.model, text)
        if self._count is count_tokens:  # the bundled counter can stop inside one long text
            tokens = count_tokens(self.model, text, stop_above=self._stop_above - self.counted)
        else:
            tokens = self._count(self.model, text)
        return self._add(tokens)

    def _add(self, tokens: int) -> int:
        self.counted += tokens
        if self._stop_above is not None and self.counted > self._stop_above:
            raise _Enough
        return tokens

    def text(self, value: object, where: str) -> int:
        if value is None:
            return 0
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {_type_name(value)}")
        return self._tokens(value) if value else 0

    def json(self, value: object, where: str) -> int:
        if value is None:
            return 0
        try:
            dumped = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"{where} is not JSON-serialisable: {exc}") from exc
        return self._tokens(dumped)

    def image(self) -> int:
        return self._add(self.settings.image_tokens)

    def opaque(self, part: object, where: str) -> int:
        # video/audio/file/unknown: nothing published to go by, so the larger of two safe guesses
        return max(self.settings.image_tokens, self.json(part, where))

    @property
    def per_message(self) -> int:
        return self.settings.per_message_overhead

    @property
    def reply_priming(self) -> int:
        return self.settings.reply_priming


_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "summary_text", "reasoning_text"})
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def _content_tokens(content: object, counter: _Counter, where: str) -> int:
    """String content, or a list of typed parts (chat and Responses API share part shapes)."""
    if content is None:
        return 0
    if isinstance(content, str):
        return counter.text(content, where)
    parts = _as_list(content, where, "a string or a list of content parts")
    return sum(_part_tokens(part, counter, f"{where}[{index}]") for index, part in enumerate(parts))


def _part_tokens(part: object, counter: _Counter, where: str) -> int:
    if isinstance(part, str):
        return counter.text(part, where)
    item = _as_mapping(part, where)
    kind = item.get("type")
    if not isinstance(kind, str):
        kind = None  # an unhashable "type" (a list, an object) is an unknown part, not a crash
    if kind in _TEXT_PARTS:
        return counter.text(item.get("text"), f"{where}.text")
    if kind == "refusal":
        return counter.text(item.get("refusal"), f"{where}.refusal")
    if kind in _IMAGE_PARTS:
        return counter.image()
    return counter.opaque(item, where)


def _chat_input(body: Mapping[str, Any], counter: _Counter) -> int:
    messages = _as_list(_required(body, "messages"), "'messages'", "a list of messages")
    total = sum(_chat_message_tokens(message, counter, f"messages[{i}]") for i, message in enumerate(messages))
    for name, where in _CHAT_EXTRAS:
        value = body.get(name)
        if value is not None:  # what counter.json counts 0, without the call
            total += counter.json(value, where)
    return total + counter.reply_priming


_CHAT_EXTRAS = (("tools", "'tools'"), ("functions", "'functions'"), ("response_format", "'response_format'"))


def _chat_message_tokens(message: object, counter: _Counter, where: str) -> int:
    entry = _as_mapping(message, where)
    total = counter.per_message
    for field, count in _MESSAGE_FIELDS:
        value = entry.get(field)
        if value is not None:
            total += count(value, counter, f"{where}.{field}")
    tool_calls = entry.get("tool_calls")
    if tool_calls is not None:
        for index, call in enumerate(_as_list(tool_calls, f"{where}.tool_calls", "a list")):
            call_where = f"{where}.tool_calls[{index}]"
            total += _function_call_tokens(_as_mapping(call, call_where).get("function"), counter, call_where)
    return total


def _function_call_tokens(call: object, counter: _Counter, where: str) -> int:
    if call is None:
        return 0
    entry = _as_mapping(call, where)
    return counter.text(entry.get("name"), f"{where}.name") + _arguments_tokens(
        entry.get("arguments"), counter, f"{where}.arguments"
    )


def _arguments_tokens(arguments: object, counter: _Counter, where: str) -> int:
    # the API sends arguments as a JSON string, but some clients pass the decoded object
    if arguments is None or isinstance(arguments, str):
        return counter.text(arguments, where)
    return counter.json(arguments, where)


def _text_tokens(value: object, counter: _Counter, where: str) -> int:
    return counter.text(value, where)


# A message's fields, each with how it counts: an absent one counts 0 and cannot be malformed, so the place an
# error would name is formatted only for a field present, not for every field of every message on every call.
_MESSAGE_FIELDS: tuple[tuple[str, Callable[[object, _Counter, str], int]], ...] = (
    ("content", _content_tokens),
    ("name", _text_tokens),
    ("reasoning_content", _text_tokens),
    ("function_call", _function_call_tokens),
)


def _responses_input(body: Mapping[str, Any], counter: _Counter) -> int:
    total = 0
    instructions = body.get("instructions")
    if instructions is not None:
        total += counter.per_message + counter.text(instructions, "'instructions'")
    given = _required(body, "input")
    if isinstance(given, str):
        total += counter.per_message + counter.text(given, "'input'")
    else:
        items = _as_list(given, "'input'", "a string or a list of input items")
        total += sum(_responses_item_tokens(item, counter, f"input[{i}]") for i, item in enumerate(items))
    for name in ("tools", "text"):  # "text" carries the structured-output JSON schema
        total += counter.json(body.get(name), f"'{name}'")
    return total + counter.reply_priming


def _responses_item_tokens(item: object, counter: _Counter, where: str) -> int:
    entry = _as_mapping(item, where)
    kind = entry.get("type", "message")  # EasyInputMessage has role and content but no type
    total = counter.per_message
    if kind == "message":
        return total + _content_tokens(entry.get("content"), counter, f"{where}.content")
    if kind == "function_call":
        return total + _function_call_tokens(entry, counter, where)
    if kind == "function_call_output":
        output = entry.get("output")
        return total + _content_tokens(output, counter, f"{where}.output")
    if kind == "reasoning":
        summary = _as_list(entry.get("summary") or [], f"{where}.summary", "a list")
        return total + sum(_part_tokens(part, counter, f"{where}.summary[{i}]") for i, part in enumerate(summary))
    return total + counter.opaque(entry, where)


def _embeddings_input(body: Mapping[str, Any], counter: _Counter) -> int:
    return _prompt_tokens(_required(body, "input"), counter, "'input'")


def _completions_input(body: Mapping[str, Any], counter: _Counter) -> int:
    total = _prompt_tokens(_required(body, "prompt"), counter, "'prompt'")
    return total + counter.text(body.get("suffix"), "'suffix'")


def _prompt_tokens(prompt: object, counter: _Counter, where: str) -> int:
    """A string, token ids, or a list of strings / token-id lists / content parts."""
    if isinstance(prompt, str):
        return counter.text(prompt, where)
    items = _as_list(prompt, where, "a string or a list")
    if items and all(_is_token_id(item) for item in items):
        return len(items)  # one pre-tokenised input
    return sum(_prompt_item_tokens(item, counter, f"{where}[{i}]") for i, item in enumerate(items))


def _prompt_item_tokens(item: object, counter: _Counter, where: str) -> int:
    if isinstance(item, str):
        return counter.text(item, where)
    if isinstance(item, Mapping):  # Ark's multimodal embeddings take content parts
        return _part_tokens(item, counter, where)
    ids = _as_list(item, where, "a string, a list of token ids or a content part")
    if not all(_is_token_id(token) for token in ids):
        raise ValueError(f"{where} must be a list of integer token ids")
    return len(ids)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_input(body: Mapping[str, Any], counter: _Counter) -> int:
    return 0  # images and videos bill what they generate, not the prompt


def _context_input(body: Mapping[str, Any], counter: _Counter) -> int:
    messages = _as_list(_required(body, "messages"), "'messages'", "a list of messages")
    total = sum(_chat_message_tokens(message, counter, f"messages[{i}]") for i, message in enumerate(messages))
    return total + counter.reply_priming


def _classification_input(body: Mapping[str, Any], counter: _Counter) -> int:
    return counter.text(_required(body, "query"), "'query'") + counter.json(body.get("labels"), "'labels'") + 16


def _classification_allowance(body: Mapping[str, Any]) -> int:
    # the answer is one label: never longer than all of them spelled out, in bytes
    labels = body.get("labels")
    return len(json.dumps(labels, ensure_ascii=False).encode()) + 16 if labels is not None else 64


_INPUT_ESTIMATORS: Mapping[str, Callable[[Mapping[str, Any], _Counter], int]] = {
    "chat": _chat_input,
    "responses": _responses_input,
    "embeddings": _embeddings_input,
    "completions": _completions_input,
    "images": _no_input,
    "video": _no_input,
    "context": _context_input,
    "classification": _classification_input,
}


# -- shape checks -------------------------------------------------------------------------------


_KINDS = frozenset(get_args(Kind))


def _check_kind(kind: object) -> None:
    if kind not in _KINDS:
        raise ValueError(f"unknown request kind {kind!r}; expected one of {', '.join(get_args(Kind))}")


def _check_body(body: object) -> None:
    # A body is json.loads' dict: `type(...) is dict` first spares the far dearer ABC isinstance
    if type(body) is not dict and not isinstance(body, Mapping):
        raise ValueError(f"request body must be a JSON object, got {_type_name(body)}")


def _required(body: Mapping[str, Any], name: str) -> object:
    if body.get(name) is None:
        raise ValueError(f"request body has no '{name}'")
    return body[name]


def _as_list(value: object, where: str, expected: str) -> Sequence[object]:
    if type(value) is list:  # json.loads' lists: the three ABC checks below would all pass it
        return value
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{where} must be {expected}, got {_type_name(value)}")
    return value if isinstance(value, Sequence) else list(value)


def _as_mapping(value: object, where: str) -> Mapping[str, Any]:
    if type(value) is not dict and not isinstance(value, Mapping):  # a dict first: see _check_body
        raise ValueError(f"{where} must be a JSON object, got {_type_name(value)}")
    return value


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__
