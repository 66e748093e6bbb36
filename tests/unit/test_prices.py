"""Tests for quotawrap.core.prices: the bundled table, tiers, costs, the unknown-price policy, toml overrides."""

from __future__ import annotations

import json
import pickle
import sqlite3
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.core.errors import ConfigError, QuotawrapError
from quotawrap.core.money import Cost, format_cny, parse_cny
from quotawrap.core.prices import (
    BUNDLED_AS_OF,
    BUNDLED_PRICES,
    BUNDLED_SOURCE,
    ModelPrice,
    PriceTable,
    Tier,
    UnknownPrice,
    load_overrides,
    normalize_model,
)
from quotawrap.core.usage import Usage

TABLE = PriceTable()
BUNDLED_KEYS = [price.model for price in BUNDLED_PRICES]


def usage(prompt: int, completion: int, *, cached: int = 0, reasoning: int = 0, total: int | None = None) -> Usage:
    return Usage(prompt, completion, prompt + completion if total is None else total, reasoning, cached)


def tiers_of(model: str) -> tuple[Tier, ...]:
    price = TABLE.price_for(model)
    assert price is not None
    return price.tiers


class TestBundledTable:
    """The bundled prices are data with provenance, and none of them is zero."""

    def test_every_entry_names_its_source_and_date(self) -> None:
        """Each entry carries a non-empty source and an ISO date."""
        for price in BUNDLED_PRICES:
            assert price.source.strip(), price.model
            assert len(price.as_of) == 10 and price.as_of[4] == "-", price.model

    def test_no_price_is_zero(self) -> None:
        """Input and output prices are positive in every tier (peers' $0 bug)."""
        for price in BUNDLED_PRICES:
            for tier in price.tiers:
                assert tier.input > 0 and tier.output > 0, price.model

    def test_cached_input_never_dearer_than_input(self) -> None:
        """A cache hit never costs more than a miss, so discounts cannot inflate a cost."""
        for price in BUNDLED_PRICES:
            for tier in price.tiers:
                assert tier.cached_input <= tier.input, price.model

    def test_unverified_entries_say_so(self) -> None:
        """Entries flagged estimated are the ones whose source says 'estimate, unverified', and vice versa."""
        for price in BUNDLED_PRICES:
            assert price.estimated == price.source.startswith("estimate, unverified"), price.model

    def test_deepseek_v4_family_is_unverified(self) -> None:
        """The DeepSeek-V4 prices could not be checked against Ark's page and are flagged."""
        assert [p.model for p in BUNDLED_PRICES if p.estimated] == [
            "deepseek-v4",
            "deepseek-v4-pro",
            "deepseek-v4-pro-ga",
            "deepseek-v4-flash",
        ]

    def test_requested_models_are_present(self) -> None:
        """The common Ark models of the issue are all priced."""
        for model in (
            "deepseek-v3-250324",
            "deepseek-v3-1-250821",
            "deepseek-v3-2-251201",
            "deepseek-r1-250528",
            "deepseek-v4-flash-260425",
            "deepseek-v4-pro-260425",
            "doubao-seed-1-6-250615",
            "doubao-seed-1-6-flash-250828",
            "doubao-seed-1-6-thinking-250715",
            "doubao-1-5-pro-32k-250115",
            "doubao-1-5-lite-32k-250115",
        ):
            assert TABLE.price_for(model) is not None, model

    def test_seed_16_matches_arks_list(self) -> None:
        """doubao-seed-1.6 is Ark's three-band ladder with the short-answer output price in the first band."""
        first, middle, last = tiers_of("doubao-seed-1-6")
        assert (first.max_input_tokens, first.input, first.cached_input, first.output) == (
            32_000,
            Decimal("0.80"),
            Decimal("0.16"),
            Decimal("8.00"),
        )
        assert (first.short_output_max_tokens, first.short_output) == (200, Decimal("2.00"))
        assert (middle.max_input_tokens, middle.input, middle.output) == (128_000, Decimal("1.20"), Decimal("16.00"))
        assert (last.max_input_tokens, last.input, last.output) == (None, Decimal("2.40"), Decimal("24.00"))

    def test_bundled_constants(self) -> None:
        """The table-wide source names Ark's pricing page and the date is the table version."""
        assert "volcengine.com/docs/82379/1544106" in BUNDLED_SOURCE
        assert TABLE.version == f"bundled-{BUNDLED_AS_OF}"


class TestTierSelection:
    """The tier is chosen by input length, bounds inclusive, the dearest beyond the last bound."""

    @pytest.mark.parametrize(
        ("input_tokens", "expected_input_price"),
        [
            (0, "0.80"),
            (32_000, "0.80"),
            (32_001, "1.20"),
            (128_000, "1.20"),
            (128_001, "2.40"),
            (10_000_000, "2.40"),
        ],
    )
    def test_boundaries(self, input_tokens: int, expected_input_price: str) -> None:
        """Bounds are inclusive ([0, 32k], (32k, 128k], beyond), as Ark writes them."""
        price = TABLE.price_for("doubao-seed-1-6")
        assert price is not None
        assert price.tier_for(input_tokens).input == Decimal(expected_input_price)

    def test_past_a_bounded_last_tier_uses_the_last(self) -> None:
        """When every tier is bounded, a longer input is priced at the last (dearest) tier."""
        price = ModelPrice(
            "m",
            (Tier(10, Decimal(1), Decimal(1), Decimal(1)), Tier(20, Decimal(2), Decimal(2), Decimal(2))),
            "test",
            "2026-01-01",
        )
        assert price.tier_for(21).input == Decimal(2)

    def test_reserve_tier_follows_estimated_input(self) -> None:
        """Reserving 32,001 input tokens prices input and output at the second band."""
        cost = TABLE.reserve_cost("doubao-seed-1-6", 32_001, 1000)
        assert int(cost) == 54_402  # 32,001 × 1.20 + 1000 × 16 = 54,401.2, rounded up

    def test_tiers_must_increase(self) -> None:
        """A table with tiers out of order is refused rather than silently mispriced."""
        with pytest.raises(ValueError, match="increasing"):
            ModelPrice(
                "m",
                (Tier(20, Decimal(1), Decimal(1), Decimal(1)), Tier(10, Decimal(2), Decimal(2), Decimal(2))),
                "t",
                "2026-01-01",
            )

    def test_only_the_last_tier_is_unbounded(self) -> None:
        """An unbounded tier before a bounded one is refused."""
        with pytest.raises(ValueError, match="last tier"):
            ModelPrice(
                "m",
                (Tier(None, Decimal(1), Decimal(1), Decimal(1)), Tier(10, Decimal(2), Decimal(2), Decimal(2))),
                "t",
                "2026-01-01",
            )


class TestPriceFor:
    """Lookup: exact id, else the longest table key the id starts with at a dash."""

    def test_exact(self) -> None:
        """A table key looks itself up."""
        price = TABLE.price_for("deepseek-r1")
        assert price is not None and price.model == "deepseek-r1"

    @pytest.mark.parametrize(
        ("model", "key"),
        [
            ("deepseek-v3-250324", "deepseek-v3"),
            ("deepseek-v3-1-250821", "deepseek-v3-1"),
            ("deepseek-v3-1-terminus", "deepseek-v3-1"),
            ("deepseek-v3-2-251201", "deepseek-v3-2"),
            ("doubao-seed-1-6-250615", "doubao-seed-1-6"),
            ("doubao-seed-1-6-flash-250828", "doubao-seed-1-6-flash"),
            ("doubao-seed-1-6-thinking-250715", "doubao-seed-1-6-thinking"),
            ("deepseek-v4-flash-ga-260731", "deepseek-v4-flash"),
            ("deepseek-v4-pro-ga-260813", "deepseek-v4-pro-ga"),
            ("deepseek-v4-pro-260425", "deepseek-v4-pro"),
            ("deepseek-v4-250801", "deepseek-v4"),
            ("doubao-1-5-lite-32k-250115", "doubao-1-5-lite"),
        ],
    )
    def test_date_suffixes_use_the_longest_prefix(self, model: str, key: str) -> None:
        """Ark ids with date or variant suffixes find the most specific entry."""
        price = TABLE.price_for(model)
        assert price is not None and price.model == key

    def test_dotted_and_upper_case_names(self) -> None:
        """'DouBao-Seed-1.6' and 'deepseek-v3.1' are the same models as their dashed ids."""
        assert normalize_model("DouBao-Seed-1.6") == "doubao-seed-1-6"
        price = TABLE.price_for("deepseek-v3.1")
        assert price is not None and price.model == "deepseek-v3-1"

    def test_prefix_must_end_at_a_dash(self) -> None:
        """'doubao-seed-1-60' is not a version of doubao-seed-1-6."""
        assert TABLE.price_for("doubao-seed-1-60") is None

    def test_unknown_is_none(self) -> None:
        """An endpoint id the table does not know has no price of its own."""
        assert TABLE.price_for("ep-20250601123456-abcde") is None


class TestReserveCost:
    """Reservations are pessimistic: all input uncached, full output price."""

    def test_flat_model(self) -> None:
        """deepseek-v3-1: 1000 × 4 + 2000 × 12 micro-CNY."""
        assert TABLE.reserve_cost("deepseek-v3-1-250821", 1000, 2000) == 1000 * 4 + 2000 * 12

    def test_no_short_answer_discount(self) -> None:
        """Even a 100-token allowance is reserved at 8, not the short-answer 2 (reasoning is unbounded)."""
        assert TABLE.reserve_cost("doubao-seed-1-6", 1000, 100) == 1000 * Decimal("0.80") + 100 * 8

    def test_rounds_up_once(self) -> None:
        """One token of flash input (0.15 micro-CNY) costs one micro-CNY, never zero."""
        assert TABLE.reserve_cost("doubao-seed-1-6-flash", 1, 0) == 1

    def test_zero_tokens_cost_nothing(self) -> None:
        """Nothing reserved costs nothing (the only honest zero)."""
        assert TABLE.reserve_cost("deepseek-v3", 0, 0) == 0

    @pytest.mark.parametrize("bad", [-1, 1.5, True])
    def test_rejects_non_counts(self, bad: Any) -> None:
        """Token counts must be non-negative ints."""
        with pytest.raises(ValueError):
            TABLE.reserve_cost("deepseek-v3", bad, 1)


class TestActualCost:
    """Settled costs: uncached input, cached input at its price, output including reasoning."""

    def test_cached_discount(self) -> None:
        """deepseek-v3-1 with 800 of 1000 prompt tokens cached: 200 × 4 + 800 × 0.8 + 50 × 12."""
        cost = TABLE.actual_cost("deepseek-v3-1", usage(1000, 50, cached=800))
        assert cost == 200 * 4 + 800 * Decimal("0.8") + 50 * 12
        assert cost < TABLE.actual_cost("deepseek-v3-1", usage(1000, 50))

    def test_reasoning_is_billed_as_output(self) -> None:
        """Reasoning sits inside completion_tokens and costs the output price, not extra and not nothing."""
        with_reasoning = TABLE.actual_cost("deepseek-r1", usage(10, 500, reasoning=450))
        assert with_reasoning == 10 * 4 + 500 * 16
        assert with_reasoning == TABLE.actual_cost("deepseek-r1", usage(10, 500))

    def test_total_beyond_parts_is_billed_as_output(self) -> None:
        """A usage whose total exceeds prompt + completion (reasoning reported outside) is not undercounted."""
        cost = TABLE.actual_cost("deepseek-r1", usage(10, 50, reasoning=450, total=510))
        assert cost == 10 * 4 + 500 * 16

    def test_tier_by_prompt_tokens_including_cached(self) -> None:
        """A 40k prompt, mostly cached, is still priced in the (32k, 128k] band."""
        cost = TABLE.actual_cost("doubao-seed-1-6", usage(40_000, 1000, cached=39_000))
        assert cost == 1000 * Decimal("1.20") + 39_000 * Decimal("0.16") + 1000 * 16

    @pytest.mark.parametrize(("completion", "price"), [(200, 2), (201, 8)])
    def test_short_answer_boundary(self, completion: int, price: int) -> None:
        """doubao-seed-1.6 bills up to 200 output tokens at 2, from 201 at 8 (input ≤ 32k)."""
        cost = TABLE.actual_cost("doubao-seed-1-6-250615", usage(1000, completion))
        assert cost == 1000 * Decimal("0.80") + completion * price

    def test_no_short_answer_discount_beyond_first_band(self) -> None:
        """The short-answer price applies only to inputs up to 32k."""
        cost = TABLE.actual_cost("doubao-seed-1-6", usage(40_000, 100))
        assert cost == 40_000 * Decimal("1.20") + 100 * 16

    def test_cached_above_prompt_is_clamped(self) -> None:
        """A usage claiming more cached than prompt tokens cannot produce a negative input charge."""
        cost = TABLE.actual_cost("deepseek-v3", usage(100, 0, cached=500))
        assert cost == 100 * Decimal("0.40")

    def test_model_without_cache_bills_cached_as_input(self) -> None:
        """doubao-1.5-lite has no cache discount: cached tokens cost the input price."""
        assert TABLE.actual_cost("doubao-1-5-lite-32k", usage(1000, 0, cached=1000)) == 1000 * Decimal("0.30")

    def test_verified_cost_is_not_estimated(self) -> None:
        """A cost from a verified list price carries estimated=False; an unverified one True."""
        assert TABLE.actual_cost("deepseek-v3", usage(1, 1)).estimated is False
        assert TABLE.actual_cost("deepseek-v4-flash-ga-260731", usage(1, 1)).estimated is True


BUNDLED_MODELS = st.sampled_from(BUNDLED_KEYS)
COUNTS = st.integers(min_value=0, max_value=400_000)


class TestCostProperties:
    """Properties that make costs safe to enforce a cap with."""

    @given(model=BUNDLED_MODELS, estimate_input=COUNTS, allowance=COUNTS, data=st.data())
    def test_reserve_covers_any_usage_within_the_estimate(
        self, model: str, estimate_input: int, allowance: int, data: st.DataObject
    ) -> None:
        """A call that stays within its estimated input and output never costs more than its reservation."""
        prompt = data.draw(st.integers(min_value=0, max_value=estimate_input))
        completion = data.draw(st.integers(min_value=0, max_value=allowance))
        cached = data.draw(st.integers(min_value=0, max_value=prompt))
        actual = TABLE.actual_cost(model, usage(prompt, completion, cached=cached))
        assert actual <= TABLE.reserve_cost(model, estimate_input, allowance)

    @given(model=BUNDLED_MODELS, prompt=COUNTS, completion=COUNTS)
    def test_unknown_default_is_never_cheaper(self, model: str, prompt: int, completion: int) -> None:
        """The conservative default costs at least as much as any bundled model for the same usage."""
        known = TABLE.actual_cost(model, usage(prompt, completion))
        unknown = TABLE.actual_cost("some-unpriced-model", usage(prompt, completion))
        assert unknown >= known

    @given(model=BUNDLED_MODELS, prompt=st.integers(1, 400_000), completion=COUNTS)
    def test_any_billed_token_costs_something(self, model: str, prompt: int, completion: int) -> None:
        """A call with tokens never costs zero."""
        assert TABLE.actual_cost(model, usage(prompt, completion)) > 0


class TestUnknownModel:
    """Unpriced models are an explicit estimate or an explicit error, never free."""

    def test_conservative_default_is_positive_and_flagged(self) -> None:
        """By default an unknown model is priced above zero and the cost says it is an estimate."""
        cost = TABLE.actual_cost("ep-20250601123456-abcde", usage(1000, 1000))
        assert cost > 0
        assert cost.estimated is True
        assert cost.format().startswith("~¥")

    def test_default_is_the_dearest_bundled_price(self) -> None:
        """The derived default uses the highest input and output prices, with no cache discount."""
        tiers = [tier for price in BUNDLED_PRICES for tier in price.tiers]
        (tier,) = TABLE.fallback.tiers
        assert tier.input == max(t.input for t in tiers)
        assert tier.output == max(t.output for t in tiers)
        assert tier.cached_input == tier.input

    def test_error_policy_raises(self) -> None:
        """With unknown_price='error' an unpriced model raises UnknownPrice naming it."""
        strict = PriceTable(unknown_price="error")
        with pytest.raises(UnknownPrice) as caught:
            strict.reserve_cost("ep-xyz", 10, 10)
        assert caught.value.model == "ep-xyz"
        assert isinstance(caught.value, QuotawrapError)
        assert '[prices."ep-xyz"]' in str(caught.value)

    def test_error_policy_still_prices_known_models(self) -> None:
        """The strict policy only affects models the table does not know."""
        assert PriceTable(unknown_price="error").actual_cost("deepseek-v3", usage(1, 0)) == 2

    def test_bad_policy_is_a_config_error(self) -> None:
        """A policy other than conservative or error is refused."""
        with pytest.raises(ConfigError, match="conservative"):
            PriceTable(unknown_price="free")  # type: ignore[arg-type]


class TestLoadOverrides:
    """The [prices] table of quotawrap.toml, already parsed."""

    def test_flat_override(self) -> None:
        """A flat entry prices a new model; cached_input is optional and defaults to input."""
        table = load_overrides({"my-model": {"input": 4.0, "output": 16}})
        price = table.price_for("my-model-250101")
        assert price is not None and price.source == "quotawrap.toml"
        assert price.tiers == (Tier(None, Decimal("4.0"), Decimal("4.0"), Decimal("16")),)
        assert table.actual_cost("my-model", usage(1000, 100, cached=1000)).estimated is False

    def test_replaces_a_bundled_entry(self) -> None:
        """An entry with a bundled key wins over the bundled price."""
        table = load_overrides({"deepseek-v3": {"input": 1, "cached_input": 0.1, "output": 2}})
        assert table.actual_cost("deepseek-v3-250324", usage(1000, 1000)) == 3000

    def test_tiers(self) -> None:
        """A tiered entry, including a short-output price, is parsed in order."""
        table = load_overrides(
            {
                "tiered": {
                    "tiers": [
                        {
                            "max_input_tokens": 100,
                            "input": 1,
                            "output": 10,
                            "short_output_max_tokens": 5,
                            "short_output": 2,
                        },
                        {"input": 3, "cached_input": 0.5, "output": 30},
                    ],
                    "source": "my contract",
                    "as_of": "2026-11-01",
                }
            }
        )
        price = table.price_for("tiered")
        assert price is not None and (price.source, price.as_of) == ("my contract", "2026-11-01")
        assert table.actual_cost("tiered", usage(100, 5)) == 100 + 5 * 2
        assert table.actual_cost("tiered", usage(101, 5)) == 101 * 3 + 5 * 30

    def test_float_prices_are_exact(self) -> None:
        """toml's binary 0.1 becomes Decimal('0.1'), not 0.1000000000000000055…"""
        table = load_overrides({"m": {"input": 0.1, "output": 0.1}})
        price = table.price_for("m")
        assert price is not None and price.tiers[0].input == Decimal("0.1")

    def test_default(self) -> None:
        """[prices.default] prices unknown models instead of the derived default, still flagged estimated."""
        table = load_overrides({"default": {"input": 1, "output": 1}})
        cost = table.actual_cost("anything", usage(1000, 1000))
        assert cost == 2000 and cost.estimated is True

    def test_default_survives_later_overrides(self) -> None:
        """An explicit default is kept when more prices are merged in."""
        table = load_overrides({"default": {"input": 1, "output": 1}}).with_overrides([])
        assert table.actual_cost("anything", usage(1000, 0)) == 1000

    def test_derived_default_follows_added_prices(self) -> None:
        """Without an explicit default, a dearer override raises the conservative default."""
        table = load_overrides({"gold": {"input": 100, "output": 500}})
        assert table.fallback.tiers[0].output == Decimal(500)

    def test_like(self) -> None:
        """An Ark endpoint id can borrow a bundled model's prices with like = '…'."""
        table = load_overrides({"ep-2025-abc": {"like": "doubao-seed-1.6"}})
        price = table.price_for("ep-2025-abc")
        assert price is not None and price.tiers == tiers_of("doubao-seed-1-6")
        assert "priced like doubao-seed-1-6" in price.source

    def test_policy_from_toml_and_argument(self) -> None:
        """unknown_price in toml sets the policy; the keyword (from --unknown-price) overrides it."""
        assert load_overrides({"unknown_price": "error"}).unknown_price == "error"
        assert load_overrides({"unknown_price": "error"}, unknown_price="conservative").unknown_price == "conservative"

    def test_error_policy_beats_a_toml_default(self) -> None:
        """Policy 'error' raises even when [prices.default] exists."""
        table = load_overrides({"default": {"input": 1, "output": 1}}, unknown_price="error")
        with pytest.raises(UnknownPrice):
            table.actual_cost("anything", usage(1, 1))

    def test_empty_is_the_bundled_table(self) -> None:
        """No [prices] entries leaves the bundled table and its version unchanged."""
        assert load_overrides({}) == TABLE

    def test_version_records_overrides(self) -> None:
        """Overrides change the table version, and the same overrides give the same version."""
        one = load_overrides({"m": {"input": 1, "output": 1}}).version
        assert one.startswith(f"bundled-{BUNDLED_AS_OF}+toml-")
        assert one == load_overrides({"m": {"input": 1, "output": 1}}).version
        assert one != load_overrides({"m": {"input": 2, "output": 1}}).version

    @pytest.mark.parametrize(
        ("data", "message"),
        [
            ([], "must be a table"),
            ({"m": 4.0}, "must be a table"),
            ({"m": {"input": 1}}, "needs 'output'"),
            ({"m": {"input": -1, "output": 1}}, "non-negative"),
            ({"m": {"input": True, "output": 1}}, "must be a number"),
            ({"m": {"input": "cheap", "output": 1}}, "must be a number"),
            ({"m": {"input": float("nan"), "output": 1}}, "non-negative"),
            ({"m": {"input": 1, "ouput": 1}}, "unknown key"),
            ({"m": {"input": 1, "output": 1, "tiers": [{"input": 1, "output": 1}]}}, "not both"),
            ({"m": {"tiers": []}}, "non-empty list"),
            ({"m": {"tiers": [{"input": 1, "output": 1, "max": 3}]}}, "unknown key"),
            (
                {
                    "m": {
                        "tiers": [
                            {"max_input_tokens": 9, "input": 1, "output": 1},
                            {"max_input_tokens": 5, "input": 1, "output": 1},
                        ]
                    }
                },
                "increasing",
            ),
            ({"m": {"tiers": [{"max_input_tokens": 0, "input": 1, "output": 1}]}}, "positive whole number"),
            ({"m": {"input": 1, "output": 1, "short_output": 1}}, "go together"),
            ({"m": {"like": "no-such-model"}}, "names no priced model"),
            ({"m": {"like": "deepseek-v3", "input": 1}}, "takes no prices"),
            ({"m": {"input": 1, "output": 1, "source": 5}}, "must be a string"),
            ({"unknown_price": "free"}, "unknown_price must be one of"),
            ({"default": {"input": 1, "output": 1, "tiers": []}}, "unknown key"),
        ],
    )
    def test_junk_is_a_config_error(self, data: Any, message: str) -> None:
        """Malformed entries raise ConfigError naming what is wrong."""
        with pytest.raises(ConfigError, match=message):
            load_overrides(data)

    def test_error_names_the_entry(self) -> None:
        """The message quotes the toml table the mistake is in."""
        with pytest.raises(ConfigError, match=r'\[prices\."ep-1"\] output'):
            load_overrides({"ep-1": {"input": 1, "output": -2}})


class TestCost:
    """Cost is an int of micro-CNY that remembers whether it is an estimate."""

    def test_is_an_int(self) -> None:
        """A Cost compares, hashes and stores as its integer value."""
        cost = Cost(1234, estimated=True)
        assert isinstance(cost, int) and cost == 1234 and hash(cost) == hash(1234)
        assert json.dumps({"cost": cost}) == '{"cost": 1234}'
        db = sqlite3.connect(":memory:")
        db.execute("create table t (micro integer)")
        db.execute("insert into t values (?)", (cost,))
        assert db.execute("select micro, typeof(micro) from t").fetchone() == (1234, "integer")

    def test_addition_keeps_the_flag(self) -> None:
        """Adding an estimated cost taints the sum; sum() over costs yields a Cost."""
        total = sum([Cost(1), Cost(2, estimated=True), Cost(3)])
        assert isinstance(total, Cost) and total == 6 and total.estimated is True
        assert (Cost(1) + Cost(2)).estimated is False
        assert (Cost(1) + 5) == 6

    def test_pickles(self) -> None:
        """A Cost crosses process boundaries with its flag."""
        restored = pickle.loads(pickle.dumps(Cost(7, estimated=True)))
        assert restored == 7 and restored.estimated is True

    def test_cny(self) -> None:
        """The cny property is the exact Decimal amount."""
        assert Cost(12_300).cny == Decimal("0.0123")

    @pytest.mark.parametrize(
        ("micro", "estimated", "text"),
        [
            (12_300, False, "¥0.012300"),
            (12_300, True, "~¥0.012300"),
            (0, False, "¥0.000000"),
            (12, False, "¥0.000012"),
            (47, False, "¥0.000047"),
            (94, False, "¥0.000094"),  # was ¥0.0001: two calls of ¥0.000047 each did not add up on screen
            (-12_300, False, "-¥0.012300"),
            (5_000_000, False, "¥5.000000"),
            (12_350, False, "¥0.012350"),
            (1_234_567_891, False, "¥1,234.567891"),
        ],
    )
    def test_format(self, micro: int, estimated: bool, text: str) -> None:
        """Every amount to the micro-CNY, never rounded (one rule for every view), a tilde for estimates."""
        assert format_cny(micro, estimated=estimated) == text
        assert Cost(micro, estimated=estimated).format() == text

    @given(st.lists(st.integers(0, 10**12), min_size=1, max_size=5))
    def test_shown_amounts_add_up(self, amounts: list[int]) -> None:
        """What a table shows per row adds up to what it shows as the total."""
        shown = [Decimal(format_cny(amount).lstrip("¥").replace(",", "")) for amount in amounts]
        assert sum(shown) == Decimal(format_cny(sum(amounts)).lstrip("¥").replace(",", ""))

    def test_format_reads_the_flag(self) -> None:
        """format_cny of a Cost uses the Cost's own flag unless told otherwise."""
        assert format_cny(Cost(1, estimated=True)).startswith("~")
        assert not format_cny(Cost(1, estimated=True), estimated=False).startswith("~")

    @pytest.mark.parametrize(
        ("text", "micro"),
        [("5", 5_000_000), ("0.50", 500_000), ("¥2", 2_000_000), (" 1.5 ", 1_500_000), (3, 3_000_000), (0.1, 100_000)],
    )
    def test_parse_cny(self, text: Any, micro: int) -> None:
        """Amounts for --cap-cost become micro-CNY."""
        assert parse_cny(text) == micro

    def test_parse_cny_never_rounds_a_cap_up(self) -> None:
        """Digits beyond a micro-CNY are dropped, so a cap is never raised by rounding."""
        assert parse_cny("0.0000019") == 1

    @pytest.mark.parametrize("junk", ["", "five", "-1", "nan", "inf", True])
    def test_parse_cny_junk(self, junk: Any) -> None:
        """Junk and negative amounts are ConfigErrors."""
        with pytest.raises(ConfigError):
            parse_cny(junk)
