"""Tests for quotawrap.core.endpoint_prices: per image, plugin fees, batch discount, context storage."""

from __future__ import annotations

import pytest

from quotawrap.core.endpoint_prices import CostRule, with_media_prices
from quotawrap.core.estimate import Estimate
from quotawrap.core.prices import PriceTable, UnknownPrice
from quotawrap.core.usage import Usage

TABLE = with_media_prices(PriceTable())
SEED = "doubao-seed-1-6-250615"


class TestImages:
    def test_reserve_prices_every_image_the_request_may_make(self) -> None:
        """Seedream 4.0 at 0.20 CNY an image: a request for up to 4 reserves 0.80 CNY."""
        rule = CostRule.for_request(
            "images",
            {"sequential_image_generation": "auto", "sequential_image_generation_options": {"max_images": 4}},
            Estimate(0, 4 * 4096),
        )
        assert int(rule.reserve(TABLE, "doubao-seedream-4-0-250828", Estimate(0, 4 * 4096))) == 800_000

    def test_settle_prices_the_images_made(self) -> None:
        """Two images made are two images billed, whatever their token count."""
        usage = Usage(0, 8192, 8192, images=2)
        assert int(CostRule("images", images=4).actual(TABLE, "doubao-seedream-4-0-250828", usage)) == 400_000

    def test_unknown_image_model_is_priced_at_the_dearest_image(self) -> None:
        """An unpriced image model costs the dearest per-image price, flagged estimated."""
        cost = CostRule("images", images=1).reserve(TABLE, "some-new-image-model", Estimate(0, 4096))
        assert int(cost) == 300_000 and cost.estimated

    def test_unknown_image_model_under_error_policy_raises(self) -> None:
        """--unknown-price error applies to images too."""
        with pytest.raises(UnknownPrice):
            CostRule("images", images=1).reserve(PriceTable(unknown_price="error"), "new-image", Estimate(0, 1))


class TestTokenEndpoints:
    def test_seedance_is_priced_per_token(self) -> None:
        """A Seedance model has its own per-token price, not the conservative default."""
        usage = Usage(0, 100_000, 100_000)
        assert int(CostRule("video_task").actual(TABLE, "doubao-seedance-1-0-pro-250528", usage)) == 1_500_000

    def test_batch_is_half_the_online_price(self) -> None:
        """Batch chat costs half of the same call online, rounded up."""
        usage = Usage(1000, 1000, 2000)
        online = int(TABLE.actual_cost(SEED, usage))
        assert int(CostRule("batch_chat").actual(TABLE, SEED, usage)) == -(-online // 2)

    def test_bot_plugin_calls_are_added(self) -> None:
        """Each web_search call of a bot adds its fee to the token cost."""
        usage = Usage(100, 10, 110, actions=(("web_search", 3),))
        tokens_only = int(TABLE.actual_cost(SEED, usage))
        assert int(CostRule("bot_chat").actual(TABLE, SEED, usage)) == tokens_only + 18_000

    def test_bot_reserve_allows_for_plugin_calls(self) -> None:
        """A bot's reserve covers a few plugin calls on top of its tokens."""
        estimate = Estimate(100, 4096)
        plain = int(TABLE.reserve_cost(SEED, 100, 4096))
        assert int(CostRule("bot_chat").reserve(TABLE, SEED, estimate)) == plain + 30_000

    def test_context_adds_storage_for_its_ttl(self) -> None:
        """Context create pays its input plus storage per token-hour of the ttl it asks for."""
        rule = CostRule.for_request("context", {"ttl": 7200}, Estimate(1_000_000, 0))
        usage = Usage(1_000_000, 0, 1_000_000)
        assert int(rule.actual(TABLE, SEED, usage)) == int(TABLE.actual_cost(SEED, usage)) + 34_000

    def test_toml_prices_still_win_over_bundled_media_prices(self) -> None:
        """A [prices] entry for a Seedance model replaces the bundled estimate."""
        from quotawrap.core.prices import load_overrides

        table = with_media_prices(load_overrides({"doubao-seedance-1-0-pro": {"input": 1, "output": 1}}))
        usage = Usage(0, 1_000_000, 1_000_000)
        assert int(CostRule("video_task").actual(table, "doubao-seedance-1-0-pro-250528", usage)) == 1_000_000

    def test_media_prices_leave_the_conservative_default_alone(self) -> None:
        """Adding Seedance prices does not raise what an unpriced chat model is charged."""
        assert TABLE.fallback == PriceTable().fallback
