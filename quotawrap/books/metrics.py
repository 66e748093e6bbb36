"""Prometheus exposition of the store: ``GET /metrics`` on ``quotawrap serve`` and ``quotawrap dashboard``.

Every scrape reads the ledger once through the read side's one data function (the same numbers as
``status --json`` and the dashboard) and turns that snapshot into metric families: a custom collector on
a registry of its own, never the process-wide one or counters kept in memory, so every host, process and
restart of the server shows the ledger's figures, not what this process happened to see. docs/metrics.md
lists each metric and its labels.

Token counters count today's Beijing day, as the limits do: they start again at 0 at Beijing midnight,
which Prometheus's ``rate()`` and ``increase()`` take as a counter reset.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from ..config.settings import Settings
from ..ledger import Ledger
from .alerts import budget_row

__all__ = ["Exposition", "SnapshotCollector", "ledger_exposition", "metric_families"]

Snapshot = Mapping[str, Any]
# The text format every Prometheus reads (2.x too); the names and labels here need none of 1.0.0's escaping.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _model_families(models: list[Mapping[str, Any]]) -> Iterable[Metric]:
    settled = CounterMetricFamily(
        "quotawrap_settled_tokens", "Tokens settled today (Beijing day), per model.", labels=["model"]
    )
    in_flight = GaugeMetricFamily(
        "quotawrap_inflight_tokens", "Tokens held by calls in flight now, per model.", labels=["model"]
    )
    limit = GaugeMetricFamily(
        "quotawrap_limit_tokens",
        "Today's limits of each model: effective (the one the guard holds calls to), v6, lag_aware, daily_cap,"
        " usage_wall.",
        labels=["model", "limit"],
    )
    headroom = GaugeMetricFamily(
        "quotawrap_headroom_tokens",
        "Tokens a new call of this model may still reserve today (effective limit - settled - in flight).",
        labels=["model"],
    )
    refused = CounterMetricFamily(
        "quotawrap_refused_calls", "Calls refused today (Beijing day), per model.", labels=["model"]
    )
    waiting = GaugeMetricFamily(
        "quotawrap_waiting_calls", "Calls waiting for room now, per model (every run and host).", labels=["model"]
    )
    for row in models:
        model = str(row["model"])
        settled.add_metric([model], row["usage"])
        in_flight.add_metric([model], row["in_flight"])
        headroom.add_metric([model], row["headroom"])
        refused.add_metric([model], row.get("refused", 0))
        waiting.add_metric([model], row.get("waiting", 0))
        for name, cap in _limits(row).items():
            limit.add_metric([model, name], cap)
    return settled, in_flight, limit, headroom, refused, waiting


def _limits(row: Mapping[str, Any]) -> dict[str, int]:
    """The ``limit`` label's values: the effective limit, then the ones it is drawn from (the balance wall,
    "evicted once used", is no amount: ``status`` explains it)."""
    limits = {"effective": int(row["effective_limit"])}
    detail = row.get("limits") or {}
    for name in ("v6", "lag_aware", "daily_cap"):
        if detail.get(name) is not None:
            limits[name] = int(detail[name])
    walls = detail.get("walls") or []
    if walls:
        limits["usage_wall"] = int(walls[0]["cap"])  # the first wall is the usage line (quota.soft_evict_walls)
    return limits


def _tag_family(by_tag: Mapping[str, list[Mapping[str, Any]]]) -> Metric:
    family = CounterMetricFamily(
        "quotawrap_tag_settled_tokens",
        "Tokens settled today (Beijing day) by the value of a tag (user, team): the largest values each,"
        " the rest as value (others), calls without the tag as (none).",
        labels=["tag", "value"],
    )
    for tag, rows in sorted(by_tag.items()):
        for row in rows:
            family.add_metric([tag, str(row["key"])], row["settled_tokens"])
    return family


def _budget_family(budgets: list[Mapping[str, Any]]) -> Metric:
    family = GaugeMetricFamily(
        "quotawrap_budget_remaining",
        "What a budget has left this period (its amount - settled - in flight, never below 0), in its unit"
        " (tokens, or micro-CNY for unit cny).",
        labels=["budget", "unit"],
    )
    for row in map(budget_row, budgets):
        family.add_metric([row["name"], row["unit"]], row["left"])
    return family


def metric_families(data: Snapshot) -> list[Metric]:
    """The metric families of one snapshot of the read side (``status_snapshot``'s shape). Pure."""
    families = [*_model_families(list(data.get("models", []))), _tag_family(data.get("by_tag", {}))]
    if data.get("budgets"):
        families.append(_budget_family(list(data["budgets"])))
    unguarded = GaugeMetricFamily(
        "quotawrap_unguarded_processes",
        "Processes of running sessions on this host that run outside the guard (their calls are not guarded).",
    )
    unguarded.add_metric([], len(data.get("unguarded_processes", [])))
    families.append(unguarded)
    return families


class SnapshotCollector(Collector):
    """Reads a fresh snapshot on each scrape."""

    def __init__(self, read: Callable[[], Snapshot]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return metric_families(self._read())


class Exposition:
    """``GET /metrics``'s answer: ``(content type, body)``, read afresh on each call. Raises what the read
    raises (the server answers 503)."""

    def __init__(self, read: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(SnapshotCollector(read))

    def __call__(self) -> tuple[str, bytes]:
        return CONTENT_TYPE, generate_latest(self.registry)


def ledger_exposition(ledger: Ledger, settings: Settings, *, events_dir: str | None = None) -> Exposition:
    """The exposition of ``ledger`` as the read side sees it at each scrape (the ledger's clock).

    ``events_dir``: this host's runs' events logs (their waits and processes outside the guard); the
    state directory's by default."""
    from .status import current_status

    if events_dir is None:
        from ..config.paths import default_events_log

        events_dir = os.path.dirname(default_events_log("any"))
    directory = events_dir
    return Exposition(lambda: current_status(ledger, settings, events_dir=directory))
