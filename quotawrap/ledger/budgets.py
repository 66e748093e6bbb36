"""Budgets as the stores keep them, and what a hold is checked against and charges (issue 33).

Both stores keep a budget as its canonical spec under its id (``core.budgets.Budget.id``) and count it in
one counter per period, named by ``core.budgets.budget_scope``: a token budget's counters are tokens, a
money budget's micro-CNY. A hold that matches budgets remembers their scopes (SQLite: rows of
``hold_budgets``; Redis: the hold's ``budgets`` field), so its settle, release or reclaim moves the same
counters by the same step (``holds.step``'s deltas) as the run's. A hard budget is one more hold limit of
the reserve's verdict; a soft one is counted and never refuses.

Advances (quotawrap.advances) take no room for calls that match a budget: a store refuses such an advance
with every limit fitting, so its process reserves each call on its own, against every budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from ..core.budgets import Budget, BudgetUse, applicable, budget_limits, budget_scope, parse_budget, period_key, uses_in
from ..core.quota import Limit

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .base import HoldRequest
    from .interface import Ledger

__all__ = ["BudgetBook", "budget_uses", "decode_budget", "encode_budget", "run_budget_uses", "uses_of"]


def encode_budget(budget: Budget) -> str:
    """What a store keeps of a budget: its spec and the run it belongs to."""
    return json.dumps({"spec": budget.spec, "run_id": budget.run_id}, sort_keys=True)


def decode_budget(text: str) -> Budget:
    fields = json.loads(text)
    return parse_budget(fields["spec"], run_id=fields.get("run_id", ""))


class BudgetBook:
    """The budgets a store read, decoded once per text (every reserve reads them: most ledgers keep none)."""

    __slots__ = ("_decoded",)

    def __init__(self) -> None:
        self._decoded: dict[str, Budget] = {}

    def decode(self, texts: Iterable[str]) -> list[Budget]:
        budgets = []
        for text in texts:
            budget = self._decoded.get(text)
            if budget is None:
                if len(self._decoded) > 1024:  # bounded: budgets come and go on a long-lived ledger
                    self._decoded.clear()
                budget = self._decoded[text] = decode_budget(text)
            budgets.append(budget)
        return budgets

    @staticmethod
    def for_call(
        budgets: Sequence[Budget],
        tags: Mapping[str, str],
        model: str,
        key: str | None,
        run_id: str,
        now: float,
    ) -> tuple[list[Limit], list[str]]:
        """The hard budgets' limits and every matching budget's scope, for one call at ``now``."""
        if not budgets:
            return [], []
        return budget_limits(applicable(budgets, tags, model, key, run_id), now, run_id)

    @staticmethod
    def bars_advance(budgets: Sequence[Budget], request: HoldRequest) -> bool:
        """Whether ``request`` is an advance some budget may apply to: its calls, drawn without asking the ledger,
        share its run, model and tags, but not always its API key."""
        return request.advance and any(b.matches_any_key(request.tags, request.model, request.run_id) for b in budgets)

    @staticmethod
    def for_hold(budgets: Sequence[Budget], request: HoldRequest, now: float) -> tuple[list[Limit], list[str]]:
        """``for_call`` of a hold; one taking over another's room (``taken_over``) is charged and never refused."""
        limits, scopes = BudgetBook.for_call(
            budgets, request.tags, request.model, request.key_fingerprint, request.run_id, now
        )
        return ([] if request.taken_over else limits), scopes


def budget_uses(ledger: Ledger, now: float, run_id: str | None) -> list[BudgetUse]:
    """Each budget of ``ledger`` (and of the run ``run_id``, when given) in the period ``now`` falls in."""
    return uses_of(ledger, ledger.budgets(run_id), now, run_id)


def uses_of(ledger: Ledger, budgets: Sequence[Budget], now: float, run_id: str | None) -> list[BudgetUse]:
    """These budgets in the period ``now`` falls in, from ``ledger``'s counters (a run's own still count once the
    run removed them)."""
    scopes = [budget_scope(b, period_key(b.period, now, run_id or b.run_id)) for b in budgets]
    return uses_in(budgets, now, run_id or "", ledger.counters(scopes))


def run_budget_uses(ledger: Ledger, now: float, run_id: str, tags: Iterable[str]) -> list[BudgetUse]:
    """The budgets some call of a run may count against, given its ``KEY=VALUE`` tags (its live view, its summary)."""
    tagged = dict(tag.partition("=")[::2] for tag in tags)
    return [use for use in budget_uses(ledger, now, run_id) if use.budget.may_match(tagged, run_id)]
