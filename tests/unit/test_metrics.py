"""The Prometheus families of one read-side snapshot (quotawrap.books.metrics), read back by Prometheus's parser."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from quotawrap.books.metrics import CONTENT_TYPE, Exposition

ROW = {
    "model": "deepseek-v4",
    "usage": 1_200,
    "in_flight": 300,
    "headroom": 500,
    "effective_limit": 2_000,
    "refused": 4,
    "waiting": 2,
    "limits": {
        "v6": 2_100,
        "lag_aware": 2_000,
        "daily_cap": 2_000_000,
        "walls": [{"name": "usage_wall", "cap": 1_950}],
    },
}


def _parsed(data: dict[str, Any]) -> tuple[dict[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    content_type, body = Exposition(lambda: data)()
    assert content_type == CONTENT_TYPE
    families = list(text_string_to_metric_families(body.decode()))
    types = {family.name: family.type for family in families}
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }
    return types, samples


class TestFamilies:
    def test_model_rows(self) -> None:
        """Each model figure under its metric, counters as counters, gauges as gauges."""
        types, samples = _parsed({"models": [ROW], "by_tag": {}, "budgets": [], "unguarded_processes": [{}, {}]})
        model = (("model", "deepseek-v4"),)
        assert samples[("quotawrap_settled_tokens_total", model)] == 1_200
        assert samples[("quotawrap_inflight_tokens", model)] == 300
        assert samples[("quotawrap_headroom_tokens", model)] == 500
        assert samples[("quotawrap_refused_calls_total", model)] == 4
        assert samples[("quotawrap_waiting_calls", model)] == 2
        assert samples[("quotawrap_unguarded_processes", ())] == 2
        assert types["quotawrap_settled_tokens"] == types["quotawrap_refused_calls"] == "counter"
        assert types["quotawrap_inflight_tokens"] == types["quotawrap_waiting_calls"] == "gauge"

    def test_limits_by_name(self) -> None:
        """The effective limit and the ones it comes from; the usage wall is the first wall's cap."""
        _, samples = _parsed({"models": [ROW]})
        limits = {
            dict(labels)["limit"]: value
            for (name, labels), value in samples.items()
            if name == "quotawrap_limit_tokens"
        }
        assert limits == {
            "effective": 2_000,
            "v6": 2_100,
            "lag_aware": 2_000,
            "daily_cap": 2_000_000,
            "usage_wall": 1_950,
        }

    def test_tag_values(self) -> None:
        """One series per (tag, value) row of the snapshot, (others) and (none) included."""
        by_tag = {
            "team": [{"key": "search", "settled_tokens": 700}, {"key": "(none)", "settled_tokens": 500}],
            "user": [{"key": "ana", "settled_tokens": 1_100}, {"key": "(others)", "settled_tokens": 100}],
        }
        _, samples = _parsed({"models": [ROW], "by_tag": by_tag})
        tags = {
            (dict(labels)["tag"], dict(labels)["value"]): value
            for (name, labels), value in samples.items()
            if name == "quotawrap_tag_settled_tokens_total"
        }
        assert tags == {
            ("team", "search"): 700,
            ("team", "(none)"): 500,
            ("user", "ana"): 1_100,
            ("user", "(others)"): 100,
        }

    def test_budgets_only_when_there_are_some(self) -> None:
        """quotawrap_budget_remaining: limit - used per budget, absent without budgets."""
        budgets = [
            {"name": "search-day", "used": 300, "in_flight": 0, "limit": 1_000, "unit": "tokens", "resets_at": 0.0},
            {
                "name": "all-month",
                "used": 2_000_000,
                "in_flight": 0,
                "limit": 5_000_000,
                "unit": "cny",
                "resets_at": 0.0,
            },
        ]
        types, samples = _parsed({"models": [], "budgets": budgets})
        assert samples[("quotawrap_budget_remaining", (("budget", "search-day"), ("unit", "tokens")))] == 700
        assert samples[("quotawrap_budget_remaining", (("budget", "all-month"), ("unit", "cny")))] == 3_000_000
        assert "quotawrap_budget_remaining" not in _parsed({"models": [], "budgets": []})[0]
        assert types["quotawrap_budget_remaining"] == "gauge"

    def test_each_call_reads_anew(self) -> None:
        """The exposition asks its reader on every scrape: nothing is kept between two."""
        reads = []

        def read() -> dict[str, Any]:
            reads.append(1)
            return {"models": [{**ROW, "usage": 1_000 * len(reads)}]}

        exposition = Exposition(read)
        first, second = exposition()[1], exposition()[1]
        assert b'quotawrap_settled_tokens_total{model="deepseek-v4"} 1000.0' in first
        assert b'quotawrap_settled_tokens_total{model="deepseek-v4"} 2000.0' in second
