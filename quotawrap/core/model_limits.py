"""What bounds a model's output on Ark, per model: data with a source per entry, and a lookup. Pure.

On Ark a request that sets ``max_tokens`` (or none, Ark's default 4,096) bounds only the answer;
reasoning has its own quota, exclusive, up to the model's longest chain of thought
(最大思维链内容长度), after which the model stops. So such a request is billed at most
``max_tokens + reasoning ceiling`` output tokens (深度思考, 附2 工作原理 "仅配置 max_tokens":
https://www.volcengine.com/docs/82379/1449737). ``max_completion_tokens`` instead bounds reasoning and
answer together, in [0, 65536], and cannot be sent beside ``max_tokens`` (Ark answers 400).

Ark states lengths in k of 1,024 tokens ("32k (32768)" in the same page), so 32k is 32,768.

A model the table does not know gets :data:`UNKNOWN_REASONING_CEILING`, the largest ceiling any
documented model has: its real ceiling is unknown, and reserving less could let the provider bill
past the hold. Entries are matched like prices (:func:`quotawrap.core.prices.longest_prefix`): the id
itself, else the longest key it starts with at a ``-`` (``doubao-seed-1-6`` covers
``doubao-seed-1-6-flash-250828``, whose page gives the same 32k).
"""

from __future__ import annotations

from typing import Final, NamedTuple

from .prices import longest_prefix, normalize_model

__all__ = ["BUNDLED_LIMITS", "UNKNOWN_REASONING_CEILING", "ModelLimits", "limits_for", "reasoning_ceiling"]

# A copy of Ark's documentation (volcengine.com/docs/82379), synced 2025-12-19.
_DOCS: Final = (
    "https://github.com/Hajimi-Commune/VolcanoArkDocs/blob/98e1d9a7486856f69f110d5f87c270bee4fd6b4a/"
    "docs/火山方舟大模型服务平台/模型介绍/"
)
_LIST: Final = "https://www.volcengine.com/docs/82379/1330310 (模型列表, 深度思考能力: 最大思维链长度)"
_K: Final = 1024


class ModelLimits(NamedTuple):  # not a Record: the table is built at import, which builds no record
    """One model id (or id prefix): the longest chain of thought it writes, and where that is written."""

    model: str
    reasoning_ceiling: int  # tokens of reasoning at most, outside max_tokens; 0: the model does not reason
    source: str


def _doc(model: str, ceiling: int, page: str) -> ModelLimits:
    return ModelLimits(model, ceiling, f"{_LIST}; model page {_DOCS}{page}")


BUNDLED_LIMITS: Final[tuple[ModelLimits, ...]] = (
    _doc("deepseek-r1", 32 * _K, "其他模型/deepseek-r1.md"),
    _doc("deepseek-v3-1", 32 * _K, "推荐模型/deepseek-v3.1.md"),
    _doc("deepseek-v3-2", 32 * _K, "推荐模型/deepseek-v3.2.md"),
    # the one deepseek-v3 version documented: 最大思维链内容长度 不涉及 (it does not reason)
    _doc("deepseek-v3-250324", 0, "其他模型/deepseek-v3.md"),
    # 1.6, -flash, -lite, -vision and -thinking: each page says 32k
    _doc("doubao-seed-1-6", 32 * _K, "推荐模型/doubao-seed-1.6.md (and -flash, -lite, -vision, -thinking .md)"),
    _doc("doubao-seed-1-8", 64 * _K, "推荐模型/doubao-seed-1.8.md"),
    _doc("doubao-seed-code", 32 * _K, "推荐模型/doubao-seed-code.md"),
    _doc("doubao-1-5-thinking-pro", 32 * _K, "其他模型/doubao-1.5-thinking-pro.md"),
    _doc("doubao-1-5-thinking-vision-pro", 32 * _K, "其他模型/doubao-1.5-thinking-vision-pro.md"),
    _doc("doubao-1-5-vision-pro", 32 * _K, "其他模型/doubao-1.5-vision-pro.md"),
    _doc("doubao-1-5-ui-tars", 32 * _K, "其他模型/doubao-1.5-ui-tars.md"),
    ModelLimits(
        "doubao-seed-evolving",
        256 * _K,
        "context 1024k, CoT 256k, output 256k: a secondary summary of Ark's 2026 model page (not the page itself)",
    ),
)

#: The ceiling of a model the table does not know: the largest documented (see the module docstring).
UNKNOWN_REASONING_CEILING: Final = max(entry.reasoning_ceiling for entry in BUNDLED_LIMITS)

_BY_KEY: Final = {normalize_model(entry.model): entry for entry in BUNDLED_LIMITS}
_found: dict[str, ModelLimits | None] = {}  # by model as asked: every guarded call that may think asks


def limits_for(model: str) -> ModelLimits | None:
    """The table's entry for ``model``, or None when it has none."""
    try:
        return _found[model]
    except KeyError:
        pass
    key = longest_prefix(normalize_model(model), _BY_KEY)
    found = None if key is None else _BY_KEY[key]
    if len(_found) >= 1024:  # model ids come from requests: a bounded memory
        _found.clear()
    _found[model] = found
    return found


def reasoning_ceiling(model: str) -> int:
    """The most reasoning tokens a call to ``model`` that sets no ``max_completion_tokens`` can be billed for."""
    found = limits_for(model)
    return UNKNOWN_REASONING_CEILING if found is None else found.reasoning_ceiling
