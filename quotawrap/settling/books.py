"""What a guard writes down and prices: the price table, the audit log, the --fail-open record.

One :class:`Books` per guard, shared by its admissions (a hold's worst cost) and its landing (a settle's
cost, the audit record). These never decide whether a call goes out, they only account for it (and never
raise into the caller).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from ..config.settings import Settings
from ..core.endpoint_prices import CostRule, with_media_prices
from ..core.estimate import Estimate
from ..core.usage import Usage
from ..support.log import warn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..core.prices import PriceTable
    from ..ledger.base import CallState
    from .call import CallContext

__all__ = ["Books"]


class Books:
    """The run's prices and records: one per guard, whatever calls it admits."""

    __slots__ = ("_clock", "_prices", "_reserve_costs", "host", "run_id", "settings", "tags")

    def __init__(
        self, settings: Settings, *, run_id: str, host: str, tags: Mapping[str, str], clock: Callable[[], float]
    ) -> None:
        self.settings = settings
        self.run_id = run_id
        self.host = host
        self.tags = dict(tags)
        self._clock = clock
        self._prices: PriceTable | None = None
        self._reserve_costs: dict[tuple[object, ...], int] = {}

    def record_unguarded(self, model: str, kind: str, error: Exception | None) -> None:
        """A call let through unguarded is never silent: it goes into a JSONL the wrapper reports. ``error``: the
        store's, under --fail-open; None: --model does not name the model (``reason`` says which)."""
        if not self.settings.unguarded_log:
            return
        line = {
            "time": self._clock(),
            "run_id": self.run_id,
            "model": model,
            "endpoint": kind,
            "pid": os.getpid(),
            "reason": "fail-open" if error is not None else "model-filter",
            "error": str(error) if error is not None else None,
        }
        try:
            from ..support.files import append_private, private_dir

            private_dir(Path(self.settings.unguarded_log).parent)
            append_private(self.settings.unguarded_log, (json.dumps(line) + "\n").encode())
        except OSError as exc:
            warn(f"cannot record an unguarded call in {self.settings.unguarded_log}: {exc}")

    @property
    def prices(self) -> PriceTable:
        if self._prices is None:
            from ..config.file import load_price_table

            self._prices = with_media_prices(load_price_table(self.settings))
        return self._prices

    def reserve_cost(self, model: str, estimate: Estimate, rule: CostRule | None = None) -> int:
        """Micro-CNY a hold may cost at worst (per image, plugin fees, batch discount: ``rule``).

        Pure in its arguments for one price table, and an agent's calls repeat them: remembered.
        """
        costs = self._reserve_costs
        prices = self.prices
        # the estimate's two counts, not the record: hashing and comparing a record runs Python code
        key = (model, estimate.input_tokens, estimate.output_allowance, rule, id(prices))
        cost: int | None = costs.get(key)
        if cost is None:
            if rule is not None:
                cost = int(rule.reserve(prices, model, estimate))
            else:
                cost = int(prices.reserve_cost(model, estimate.input_tokens, estimate.output_allowance))
            if len(costs) >= 256:
                costs.clear()
            costs[key] = cost
        return cost

    def actual_cost(self, model: str, usage: Usage, rule: CostRule | None = None) -> int:
        if rule is not None:
            return int(rule.actual(self.prices, model, usage))
        return int(self.prices.actual_cost(model, usage))

    def audit(
        self,
        context: CallContext,
        state: CallState,
        usage: Usage | None,
        cost: int,
        latency_s: float,
        *,
        anomaly: str | None = None,
    ) -> None:
        """Append the call to ``--audit-log`` (the ledger keeps its own record), and record its tokens as
        OpenTelemetry metrics under ``--otel``; never raises.

        A usage anomaly is kept in the record (``usage_anomaly``, counted by ``report``) and in its
        tags (``quotawrap.anomaly``), so ``report --by tag:quotawrap.anomaly`` finds those calls.
        """
        if self.settings.otel and usage is not None and state == "settled" and anomaly is None:
            from .otel import record_token_usage

            record_token_usage(context.model, context.endpoint, usage.prompt_tokens, usage.completion_tokens)
        if not self.settings.audit_log:
            return
        tags = self.tags if anomaly is None else {**self.tags, "quotawrap.anomaly": anomaly}
        record = context.record(state, usage, cost, latency_s, tags=tags, ended_at=self._clock(), host=self.host)
        if anomaly is not None:
            record = dataclasses.replace(record, usage_anomaly=anomaly)
        try:
            from .audit_log import append_jsonl

            append_jsonl(self.settings.audit_log, record)
        except OSError as exc:
            warn(f"cannot write the audit log {self.settings.audit_log}: {exc}")
