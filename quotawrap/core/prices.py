"""What a call costs in money: a versioned CNY price table for Ark models, pure and exact.

Prices are CNY per million tokens (input, cached input, output), in tiers chosen by the
request's input length as Ark prices its doubao-seed models. A cost is a :class:`Cost`, an
``int`` of micro-CNY (1e-6 CNY): integers add exactly and atomically in any ledger, and a
per-million price times a token count *is* micro-CNY, so the only rounding is one ceiling
per call (never in the caller's favour).

Unknown prices are never zero. Policy ``"conservative"`` (the default) prices an unpriced
model at the table's default: ``[prices.default]`` from ``quotawrap.toml`` when given, else
the highest input and output prices of the bundled table with no cache discount; the
resulting cost is flagged ``estimated=True``. Policy ``"error"`` raises :class:`UnknownPrice`.
Costs priced from an entry marked as an unverified estimate are flagged the same way.

The bundled table is data (:data:`BUNDLED_PRICES`) with a source and date per entry. No I/O
here: :func:`load_overrides` takes the already-parsed ``[prices]`` table of quotawrap.toml.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import field, replace
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from .errors import ConfigError, UnknownPrice
from .identity import canonical
from .money import UNKNOWN_PRICE_POLICIES, Cost, UnknownPricePolicy, micro_cny
from .records import Record
from .usage import Usage

__all__ = [
    "BUNDLED_AS_OF",
    "BUNDLED_PRICES",
    "BUNDLED_SOURCE",
    "UNKNOWN_PRICE_POLICIES",
    "Cost",
    "ModelPrice",
    "PriceTable",
    "Tier",
    "UnknownPrice",
    "UnknownPricePolicy",
    "conservative_default",
    "load_overrides",
    "longest_prefix",
    "normalize_model",
]


# --------------------------------------------------------------------------- data model


class Tier(Record, frozen=True):
    """Prices (CNY per million tokens) for requests whose input is at most ``max_input_tokens``.

    ``None`` means no upper bound. Ark additionally discounts the output of short answers in the
    first tier of doubao-seed-1.6 and -1.6-lite: when the output is at most
    ``short_output_max_tokens`` the output price is ``short_output``. Only settled costs use that
    discount; a reservation cannot know the answer will be short.
    """

    max_input_tokens: int | None
    input: Decimal
    cached_input: Decimal
    output: Decimal
    short_output_max_tokens: int | None = None
    short_output: Decimal | None = None

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output"):
            _check_price(getattr(self, name), name)
        if self.max_input_tokens is not None and self.max_input_tokens <= 0:
            raise ValueError(f"max_input_tokens must be positive, got {self.max_input_tokens}")
        if (self.short_output_max_tokens is None) != (self.short_output is None):
            raise ValueError("short_output and short_output_max_tokens go together")
        if self.short_output is not None:
            _check_price(self.short_output, "short_output")

    def output_price(self, output_tokens: int) -> Decimal:
        if self.short_output is not None and output_tokens <= (self.short_output_max_tokens or 0):
            return self.short_output
        return self.output


class ModelPrice(Record, frozen=True):
    """The price of one model id (or id prefix), with where it came from and when."""

    model: str
    tiers: tuple[Tier, ...]
    source: str
    as_of: str
    estimated: bool = False  # not a verified list price: costs from it are flagged estimated

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError(f"{self.model}: a price needs at least one tier")
        bounds = [tier.max_input_tokens for tier in self.tiers]
        if None in bounds[:-1]:
            raise ValueError(f"{self.model}: only the last tier may be unbounded")
        finite = [bound for bound in bounds if bound is not None]
        if finite != sorted(set(finite)):
            raise ValueError(f"{self.model}: tiers must be in strictly increasing max_input_tokens")

    def tier_for(self, input_tokens: int) -> Tier:
        """The tier that prices a request with this many input tokens.

        Beyond the last bound the last (dearest) tier applies: the provider would reject or
        price such a request higher, never lower.
        """
        for tier in self.tiers:
            if tier.max_input_tokens is None or input_tokens <= tier.max_input_tokens:
                return tier
        return self.tiers[-1]


def _check_price(value: object, name: str) -> None:
    if not isinstance(value, Decimal) or not value.is_finite() or value < 0:
        raise ValueError(f"{name} must be a finite non-negative Decimal, got {value!r}")


# --------------------------------------------------------------------------- bundled table

BUNDLED_AS_OF: Final = "2026-11-30"  # when the table below was compiled; each entry has its own date
_ARK_PRICING_PAGE: Final = "https://www.volcengine.com/docs/82379/1544106"
_ARK_TRANSCRIPT: Final = (
    f"Ark 模型服务价格 {_ARK_PRICING_PAGE}, per-model price tables as transcribed in "
    "github.com/Hajimi-Commune/VolcanoArkDocs (captured 2025-12-18)"
)
_ARK_AS_OF: Final = "2025-12-18"
_LOBEHUB: Final = (
    "estimate, unverified: Ark prices as listed by github.com/lobehub/lobehub "
    "packages/model-bank/src/aiModels/volcengine.ts, not checked against Ark's own page"
)
BUNDLED_SOURCE: Final = (
    f"Volcano Engine Ark list prices (online inference, pay per token): {_ARK_PRICING_PAGE}; "
    "DeepSeek-V4 entries are unverified estimates"
)

_K: Final = 1000  # Ark states tier bounds in 千 token (thousands), so 32k is 32,000
_SHORT_ANSWER: Final = 200  # "输出长度 [0, 0.2]" (thousand tokens)


def _tier(
    max_input_tokens: int | None,
    input: str,
    cached_input: str,
    output: str,
    short_output: str | None = None,
) -> Tier:
    return Tier(
        max_input_tokens,
        Decimal(input),
        Decimal(cached_input),
        Decimal(output),
        short_output_max_tokens=_SHORT_ANSWER if short_output is not None else None,
        short_output=Decimal(short_output) if short_output is not None else None,
    )


def _flat(input: str, cached_input: str, output: str) -> tuple[Tier, ...]:
    return (_tier(None, input, cached_input, output),)


def _seed(
    input: tuple[str, str, str], cached: str, output: tuple[str, str, str], short: str | None = None
) -> tuple[Tier, ...]:
    """A doubao-seed-1.6 style ladder: ≤32k, ≤128k, beyond (Ark's last band is (128k, 256k])."""
    return (
        _tier(32 * _K, input[0], cached, output[0], short),
        _tier(128 * _K, input[1], cached, output[1]),
        _tier(None, input[2], cached, output[2]),
    )


def _ark(model: str, tiers: tuple[Tier, ...]) -> ModelPrice:
    return ModelPrice(model, tiers, _ARK_TRANSCRIPT, _ARK_AS_OF)


def _unverified(model: str, tiers: tuple[Tier, ...], note: str, as_of: str) -> ModelPrice:
    return ModelPrice(model, tiers, f"{_LOBEHUB}; {note}", as_of, estimated=True)


# Keys are Ark model ids without their date suffix, matched by longest prefix; see normalize_model.
# Cached input is Ark's 缓存命中 price; where Ark has no cache for a model it equals the input price.
BUNDLED_PRICES: Final[tuple[ModelPrice, ...]] = (
    _ark("deepseek-v3", _flat("2.00", "0.40", "8.00")),
    _ark("deepseek-v3-1", _flat("4.00", "0.80", "12.00")),
    _ark(
        "deepseek-v3-2",
        (_tier(32 * _K, "2.00", "0.40", "3.00"), _tier(None, "4.00", "0.40", "6.00")),
    ),
    _ark("deepseek-r1", _flat("4.00", "0.80", "16.00")),
    _unverified(
        "deepseek-v4",
        _flat("12.00", "1.00", "27.00"),
        "family fallback for any DeepSeek-V4 id: the dearest of v4-pro-260425 (12/1/24) and "
        "v4-pro-ga-260813 (9/0.3/27)",
        "2026-08-13",
    ),
    _unverified("deepseek-v4-pro", _flat("12.00", "1.00", "24.00"), "deepseek-v4-pro-260425", "2026-04-24"),
    _unverified("deepseek-v4-pro-ga", _flat("9.00", "0.30", "27.00"), "deepseek-v4-pro-ga-260813", "2026-08-13"),
    _unverified(
        "deepseek-v4-flash",
        _flat("1.00", "0.20", "2.00"),
        "deepseek-v4-flash-260425 and deepseek-v4-flash-ga-260731 (listed at the same price)",
        "2026-08-13",
    ),
    _ark("doubao-seed-1-6", _seed(("0.80", "1.20", "2.40"), "0.16", ("8.00", "16.00", "24.00"), short="2.00")),
    _ark("doubao-seed-1-6-thinking", _seed(("0.80", "1.20", "2.40"), "0.16", ("8.00", "16.00", "24.00"))),
    _ark("doubao-seed-1-6-vision", _seed(("0.80", "1.20", "2.40"), "0.16", ("8.00", "16.00", "24.00"))),
    _ark("doubao-seed-1-6-flash", _seed(("0.15", "0.30", "0.60"), "0.03", ("1.50", "3.00", "6.00"))),
    _ark("doubao-seed-1-6-lite", _seed(("0.30", "0.60", "1.20"), "0.06", ("2.40", "4.00", "12.00"), short="0.60")),
    _ark("doubao-1-5-pro-32k", _flat("0.80", "0.16", "2.00")),
    _ark("doubao-1-5-lite", _flat("0.30", "0.30", "0.60")),  # no context cache (不涉及)
)


def conservative_default(prices: Iterable[ModelPrice]) -> ModelPrice:
    """The fallback for unpriced models: the dearest input and output seen anywhere, no cache discount."""
    tiers = [tier for price in prices for tier in price.tiers]
    if not tiers:
        raise ValueError("a conservative default needs at least one priced model")
    dearest_input = max(tier.input for tier in tiers)
    dearest_output = max(tier.output for tier in tiers)
    return ModelPrice(
        "default",
        (Tier(None, dearest_input, dearest_input, dearest_output),),
        "conservative default: the highest input and output prices of the price table",
        BUNDLED_AS_OF,
        estimated=True,
    )


# --------------------------------------------------------------------------- the table


_UNSEEN: Final = object()


def normalize_model(model: str) -> str:
    """Ark writes versions both ways (doubao-seed-1.6, doubao-seed-1-6-250615): compare in one form, the
    model's identity (``identity.canonical``) with dots and underscores as dashes."""
    return canonical(model).replace(".", "-").replace("_", "-")


def longest_prefix(key: str, keys: Collection[str]) -> str | None:
    """``key`` itself when ``keys`` has it, else the longest of ``keys`` that ``key`` starts with at a ``-``
    (both normalized): Ark ids carry date or variant suffixes, and the boundary keeps ``doubao-seed-1-6``
    from matching a ``doubao-seed-1-60``."""
    if key in keys:
        return key
    best: str | None = None
    for candidate in keys:
        if key.startswith(candidate + "-") and (best is None or len(candidate) > len(best)):
            best = candidate
    return best


class PriceTable(Record, frozen=True):
    """Model prices by id with longest-prefix lookup, a default, and an unknown-price policy."""

    prices: tuple[ModelPrice, ...] = BUNDLED_PRICES
    default: ModelPrice | None = None  # explicit price for unpriced models; None derives a conservative one
    unknown_price: UnknownPricePolicy = "conservative"
    version: str = f"bundled-{BUNDLED_AS_OF}"  # recorded with costs, so a report says which table priced it
    _by_key: Mapping[str, ModelPrice] = field(init=False, repr=False, compare=False)
    _fallback: ModelPrice = field(init=False, repr=False, compare=False)
    # price_for's answers by model as asked: pure in the (frozen) table, and every reserve and settle asks
    _found: dict[str, ModelPrice | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.unknown_price not in UNKNOWN_PRICE_POLICIES:
            raise ConfigError(
                f"unknown-price policy must be one of {', '.join(UNKNOWN_PRICE_POLICIES)}, got {self.unknown_price!r}"
            )
        by_key = {normalize_model(price.model): price for price in self.prices}  # later entries win
        object.__setattr__(self, "_by_key", by_key)
        fallback = self.default or conservative_default(self.prices or BUNDLED_PRICES)
        object.__setattr__(self, "_fallback", fallback)
        object.__setattr__(self, "_found", {})

    @property
    def fallback(self) -> ModelPrice:
        """What an unpriced model is charged under the conservative policy."""
        return self._fallback

    def price_for(self, model: str) -> ModelPrice | None:
        """The exact id's price, else the longest table key that ``model`` starts with at a ``-``.

        Ark ids carry date or variant suffixes (deepseek-v3-1-250821, doubao-seed-1-6-flash-250828);
        the boundary rule keeps ``doubao-seed-1-6`` from matching a ``doubao-seed-1-60``.
        """
        found = self._found.get(model, _UNSEEN)
        if found is _UNSEEN:
            found = self._price_for(model)
            if len(self._found) >= 1024:  # model ids come from requests: a bounded memory
                self._found.clear()
            self._found[model] = found
        return found  # type: ignore[return-value]

    def _price_for(self, model: str) -> ModelPrice | None:
        key = longest_prefix(normalize_model(model), self._by_key)
        return None if key is None else self._by_key[key]

    def resolve(self, model: str) -> ModelPrice:
        """The price that will be charged for ``model``, applying the unknown-price policy."""
        found = self.price_for(model)
        if found is not None:
            return found
        if self.unknown_price == "error":
            raise UnknownPrice(model)
        return self._fallback

    def reserve_cost(self, model: str, estimate_input_tokens: int, output_allowance: int) -> Cost:
        """The most a request can cost: tier by estimated input, all input uncached, full output price."""
        _check_count(estimate_input_tokens, "estimate_input_tokens")
        _check_count(output_allowance, "output_allowance")
        price = self.resolve(model)
        tier = price.tier_for(estimate_input_tokens)
        micro = micro_cny([(estimate_input_tokens, tier.input), (output_allowance, tier.output)])
        return Cost(micro, estimated=price.estimated)

    def actual_cost(self, model: str, usage: Usage) -> Cost:
        """What a settled call cost: uncached input + cached input at its price + all output.

        Reasoning tokens are part of ``completion_tokens`` and billed as output. Should a usage
        report a total above prompt + completion (reasoning counted outside completion), the
        difference is billed as output too, so nothing billed goes uncounted.
        """
        prompt = max(usage.prompt_tokens, 0)
        cached = min(max(usage.cached_tokens, 0), prompt)
        output = max(usage.completion_tokens, usage.total_tokens - prompt, 0)
        price = self.resolve(model)
        tier = price.tier_for(prompt)
        micro = micro_cny(
            [(prompt - cached, tier.input), (cached, tier.cached_input), (output, tier.output_price(output))]
        )
        return Cost(micro, estimated=price.estimated)

    def with_overrides(
        self,
        prices: Sequence[ModelPrice],
        *,
        default: ModelPrice | None = None,
        unknown_price: UnknownPricePolicy | None = None,
        version: str | None = None,
    ) -> PriceTable:
        """A new table: these prices replace same-keyed ones, a given default replaces the default."""
        return PriceTable(
            tuple(self.prices) + tuple(prices),
            default=default or self.default,
            unknown_price=unknown_price or self.unknown_price,
            version=version or self.version,
        )


def _check_count(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


# --------------------------------------------------------------------------- quotawrap.toml

_PRICE_KEYS: Final = frozenset({"input", "cached_input", "output", "short_output", "short_output_max_tokens"})
_ENTRY_KEYS: Final = _PRICE_KEYS | {"tiers", "source", "as_of", "like"}
_DEFAULT_KEYS: Final = frozenset({"input", "cached_input", "output", "source", "as_of"})
_POLICY_KEY: Final = "unknown_price"


def load_overrides(
    data: Mapping[str, Any],
    *,
    base: PriceTable | None = None,
    unknown_price: UnknownPricePolicy | None = None,
) -> PriceTable:
    """The bundled table (or ``base``) with the parsed ``[prices]`` table of quotawrap.toml applied.

    Accepted shapes, all prices in CNY per million tokens::

        [prices]
        unknown_price = "error"            # or "conservative" (the default)

        [prices."ep-20250601-abcde"]       # an endpoint id priced like a known model
        like = "doubao-seed-1-6"

        [prices."deepseek-v3-1"]
        input = 4.0
        cached_input = 0.8                 # optional: defaults to input (no discount assumed)
        output = 12.0

        [prices."doubao-seed-1-6"]
        tiers = [
          {max_input_tokens = 32000, input = 0.8, cached_input = 0.16, output = 8.0,
           short_output_max_tokens = 200, short_output = 2.0},
          {max_input_tokens = 128000, input = 1.2, cached_input = 0.16, output = 16.0},
          {input = 2.4, cached_input = 0.16, output = 24.0},
        ]

        [prices.default]                   # price for any model the table does not know
        input = 4.0
        output = 16.0

    ``unknown_price`` (from ``--unknown-price``) overrides the toml key. Policy ``"error"``
    raises for unpriced models even when ``[prices.default]`` is given. Any malformed entry is a
    :class:`ConfigError` naming it.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"[prices] must be a table, got {_type_name(data)}")
    table = base or PriceTable()
    policy = unknown_price
    if policy is None and _POLICY_KEY in data:
        policy = data[_POLICY_KEY]
    if policy is not None and policy not in UNKNOWN_PRICE_POLICIES:
        choices = ", ".join(UNKNOWN_PRICE_POLICIES)
        raise ConfigError(f"[prices] unknown_price must be one of {choices}, got {policy!r}")
    default: ModelPrice | None = None
    overrides: list[ModelPrice] = []
    for model, raw in data.items():
        if model == _POLICY_KEY:
            continue
        where = f"[prices.{json.dumps(model, ensure_ascii=False)}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a table, got {_type_name(raw)}")
        if model == "default":
            default = _default_price(raw, where)
        else:
            overrides.append(_model_price(model, raw, where, table))
    if not overrides and default is None and policy is None:
        return table
    return table.with_overrides(
        overrides, default=default, unknown_price=policy, version=f"{table.version}+toml-{_digest(data)}"
    )


def _model_price(model: str, raw: Mapping[str, Any], where: str, table: PriceTable) -> ModelPrice:
    _reject_unknown_keys(raw, _ENTRY_KEYS, where)
    source = _text(raw.get("source", "quotawrap.toml"), f"{where} source")
    as_of = _text(raw.get("as_of", ""), f"{where} as_of")
    if "like" in raw:
        if len(raw.keys() - {"like", "source", "as_of"}) > 0:
            raise ConfigError(f"{where}: 'like' copies another model's prices and takes no prices of its own")
        target = _text(raw["like"], f"{where} like")
        found = table.price_for(target)
        if found is None:
            raise ConfigError(f"{where}: like = {target!r} names no priced model")
        note = f"priced like {found.model} ({found.source})"
        return replace(found, model=model, source=note if "source" not in raw else source, as_of=as_of or found.as_of)
    if "tiers" in raw:
        if raw.keys() & _PRICE_KEYS:
            raise ConfigError(f"{where}: give either 'tiers' or flat prices, not both")
        tiers_raw = raw["tiers"]
        if isinstance(tiers_raw, (str, bytes, Mapping)) or not isinstance(tiers_raw, Sequence) or not tiers_raw:
            raise ConfigError(f"{where} tiers must be a non-empty list of tables")
        tiers = tuple(
            _tier_from(entry, f"{where} tiers[{index}]", tiered=True) for index, entry in enumerate(tiers_raw)
        )
    else:
        tiers = (_tier_from(raw, where, tiered=False),)
    try:
        return ModelPrice(model, tiers, source, as_of)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _tier_from(raw: object, where: str, *, tiered: bool) -> Tier:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a table, got {_type_name(raw)}")
    if tiered:
        _reject_unknown_keys(raw, _PRICE_KEYS | {"max_input_tokens"}, where)
    for required in ("input", "output"):
        if required not in raw:
            raise ConfigError(f"{where} needs '{required}' (CNY per million tokens)")
    input_price = _price(raw["input"], f"{where} input")
    cached = _price(raw["cached_input"], f"{where} cached_input") if "cached_input" in raw else input_price
    short_tokens = raw.get("short_output_max_tokens")
    short_price = raw.get("short_output")
    if (short_tokens is None) != (short_price is None):
        raise ConfigError(f"{where}: short_output and short_output_max_tokens go together")
    return Tier(
        _token_bound(raw.get("max_input_tokens"), f"{where} max_input_tokens"),
        input_price,
        cached,
        _price(raw["output"], f"{where} output"),
        short_output_max_tokens=_token_bound(short_tokens, f"{where} short_output_max_tokens"),
        short_output=_price(short_price, f"{where} short_output") if short_price is not None else None,
    )


def _default_price(raw: Mapping[str, Any], where: str) -> ModelPrice:
    _reject_unknown_keys(raw, _DEFAULT_KEYS, where)
    tier = _tier_from(raw, where, tiered=False)
    source = _text(raw.get("source", "quotawrap.toml [prices.default]"), f"{where} source")
    return ModelPrice("default", (tier,), source, _text(raw.get("as_of", ""), f"{where} as_of"), estimated=True)


def _price(value: object, where: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal)):
        raise ConfigError(f"{where} must be a number (CNY per million tokens), got {_type_name(value)}")
    try:
        # str() first: toml's 0.1 is a binary float, and Decimal(0.1) would carry its error
        price = Decimal(str(value)) if isinstance(value, float) else Decimal(value)
    except (InvalidOperation, ValueError):
        raise ConfigError(f"{where} must be a number (CNY per million tokens), got {value!r}") from None
    if not price.is_finite() or price < 0:
        raise ConfigError(f"{where} must be a non-negative number, got {value!r}")
    return price


def _token_bound(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} must be a positive whole number of tokens, got {value!r}")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {_type_name(value)}")
    return value


def _reject_unknown_keys(raw: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in raw.keys() - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(allowed))}")


def _digest(data: Mapping[str, Any]) -> str:
    canonical = json.dumps(data, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def _type_name(value: object) -> str:
    return "nothing" if value is None else type(value).__name__
