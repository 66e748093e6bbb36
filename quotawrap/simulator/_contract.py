"""Ark's request validation as data: each rule the simulator enforces, Ark's answer to it, and its source. Pure.

`RULES` is the one source. The checks below raise its rows' errors, `render_markdown` writes the table
in docs/ark-contract.md, and tests/unit/test_ark_contract.py sends each row's example request to a
running simulator and compares the answer with the row. Labels: SEEN = a real Ark answer (an issue, a
captured body, a probe report) shows it; DOC = Ark's documentation says it; inferred = neither, and
the simulator picks the safe side (refuse what Ark may refuse).

Strict mode (the default) enforces every row. Lenient mode (`SimConfig.strict = False`) keeps only
the rows marked `lenient`, which the simulator needs to plan an answer at all, and accepts any model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any, Final

from ..core.endpoint_prices import IMAGE_PRICES, MEDIA_PRICES
from ..core.prices import BUNDLED_PRICES
from ..core.records import Record
from ._config import SimConfig

__all__ = [
    "CHAT_ROLES",
    "KNOWN_FAMILIES",
    "MISSING_MESSAGE",
    "REASONING_EFFORTS",
    "RULES",
    "ArkError",
    "Rule",
    "check_chat",
    "check_count",
    "check_messages",
    "check_required",
    "check_thinking",
    "render_markdown",
    "served_model",
    "status_type",
]

_STATUS_TYPES: Final = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    429: "TooManyRequests",
    500: "InternalServerError",
}


def status_type(status: int) -> str:
    """Ark's error `type` for an HTTP status (the status name, per Ark's error table)."""
    return _STATUS_TYPES.get(status, "InternalServerError")


class ArkError(Exception):
    """An answer in Ark's error shape; the server adds the request id to the message."""

    def __init__(self, status: int, code: str, message: str, param: str = "") -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.param = param


class Rule(Record, frozen=True):
    """One thing Ark refuses, and how: `message` and `param` are templates over the request's values."""

    key: str
    rule: str  # what is refused, in words
    status: int
    code: str
    param: str
    message: str
    label: str  # SEEN, DOC or inferred (for the message and param as the simulator writes them)
    source: str
    example: Mapping[str, Any] | None = None  # a request body that breaks the rule (None: no example)
    values: Mapping[str, Any] = field(default_factory=dict)  # the templates' values for `example`
    path: str = "/chat/completions"
    enforced: bool = True  # False: known, written down, not enforced (see `note`)
    lenient: bool = False  # enforced in lenient mode too
    with_key: bool = True  # the example is sent with an API key
    note: str = ""

    @property
    def type(self) -> str:
        return status_type(self.status)

    def error(self, **values: Any) -> ArkError:
        """This rule's answer to a request with these values."""
        return ArkError(self.status, self.code, self.message.format(**values), self.param.format(**values))

    def expected(self) -> ArkError:
        """The answer to this rule's own example."""
        return self.error(**self.values)


# Model id families the simulator serves, matched as "family" or "family-<anything>": every model the
# bundled price tables know, and Ark's embedding models (SEEN: doubao-embedding-text-240715,
# doubao-embedding-large-text-240915, doubao-embedding-vision-250615), which quotawrap prices by default.
KNOWN_FAMILIES: Final[tuple[str, ...]] = tuple(
    sorted(
        {price.model for price in BUNDLED_PRICES}
        | {price.model for price in MEDIA_PRICES}
        | set(IMAGE_PRICES)
        | {"doubao-embedding"}
    )
)
CHAT_ROLES: Final = ("system", "assistant", "user", "tool")
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_GRADED_EFFORTS: Final = frozenset({"low", "medium", "high", "xhigh", "max"})
_THINKING_TYPES: Final = frozenset({"enabled", "disabled", "auto"})
# Models whose thinking cannot be turned off (doc: 强制开启深度思考，不可关闭).
_THINKING_FORCED: Final = ("doubao-seed-1-6-thinking",)
MAX_COMPLETION_TOKENS: Final = 65536

_HELLO: Final = [{"role": "user", "content": "hi"}]
_MODEL: Final = "doubao-seed-1-6-250615"

_PARAM_INVALID: Final = "The parameter `{name}` specified in the request are not valid: "
_ABOVE: Final = _PARAM_INVALID + "{kind} above maximum value, expected a value <= {limit}, but got {value} instead."
_BELOW: Final = _PARAM_INVALID + "{kind} below minimum value, expected a value >= {limit}, but got {value} instead."
_NOT_FOUND: Final = "The model or endpoint {model} does not exist or you do not have access to it."
_UNSUPPORTED_THINKING: Final = "Unsupported thinking type for the current model: {type}"
MISSING_MESSAGE: Final = "The request failed because it is missing one or multiple required parameters."

_DOC_ERRORS: Final = "https://www.volcengine.com/docs/82379/1299023 (公共错误码)"
_DOC_CHAT: Final = "https://www.volcengine.com/docs/82379/1494384 (对话(Chat) API)"
_DOC_THINKING: Final = "https://www.volcengine.com/docs/82379/1449737 (深度思考)"
_PROBE: Final = (
    "a live probe report of ark-code-latest on /api/coding/v3 (2026, answers summarised) "
    "quoted in public code found by code search (repository not recorded)"
)
_QUOTED: Final = "quoted in public code found by code search (repository not recorded)"
_OH_MY_PI: Final = "https://github.com/can1357/oh-my-pi/pull/9610 (live probe, 2026-08-24)"


def _range_rules(
    name: str, kind: str, low: int, high: int | None, labels: tuple[str, str], source: str, note: str = ""
) -> tuple[Rule, ...]:
    """The rows of a bounded number: below its minimum, and above its maximum when it has one."""
    rows = []
    for key, limit, template, label in (("below", low, _BELOW, labels[0]), ("above", high, _ABOVE, labels[1])):
        if limit is None:
            continue
        value = limit - 5 if key == "below" else limit + 3
        rows.append(
            Rule(
                key=f"{name}_{key}",
                rule=f"`{name}` {key} {limit}",
                status=400,
                code="InvalidParameter",
                param="{name}",
                message=template,
                label=label,
                source=source,
                example={"model": _MODEL, "messages": _HELLO, name: value},
                values={"name": name, "kind": kind, "limit": limit, "value": value},
                lenient=kind == "integer" and key == "below",  # the simulator cannot plan a negative bound
                note=note,
            )
        )
    return tuple(rows)


# Ranges Ark documents (对话(Chat) API); the wording of the answer is SEEN for the integer bounds and
# for temperature above 2, and applied to the other fields by analogy.
_DECIMALS: Final[Mapping[str, tuple[int, int]]] = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "frequency_penalty": (-2, 2),
    "presence_penalty": (-2, 2),
}

RULES: Final[Mapping[str, Rule]] = {
    rule.key: rule
    for rule in (
        Rule(
            key="auth_missing",
            rule="no API key (`Authorization: Bearer ...`)",
            status=401,
            code="AuthenticationError",
            param="",
            message="The API key or AK/SK in the request is missing or invalid.",
            label="SEEN",
            source=f"{_DOC_ERRORS}; a live 401 body {_QUOTED}",
            example={"model": _MODEL, "messages": _HELLO},
            with_key=False,
            lenient=True,
        ),
        Rule(
            key="model_missing",
            rule="`model` missing",
            status=400,
            code="MissingParameter",
            param="{name}",
            message=MISSING_MESSAGE,
            label="DOC",
            source=f"{_DOC_ERRORS}; param inferred",
            example={"messages": _HELLO},
            values={"name": "model"},
            lenient=True,
        ),
        Rule(
            key="model_unknown",
            rule="a model id Ark does not serve (or not in this account): unknown, misspelt, or in another case",
            status=404,
            code="InvalidEndpointOrModel.NotFound",
            param="",
            message=_NOT_FOUND,
            label="SEEN",
            source=(
                "https://github.com/cloudwego/eino/issues/107 (doubao-1.5-pro-32k), "
                "https://github.com/CherryHQ/cherry-studio/issues/3389 (DeepSeek-R1)"
            ),
            example={"model": "doubao-seed-9-9-990101", "messages": _HELLO},
            values={"model": "doubao-seed-9-9-990101"},
            note="known: the bundled price table's families, `--model`, and `--endpoint` ids",
        ),
        Rule(
            key="endpoint_unknown",
            rule="an endpoint id (`ep-...`) that does not exist",
            status=404,
            code="InvalidEndpointOrModel.NotFound",
            param="",
            message=_NOT_FOUND,
            label="SEEN",
            source=f"{_DOC_ERRORS} (the message names 'model or endpoint'); bodies as for unknown models",
            example={"model": "ep-20250101000000-nope", "messages": _HELLO},
            values={"model": "ep-20250101000000-nope"},
        ),
        Rule(
            key="messages_missing",
            rule="`messages` missing",
            status=400,
            code="MissingParameter",
            param="{name}",
            message=MISSING_MESSAGE,
            label="SEEN",
            source=f"{_PROBE} (code); {_DOC_ERRORS} (message); param inferred",
            example={"model": _MODEL},
            values={"name": "messages"},
            lenient=True,
        ),
        Rule(
            key="messages_not_list",
            rule="`messages` not a list of objects",
            status=400,
            code="InvalidParameter",
            param="messages",
            message=_PARAM_INVALID + "expected a list of object, but got `{value}` instead.",
            label="SEEN",
            source=f"a log of Ark answers {_QUOTED}; param inferred",
            example={"model": _MODEL, "messages": "hi"},
            values={"name": "messages", "value": '"hi"'},
            lenient=True,
        ),
        Rule(
            key="messages_empty",
            rule="`messages` an empty list",
            status=400,
            code="InvalidParameter",
            param="messages",
            message=_PARAM_INVALID + "expected a non-empty list of object.",
            label="inferred",
            source="none found: the simulator refuses a call with nothing to answer",
            example={"model": _MODEL, "messages": []},
            values={"name": "messages"},
            lenient=True,
        ),
        Rule(
            key="role_invalid",
            rule="a message `role` other than system, assistant, user, tool (e.g. OpenAI's `developer`)",
            status=400,
            code="InvalidParameter",
            param="",
            message=_PARAM_INVALID
            + "invalid value: `{role}`, supported values are: `system`, `assistant`, `user`, `tool`.",
            label="SEEN",
            source=(f"{_OH_MY_PI}; the full body from the Agent Plan endpoint (2026-09-04) {_QUOTED}"),
            example={"model": _MODEL, "messages": [{"role": "developer", "content": "be brief"}, *_HELLO]},
            values={"name": "messages.role", "role": "developer"},
        ),
        Rule(
            key="both_bounds",
            rule="`max_tokens` together with `max_completion_tokens`",
            status=400,
            code="InvalidParameter",
            param="max_tokens",
            message=_PARAM_INVALID + "max_tokens and max_completion_tokens cannot be set at the same time.",
            label="SEEN",
            source=(
                "https://github.com/HKUDS/nanobot/issues/2548, https://github.com/Tencent/WeKnora/issues/3014; "
                f"{_DOC_THINKING} (不可同时设置，会直接报错)"
            ),
            example={"model": _MODEL, "messages": _HELLO, "max_tokens": 64, "max_completion_tokens": 50000},
            values={"name": "max_tokens"},
        ),
        Rule(
            key="count_not_integer",
            rule="a token bound (`max_tokens`, `max_completion_tokens`, `max_output_tokens`) not an integer",
            status=400,
            code="InvalidParameter",
            param="{name}",
            message=_PARAM_INVALID + "expected an integer, but got `{value}` instead.",
            label="inferred",
            source="wording of the SEEN type errors (embeddings `input[0]`: 'expected a string, but got ...')",
            example={"model": _MODEL, "messages": _HELLO, "max_tokens": "64"},
            values={"name": "max_tokens", "value": '"64"'},
            lenient=True,
        ),
        *_range_rules(
            "max_tokens",
            "integer",
            0,
            None,
            ("SEEN", ""),
            f"{_PROBE} (max_tokens -5); wording and param as https://github.com/Gitlawb/openclaude/issues/331",
        ),
        *_range_rules(
            "max_completion_tokens",
            "integer",
            0,
            MAX_COMPLETION_TOKENS,
            ("inferred", "SEEN"),
            f"{_DOC_CHAT} (取值范围 [0, 65536]); the full body of an above-maximum answer "
            "https://github.com/Gitlawb/openclaude/issues/331 (below: the same wording, inferred)",
            note="Ark's maximum is per model (12288 SEEN on doubao-1-5-pro-32k); the simulator uses the documented one",
        ),
        *(
            rule
            for name, (low, high) in _DECIMALS.items()
            for rule in _range_rules(
                name,
                "decimal",
                low,
                high,
                ("inferred", "SEEN" if name == "temperature" else "inferred"),
                f"{_DOC_CHAT} (range); "
                + (
                    f"{_PROBE} (temperature 5: 'decimal above maximum value, expected a value <= 2'); "
                    "the rest as the integer bounds"
                    if name == "temperature"
                    else "wording as temperature's"
                ),
            )
        ),
        Rule(
            key="stream_options_without_stream",
            rule="`stream_options` set while `stream` is not true",
            status=400,
            code="InvalidParameter",
            param="stream_options",
            message=_PARAM_INVALID + "stream_options can only be set when stream is true.",
            label="inferred",
            source=(
                f"{_DOC_CHAT} (当 stream 为 true 时，可设置 stream_options); Ark's answer not seen: "
                "code, param and message inferred (OpenAI refuses it with 400 too)"
            ),
            example={"model": _MODEL, "messages": _HELLO, "stream_options": {"include_usage": True}},
            values={"name": "stream_options"},
        ),
        Rule(
            key="thinking_type_unknown",
            rule="`thinking.type` other than enabled, disabled, auto",
            status=400,
            code="InvalidParameter",
            param="",
            message=_UNSUPPORTED_THINKING,
            label="SEEN",
            source=f"{_OH_MY_PI}; https://github.com/CherryHQ/cherry-studio/issues/7508 (wording); param inferred",
            example={"model": _MODEL, "messages": _HELLO, "thinking": {"type": "adaptive"}},
            values={"type": "adaptive"},
        ),
        Rule(
            key="thinking_auto_unsupported",
            rule="`thinking.type` auto on a model without auto (all but `thinking_auto_models`)",
            status=400,
            code="InvalidParameter",
            param="",
            message=_UNSUPPORTED_THINKING,
            label="SEEN",
            source=f"{_OH_MY_PI}; https://github.com/anomalyco/models.dev/pull/5518 (11 of 12 models); {_DOC_THINKING}",
            example={"model": "deepseek-v3-2-251201", "messages": _HELLO, "thinking": {"type": "auto"}},
            values={"type": "auto"},
        ),
        Rule(
            key="thinking_disabled_unsupported",
            rule="`thinking.type` disabled on a model that always thinks (doubao-seed-1-6-thinking-*)",
            status=400,
            code="InvalidParameter",
            param="",
            message=_UNSUPPORTED_THINKING,
            label="SEEN",
            source="https://github.com/CherryHQ/cherry-studio/issues/7508, /7593; param inferred",
            example={
                "model": "doubao-seed-1-6-thinking-250715",
                "messages": _HELLO,
                "thinking": {"type": "disabled"},
            },
            values={"type": "disabled"},
        ),
        Rule(
            key="reasoning_effort_invalid",
            rule=f"`reasoning_effort` not one of {', '.join(REASONING_EFFORTS)}",
            status=400,
            code="InvalidParameter",
            param="reasoning_effort",
            message=_PARAM_INVALID + "value `{value}` is invalid.",
            label="SEEN",
            source="https://github.com/anomalyco/models.dev/pull/5564 (accepted set); a coding-plan answer "
            f"{_QUOTED} (wording); param inferred",
            example={"model": _MODEL, "messages": _HELLO, "reasoning_effort": "disabled"},
            values={"name": "reasoning_effort", "value": "disabled"},
        ),
        Rule(
            key="reasoning_effort_thinking_disabled",
            rule="a graded `reasoning_effort` (low to max) with `thinking.type` disabled",
            status=400,
            code="InvalidParameter",
            param="",
            message="Invalid combination of reasoning_effort and thinking type: {effort} + disabled",
            label="SEEN",
            source=(
                "https://github.com/RooCodeInc/Roo-Code/issues/11395, https://github.com/agno-agi/agno/pull/9804; "
                f"{_DOC_THINKING}; code and param inferred"
            ),
            example={
                "model": _MODEL,
                "messages": _HELLO,
                "reasoning_effort": "high",
                "thinking": {"type": "disabled"},
            },
            values={"effort": "high"},
        ),
        Rule(
            key="reasoning_only_params",
            rule="`logprobs`, `top_logprobs`, `logit_bias` or `n` > 1 on a call that may think",
            status=400,
            code="InvalidParameter",
            param="",
            message="Reasoning model does not support n > 1, logit_bias, logprobs, top_logprobs",
            label="SEEN",
            source=(
                f"{_PROBE}; a litellm capture on doubao-seed-1-8-251228 and a note that it happens whenever "
                f"thinking is not disabled, both {_QUOTED}; {_DOC_CHAT}; param inferred"
            ),
            example={"model": _MODEL, "messages": _HELLO, "logprobs": True},
            note="Ark judges by model; the simulator treats every call that does not disable thinking as reasoning",
        ),
        # Known, not enforced: written down so nobody relies on the simulator for them.
        Rule(
            key="model_without_version",
            rule="a model family name without its version date (`doubao-seed-1-6`)",
            status=404,
            code="InvalidEndpointOrModel.NotFound",
            param="",
            message=_NOT_FOUND,
            label="SEEN",
            source=(
                f"a live 404 for doubao-seed-1-6 {_QUOTED}; "
                "https://github.com/anomalyco/opencode/pull/45992 (doubao-seed-2.1-pro)"
            ),
            enforced=False,
            note=(
                "the simulator serves a price-table family name as is (the demo's `deepseek-v4-flash`); "
                "whether Ark serves undated DeepSeek-V4 ids is unknown"
            ),
        ),
        Rule(
            key="max_tokens_model_ceiling",
            rule="`max_tokens` above the model's own answer ceiling",
            status=400,
            code="InvalidParameter",
            param="max_tokens",
            message=_ABOVE,
            label="SEEN",
            source="https://github.com/langgenius/dify/issues/14376 (<= 4096 on deepseek-r1, 2025-02)",
            enforced=False,
            note="ceilings differ per model and change over time (model pages: 16k to 32k); not tabulated",
        ),
        Rule(
            key="stop_on_thinking",
            rule="`stop` on a thinking model; more than 4 stop strings",
            status=400,
            code="InvalidParameter",
            param="stop",
            message="unknown",
            label="DOC",
            source=f"{_DOC_CHAT} (深度思考能力模型不支持 stop; 最多 4 个)",
            enforced=False,
            note=f"{_OH_MY_PI} saw `stop` accepted (200): the documentation and the service disagree",
        ),
        Rule(
            key="model_not_open",
            rule="a model the account has not activated",
            status=404,
            code="ModelNotOpen",
            param="",
            message="Your account {account} has not activated the model {model}. "
            "Please activate the model service in the Ark Console.",
            label="SEEN",
            source="https://github.com/xinnan-tech/xiaozhi-esp32-server/issues/1234",
            enforced=False,
            note="no accounts in the simulator; `x-sim-fault: error_400` with `x-sim-error-code` stands in",
        ),
        Rule(
            key="input_too_long",
            rule="input longer than the model's maximum input (最大输入长度)",
            status=400,
            code="unknown",
            param="",
            message="unknown",
            label="DOC",
            source=f"{_DOC_THINKING} (超过最大输入长度直接报错)",
            enforced=False,
            note="the answer's code and wording are not documented or seen",
        ),
    )
}


def _show(value: Any) -> str:
    """A request value as Ark quotes it in a message: numbers bare (5, 2.5), anything else as JSON."""
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return json.dumps(value, ensure_ascii=False)


def _is_family(model: str, families: Iterable[str]) -> bool:
    return any(model == family or model.startswith(family + "-") for family in families)


def served_model(model: str, cfg: SimConfig, *, bot: bool = False) -> str:
    """The model that answers a request naming `model`, and is billed for it.

    An endpoint id serves its foundation model; in strict mode any other id must be a known family
    (or, on the bots path, a bot id), else Ark's 404.
    """
    endpoint = cfg.endpoint_model(model)
    if endpoint is not None:
        return endpoint
    if not cfg.strict or (bot and model.startswith("bot-")):
        return model
    if _is_family(model, KNOWN_FAMILIES) or _is_family(model, cfg.models):
        return model
    raise RULES["endpoint_unknown" if model.startswith("ep-") else "model_unknown"].error(model=model)


def check_required(body: Mapping[str, Any], name: str) -> Any:
    """A parameter the request must carry (absent, null and "" are missing)."""
    value = body.get(name)
    if value is None or value == "":
        raise RULES.get(f"{name}_missing", RULES["model_missing"]).error(name=name)
    return value


def check_count(body: Mapping[str, Any], name: str, cfg: SimConfig, high: int | None = None) -> int | None:
    """A token bound of the request: None when absent, else a whole number within [0, high]."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RULES["count_not_integer"].error(name=name, value=_show(value))
    if value < 0:
        below = RULES.get(f"{name}_below", RULES["max_tokens_below"])
        raise below.error(name=name, kind="integer", limit=0, value=value)
    if high is not None and value > high and cfg.strict:
        above = RULES.get(f"{name}_above", RULES["max_completion_tokens_above"])
        raise above.error(name=name, kind="integer", limit=high, value=value)
    return value


def check_messages(body: Mapping[str, Any], cfg: SimConfig) -> list[dict[str, Any]]:
    """The request's `messages`: a non-empty list of objects, each (strict) with one of Ark's roles."""
    messages = check_required(body, "messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RULES["messages_not_list"].error(name="messages", value=_show(messages))
    if not messages:
        raise RULES["messages_empty"].error(name="messages")
    if cfg.strict:
        for message in messages:
            role = message.get("role")
            if role is not None and role not in CHAT_ROLES:
                raise RULES["role_invalid"].error(name="messages.role", role=role)
    return messages


def _thinking_type(body: Mapping[str, Any]) -> Any:
    thinking = body.get("thinking")
    return thinking.get("type") if isinstance(thinking, Mapping) else None


def check_thinking(body: Mapping[str, Any], model: str, cfg: SimConfig) -> None:
    """`thinking` and `reasoning_effort` as the model accepts them (strict mode only)."""
    if not cfg.strict:
        return
    kind = _thinking_type(body)
    if kind is not None:
        if not isinstance(kind, str) or kind not in _THINKING_TYPES:
            raise RULES["thinking_type_unknown"].error(type=kind)
        if kind == "auto" and not _is_family(model, cfg.thinking_auto_models):
            raise RULES["thinking_auto_unsupported"].error(type=kind)
        if kind == "disabled" and _is_family(model, _THINKING_FORCED):
            raise RULES["thinking_disabled_unsupported"].error(type=kind)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise RULES["reasoning_effort_invalid"].error(name="reasoning_effort", value=effort)
        if kind == "disabled" and effort in _GRADED_EFFORTS:
            raise RULES["reasoning_effort_thinking_disabled"].error(effort=effort)


def _check_decimals(body: Mapping[str, Any]) -> None:
    for name, (low, high) in _DECIMALS.items():
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # absent, null, or a type the simulator does not judge
        if value < low:
            raise RULES[f"{name}_below"].error(name=name, kind="decimal", limit=_show(low), value=_show(value))
        if value > high:
            raise RULES[f"{name}_above"].error(name=name, kind="decimal", limit=_show(high), value=_show(value))


def _reasoning_only(body: Mapping[str, Any]) -> bool:
    n = body.get("n")
    return (
        body.get("logprobs") is True
        or body.get("top_logprobs") is not None
        or bool(body.get("logit_bias"))
        or (isinstance(n, int) and not isinstance(n, bool) and n > 1)
    )


def check_chat(body: Mapping[str, Any], model: str, cfg: SimConfig) -> tuple[int | None, int | None]:
    """Validate a chat request for `model` (the served model); returns (max_tokens, max_completion_tokens)."""
    max_tokens = check_count(body, "max_tokens", cfg)
    max_completion_tokens = check_count(body, "max_completion_tokens", cfg, MAX_COMPLETION_TOKENS)
    if not cfg.strict:
        return max_tokens, max_completion_tokens
    if max_tokens is not None and max_completion_tokens is not None:
        raise RULES["both_bounds"].error(name="max_tokens")
    _check_decimals(body)
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise RULES["stream_options_without_stream"].error(name="stream_options")
    check_thinking(body, model, cfg)
    if _thinking_type(body) != "disabled" and _reasoning_only(body):
        raise RULES["reasoning_only_params"].error()
    return max_tokens, max_completion_tokens


# -- the table as markdown --------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _answer(rule: Rule) -> str:
    if not rule.enforced:
        return f"{rule.status} `{rule.code}`"
    error = rule.expected()
    return f"{error.status} `{error.code}`, param `{json.dumps(error.param)}`, type `{rule.type}`"


def render_markdown(rules: Iterable[Rule] | None = None) -> str:
    """The rules as two markdown tables (enforced, then known but not enforced), as docs/ark-contract.md has them."""
    rows = list(RULES.values() if rules is None else rules)
    enforced = [
        "| rule | request (example) | Ark answers | message (then ` Request id: <id>`) | label | lenient | source |",
        "|---|---|---|---|---|---|---|",
    ]
    known = ["| rule | Ark answers | message | label | source | why not enforced |", "|---|---|---|---|---|---|"]
    for rule in rows:
        if rule.enforced:
            example = json.dumps(rule.example, ensure_ascii=False, separators=(",", ":"))
            request = f"`{'POST ' + rule.path}` `{_cell(example)}`" + ("" if rule.with_key else " (no key)")
            enforced.append(
                f"| {_cell(rule.rule)} | {request} | {_answer(rule)} | {_cell(rule.expected().message)} "
                f"| {rule.label} | {'yes' if rule.lenient else 'no'} | {_cell(rule.source)} |"
            )
        else:
            known.append(
                f"| {_cell(rule.rule)} | {_answer(rule)} | {_cell(rule.message)} | {rule.label} "
                f"| {_cell(rule.source)} | {_cell(rule.note)} |"
            )
    return "\n".join([*enforced, "", "Known, not enforced:", "", *known]) + "\n"
