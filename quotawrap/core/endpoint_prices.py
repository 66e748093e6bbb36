"""What calls to Ark's non-chat endpoints cost: per image, per video token, plugin fees, batch. Pure.

The token price table (:mod:`quotawrap.core.prices`) prices chat-like calls. Some endpoints are
billed differently, and :class:`CostRule` says how, per call:

* ``images`` (Seedream): per generated image; the reserve prices every image the request may make;
* ``video_task`` (Seedance): per million output tokens, priced by the token table, which
  :func:`with_media_prices` extends with Seedance models;
* ``bot_chat``: tokens, plus each plugin call (``bot_usage.action_usage``) at its fee; the
  reserve adds :data:`PLUGIN_CALL_ALLOWANCE` calls at the dearest fee;
* ``batch_chat`` / ``batch_embeddings``: tokens at :data:`BATCH_DISCOUNT` of the online price
  (Ark: "50% off or even lower", so half is the most it costs);
* ``context`` (context cache create): input tokens, plus storage for the requested ``ttl``
  (per token-hour; Ark refreshes the ttl on each use, which no single call can know).

Every figure here is a transcription not checked against Ark's live price page, so the
costs they give are flagged ``estimated``; a toml ``[prices]`` entry for a Seedance model
still replaces the bundled one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from decimal import Decimal
from typing import Any, Final

from .estimate import Estimate
from .prices import Cost, ModelPrice, PriceTable, Tier, UnknownPrice, normalize_model
from .records import Record
from .usage import Usage

__all__ = [
    "BATCH_DISCOUNT",
    "CONTEXT_STORAGE_PER_MILLION_HOUR",
    "IMAGE_PRICES",
    "MEDIA_PRICES",
    "PLUGIN_CALL_ALLOWANCE",
    "PLUGIN_FEES",
    "CostRule",
    "with_media_prices",
]

_SOURCE: Final = (
    "estimate, unverified: Ark 模型服务价格 https://www.volcengine.com/docs/82379/1544106 as recalled "
    "2026-11-30, not checked against the live page"
)
_AS_OF: Final = "2026-11-30"

# CNY per generated image, by model id prefix (longest prefix wins).
IMAGE_PRICES: Final[Mapping[str, Decimal]] = {
    "doubao-seedream-3-0-t2i": Decimal("0.259"),
    "doubao-seededit-3-0-i2i": Decimal("0.30"),
    "doubao-seedream-4-0": Decimal("0.20"),
    "doubao-seedream-4-5": Decimal("0.25"),
}


def _per_token(model: str, cny_per_million: str) -> ModelPrice:
    price = Decimal(cny_per_million)
    return ModelPrice(model, (Tier(None, price, price, price),), _SOURCE, _AS_OF, estimated=True)


# Seedance bills output tokens only; input = output price keeps any odd input honest.
MEDIA_PRICES: Final[tuple[ModelPrice, ...]] = (
    _per_token("doubao-seedance-1-0-pro", "15.00"),
    _per_token("doubao-seedance-1-0-pro-fast", "4.20"),
    _per_token("doubao-seedance-1-0-lite", "10.00"),
    _per_token("doubao-seedance-1-5-pro", "16.00"),
)

# CNY per plugin call of a bot (bot_usage.action_usage[].name).
PLUGIN_FEES: Final[Mapping[str, Decimal]] = {"web_search": Decimal("0.006")}
PLUGIN_CALL_ALLOWANCE: Final = 5
BATCH_DISCOUNT: Final = Decimal("0.5")
CONTEXT_STORAGE_PER_MILLION_HOUR: Final = Decimal("0.017")
_DEFAULT_CONTEXT_TTL_S: Final = 86400
_BATCH_ENDPOINTS: Final = frozenset({"batch_chat", "batch_embeddings"})
_NO_FEES: Final = Decimal(0)


def with_media_prices(table: PriceTable) -> PriceTable:
    """The table with Seedance's token prices added beneath its own entries (the toml still wins)."""
    return replace(table, prices=MEDIA_PRICES + tuple(table.prices), default=table.default or table.fallback)


def _image_price(table: PriceTable, model: str) -> tuple[Decimal, bool]:
    key = normalize_model(model)
    best = ""
    for prefix in IMAGE_PRICES:
        if (key == prefix or key.startswith(prefix + "-")) and len(prefix) > len(best):
            best = prefix
    if best:
        return IMAGE_PRICES[best], True
    if table.unknown_price == "error":
        raise UnknownPrice(model)
    return max(IMAGE_PRICES.values()), True


def _micro(amount_cny: Decimal) -> int:
    return math.ceil(amount_cny * 1_000_000)


class CostRule(Record, frozen=True):
    """How one call is priced, fixed when it is reserved (from its endpoint and request)."""

    endpoint: str
    images: int = 0  # images: how many the request may make
    storage_hours: int = 0  # context: hours of storage the ttl asks for

    @classmethod
    def for_request(cls, endpoint: str, request: Mapping[str, Any], estimate: Estimate) -> CostRule:
        if endpoint == "images":
            from .media import image_count

            return cls(endpoint, images=image_count(request))
        if endpoint == "context":
            ttl = request.get("ttl")
            seconds = ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0 else _DEFAULT_CONTEXT_TTL_S
            return cls(endpoint, storage_hours=math.ceil(seconds / 3600))
        # Every other endpoint's rule is its name alone: one frozen instance each, not one per call (the
        # guard's memory of reserve costs then finds it by identity, without comparing records)
        rule = _BY_ENDPOINT.get(endpoint)
        if rule is None:
            rule = _BY_ENDPOINT[endpoint] = cls(endpoint)
        return rule

    def reserve(self, table: PriceTable, model: str, estimate: Estimate) -> Cost:
        """The most the call can cost, in micro-CNY."""
        if self.endpoint == "images":
            price, estimated = _image_price(table, model)
            return Cost(_micro(price * self.images), estimated=estimated)
        cost = table.reserve_cost(model, estimate.input_tokens, estimate.output_allowance)
        return self._adjust(cost, estimate.input_tokens, max(PLUGIN_FEES.values()) * PLUGIN_CALL_ALLOWANCE)

    def actual(self, table: PriceTable, model: str, usage: Usage) -> Cost:
        """What the settled call cost, in micro-CNY."""
        if self.endpoint == "images" and (usage.images or not usage.total_tokens):
            price, estimated = _image_price(table, model)
            return Cost(_micro(price * usage.images), estimated=estimated)
        cost = table.actual_cost(model, usage)
        fees = _NO_FEES
        for name, calls in usage.actions:
            fees += PLUGIN_FEES.get(name, max(PLUGIN_FEES.values())) * calls
        return self._adjust(cost, usage.prompt_tokens, fees)

    def _adjust(self, cost: Cost, input_tokens: int, plugin_fees: Decimal) -> Cost:
        flagged = cost.estimated
        micro = int(cost)
        if self.endpoint in _BATCH_ENDPOINTS:
            micro = math.ceil(micro * BATCH_DISCOUNT)
            flagged = True
        elif self.endpoint == "bot_chat":
            micro += _micro(plugin_fees)
            flagged = flagged or plugin_fees > 0
        elif self.endpoint == "context":
            micro += math.ceil(input_tokens * self.storage_hours * CONTEXT_STORAGE_PER_MILLION_HOUR)
            flagged = True
        else:
            return cost  # as the table priced it (the same amount and flag, without a new Cost per settle)
        return Cost(micro, estimated=flagged)


_BY_ENDPOINT: dict[str, CostRule] = {}  # endpoints are the router's few labels
