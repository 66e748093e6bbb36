"""How many tokens a simulated call costs: the simulator counts usage itself, deterministically.

prompt (chat)      = sum over messages of (tokens of its text parts + 1000 per image) + 3 per message + 3
prompt (responses) = the same over `instructions` (as a system message) and the input items
prompt (embedding) = sum of the tokens of each input
answer             = min(reply_tokens, max_tokens)
reasoning          = reasoning_tokens, or 0 when the body says thinking: {"type": "disabled"}
max_completion_tokens / max_output_tokens cap reasoning + answer together, reasoning first
                     (Ark refuses max_tokens beside max_completion_tokens; in lenient mode the latter wins)
completion         = reasoning + answer;  total = prompt + completion
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..core.records import Record

__all__ = [
    "IMAGE_TOKENS",
    "MESSAGE_OVERHEAD",
    "REPLY_OVERHEAD",
    "Plan",
    "chat_prompt_tokens",
    "count_text",
    "embedding_prompt_tokens",
    "plan_generation",
    "responses_prompt_tokens",
    "text_prompt_tokens",
    "thinking_disabled",
]

MESSAGE_OVERHEAD = 3
REPLY_OVERHEAD = 3
IMAGE_TOKENS = 1000
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


@functools.lru_cache(maxsize=1)
def _project_counter() -> Callable[[str, str], int] | None:
    # quotawrap.core.tokens is written in parallel; until it exists the byte heuristic stands in.
    try:
        from ..core.tokens import count_tokens  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return count_tokens  # type: ignore[no-any-return,unused-ignore]


def count_text(model: str, text: str) -> int:
    """Tokens in `text` for `model`: quotawrap's tokenizer if importable, else bytes // 4 + 1."""
    counter = _project_counter()
    if counter is not None:
        try:
            return int(counter(model, text))
        except Exception:  # a tokenizer bug must not take the simulator down
            pass
    return len(text.encode()) // 4 + 1


def _content_tokens(model: str, content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return count_text(model, content)
    if isinstance(content, list):
        tokens = 0
        for part in content:
            if isinstance(part, str):
                tokens += count_text(model, part)
            elif isinstance(part, dict):
                kind = part.get("type")
                if kind in _IMAGE_PART_TYPES:
                    tokens += IMAGE_TOKENS
                elif kind in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
                    tokens += count_text(model, part["text"])
        return tokens
    return count_text(model, str(content))


def chat_prompt_tokens(model: str, messages: list[Any]) -> int:
    """Prompt tokens of a chat request's `messages`."""
    tokens = REPLY_OVERHEAD
    for message in messages:
        tokens += MESSAGE_OVERHEAD
        if isinstance(message, dict):
            tokens += _content_tokens(model, message.get("content"))
    return tokens


def responses_prompt_tokens(model: str, input_: Any, instructions: Any = None) -> int:
    """Prompt tokens of a Responses request: `input` is a string or a list of messages/items."""
    items: list[Any] = []
    if isinstance(instructions, str) and instructions:
        items.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        items.append({"role": "user", "content": input_})
    elif isinstance(input_, list):
        items.extend(input_)
    tokens = REPLY_OVERHEAD
    for item in items:
        tokens += MESSAGE_OVERHEAD
        if isinstance(item, dict):
            if "content" in item:
                tokens += _content_tokens(model, item["content"])
            elif isinstance(item.get("output"), str):  # function_call_output and friends
                tokens += count_text(model, item["output"])
            elif isinstance(item.get("arguments"), str):
                tokens += count_text(model, item["arguments"])
        elif isinstance(item, str):
            tokens += count_text(model, item)
    return tokens


def embedding_prompt_tokens(model: str, input_: Any) -> int:
    """Tokens of an embeddings `input` (a string, a list of strings, or token-id lists)."""
    return sum(_one_input_tokens(model, one) for one in _as_list(input_))


def text_prompt_tokens(model: str, prompt: Any) -> int:
    """Tokens of a legacy completions `prompt`."""
    return embedding_prompt_tokens(model, prompt)


def _as_list(input_: Any) -> list[Any]:
    if isinstance(input_, list) and input_ and all(isinstance(x, int) for x in input_):
        return [input_]  # one pre-tokenised input
    return input_ if isinstance(input_, list) else [input_]


def _one_input_tokens(model: str, one: Any) -> int:
    if isinstance(one, list):
        return len(one)
    return count_text(model, one if isinstance(one, str) else str(one))


def thinking_disabled(body: dict[str, Any]) -> bool:
    """True when the request turns the model's thinking off (Ark's `thinking: {type: disabled}`)."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") == "disabled"


class Plan(Record, frozen=True):
    """The usage one generation will produce (and be billed for)."""

    prompt_tokens: int
    reasoning_tokens: int
    answer_tokens: int
    truncated: bool  # a cap cut the answer short: finish_reason "length"

    @property
    def completion_tokens(self) -> int:
        return self.reasoning_tokens + self.answer_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def finish_reason(self) -> str:
        return "length" if self.truncated else "stop"


def plan_generation(
    prompt_tokens: int,
    *,
    reply_tokens: int,
    reasoning_tokens: int,
    max_tokens: int | None = None,
    max_total: int | None = None,
) -> Plan:
    """Apply the caps: `max_tokens` bounds the answer; `max_total` bounds reasoning + answer."""
    reasoning = reasoning_tokens
    answer = reply_tokens
    if max_total is not None:
        reasoning = min(reasoning, max_total)
        answer = min(answer, max_total - reasoning)
    elif max_tokens is not None:
        answer = min(answer, max_tokens)
    truncated = answer < reply_tokens or reasoning < reasoning_tokens
    return Plan(prompt_tokens, reasoning, answer, truncated)
