"""Tests for quotawrap.core.identity: one identity per model, whatever the request names."""

from __future__ import annotations

from typing import Any

import pytest

from quotawrap.core.identity import (
    UNMAPPED,
    Identity,
    answered_model,
    canonical,
    endpoint_table,
    endpoints_from_listing,
    foundation_model_id,
    is_endpoint_id,
    resolve,
)
from quotawrap.core.prices import PriceTable, normalize_model

EP_A = "ep-20250101123456-abcde"
EP_B = "ep-20250202123456-fghij"
FLASH = "deepseek-v4-flash-260425"
TABLE = {EP_A: FLASH, EP_B: FLASH}


class TestResolve:
    @pytest.mark.parametrize(
        ("asked", "identity"),
        [
            # spellings of one model are that model
            ("deepseek-v4-flash-260425", Identity(FLASH)),
            ("DeepSeek-V4-Flash-260425", Identity(FLASH)),
            (" deepseek-v4-flash-260425", Identity(FLASH)),
            ("deepseek-v4-flash-260425\n", Identity(FLASH)),
            ("\tDEEPSEEK-V4-FLASH-260425 \r\n", Identity(FLASH)),
            # endpoint ids of one model are that model, however spelt
            (EP_A, Identity(FLASH, EP_A)),
            (EP_B, Identity(FLASH, EP_B)),
            (EP_A.upper(), Identity(FLASH, EP_A)),
            (f" {EP_B}\n", Identity(FLASH, EP_B)),
            # an endpoint id nobody mapped yet: its model is not known
            ("ep-20990101000000-zzzzz", Identity(UNMAPPED, "ep-20990101000000-zzzzz")),
            ("ep-m-20250101123456-abcde", Identity(UNMAPPED, "ep-m-20250101123456-abcde")),
            # not endpoint ids: a bot, a name that merely contains "ep-", the bare prefix
            ("bot-20250101123456-abcde", Identity("bot-20250101123456-abcde")),
            ("deep-ep-model", Identity("deep-ep-model")),
            ("ep-", Identity("ep-")),
            # dots are not dashes: Ark answers a dotted name 404, and folding it would re-key existing ledgers
            ("doubao-seed-1.6", Identity("doubao-seed-1.6")),
        ],
    )
    def test_table(self, asked: str, identity: Identity) -> None:
        """Each request model string resolves to the identity its limits key by."""
        assert resolve(asked, TABLE) == identity

    def test_the_table_is_read_by_canonical_endpoint_id_only(self) -> None:
        """The table's keys are canonical; a request's spelling is folded before the lookup, never the table's."""
        assert resolve(EP_A, {EP_A.upper(): FLASH}) == Identity(UNMAPPED, EP_A)

    def test_an_empty_mapping_leaves_every_endpoint_unmapped(self) -> None:
        """Without any table every endpoint id is unmapped, and model names are themselves."""
        assert resolve(EP_A, {}) == Identity(UNMAPPED, EP_A)
        assert resolve("Doubao-Seed-1-6-250615", {}) == Identity("doubao-seed-1-6-250615")


class TestCanonical:
    def test_prices_fold_the_same_spellings(self) -> None:
        """The price table keys by the canonical form too: every spelling of a model has its price."""
        table = PriceTable()
        for spelling in ("DeepSeek-V4-Flash-260425", " deepseek-v4-flash-260425\n"):
            assert canonical(spelling) == FLASH
            assert normalize_model(spelling) == normalize_model(FLASH)
            assert table.price_for(spelling) == table.price_for(FLASH) is not None

    def test_endpoint_ids(self) -> None:
        """`ep-` and `ep-m-` ids are endpoint ids, as Ark's SDKs tell them apart; a bare prefix is not."""
        assert is_endpoint_id(EP_A) and is_endpoint_id("ep-m-1")
        assert not is_endpoint_id("ep-") and not is_endpoint_id("bot-1") and not is_endpoint_id("deepseek-ep-1")


class TestAnsweredModel:
    @pytest.mark.parametrize(
        ("value", "model"),
        [
            ("deepseek-v4-flash-260425", FLASH),
            ("DeepSeek-V4-Flash-260425 ", FLASH),
            (EP_A, None),  # an answer naming the endpoint itself says nothing about its model
            (UNMAPPED, None),
            ("", None),
            ("  ", None),
            (None, None),
            (42, None),
        ],
    )
    def test_table(self, value: object, model: str | None) -> None:
        """An answer's `model` names a billable model, or nothing."""
        assert answered_model(value) == model


class TestFoundationModelId:
    @pytest.mark.parametrize(
        ("name", "version", "model"),
        [
            ("deepseek-v4-flash", "260425", FLASH),
            ("doubao-pro-32k", "240615", "doubao-pro-32k-240615"),
            ("Doubao-Seed-1-6", "250615", "doubao-seed-1-6-250615"),
            ("doubao-seed-1-6", "", "doubao-seed-1-6"),
            ("doubao-seed-1-6", None, "doubao-seed-1-6"),
            ("", "250615", None),
            (None, "250615", None),
        ],
    )
    def test_table(self, name: object, version: object, model: str | None) -> None:
        """Name + "-" + ModelVersion, as Ark writes model ids."""
        assert foundation_model_id(name, version) == model


class TestEndpointTable:
    def test_reads_pairs_canonical(self) -> None:
        """`"ep-..." = "model"` pairs, both sides canonical."""
        assert endpoint_table({EP_A.upper(): " DeepSeek-V4-Flash-260425"}) == {EP_A: FLASH}

    @pytest.mark.parametrize(
        ("table", "named"),
        [
            ({"deepseek-v4-flash": FLASH}, "not an endpoint id"),
            ({EP_A: EP_B}, "does not name a model id"),
            ({EP_A: ""}, "does not name a model id"),
            ({EP_A: 3}, "does not name a model id"),
        ],
    )
    def test_refuses_what_is_no_pair(self, table: dict[str, Any], named: str) -> None:
        """A key that is no endpoint id, or a value that is no model id, is an error naming the entry."""
        with pytest.raises(ValueError, match=named):
            endpoint_table(table)


def _item(
    endpoint: str, name: object = "deepseek-v4-flash", version: object = "260425", **extra: Any
) -> dict[str, Any]:
    reference: dict[str, Any] = {"FoundationModel": {"Name": name, "ModelVersion": version}}
    return {"Id": endpoint, "Name": "my endpoint", "Status": "Running", "ModelReference": reference, **extra}


class TestEndpointsFromListing:
    def test_foundation_models(self) -> None:
        """Each record's id maps to its foundation model's id."""
        items = [_item(EP_A), _item(EP_B, "doubao-seed-1-6", "250615")]
        assert endpoints_from_listing(items) == {EP_A: FLASH, EP_B: "doubao-seed-1-6-250615"}

    def test_records_without_a_foundation_model_are_left_out(self) -> None:
        """A custom model's endpoint, a record without id or name: their first answer tells instead."""
        items = [
            {"Id": EP_A, "ModelReference": {"CustomModelId": "cm-1"}},
            {"Id": EP_B, "ModelReference": None},
            _item("", "deepseek-v4-flash"),
            _item("ep-20250303123456-klmno", None),
        ]
        assert endpoints_from_listing(items) == {}
