"""The Redis ledger's budgets (ledger/budgets.py): one slot, ``{<prefix>:budgets}``, for all of them.

The slot keeps the budgets (a hash, id -> encode_budget's text) and a version every change moves, the budget
counters (a hash: ``s:<scope>`` settled, ``f:<scope>`` in flight) and each budgeted hold's copy (a hash, as the
run slot's copy of a hold: what it reserved and was charged, and its budget scopes). On a single node the
reserve and transition scripts read and move them in the same step as every other counter; on Cluster the
budget gate (between the run gate and the model-day script) and budget_apply (beside run_apply) do, as the run
slot's scripts do. A reserve sends the version its budgets were read at; a script that finds another answers
as for a changed snapshot, and the budgets are read again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

from ...core.budgets import Budget
from ...core.quota import Counters
from ..budgets import BudgetBook, encode_budget
from .client import Arg, Client, as_int, as_text
from .keys import Keys

__all__ = ["BUDGETS_REUSE_S", "RedisBudgets", "budget_counters_of"]

BUDGETS_REUSE_S = 1.0  # a process reads the budgets again at least this often (the scripts check the version)


def budget_counters_of(reply: Sequence[object]) -> dict[str, Counters]:
    """lib.lua's budget_reply (scope, settled, in flight, ...) as counters by scope."""
    flat = [as_text(item) or "" for item in reply]
    return {flat[i]: Counters(int(flat[i + 1] or 0), int(flat[i + 2] or 0)) for i in range(0, len(flat) - 2, 3)}


class RedisBudgets:
    """The budgets of one Redis ledger, read at most every BUDGETS_REUSE_S unless asked fresh."""

    def __init__(self, client: Client, keys: Keys) -> None:
        self._client, self._keys = client, keys
        self._book = BudgetBook()
        self._read: tuple[float, str, list[Budget]] | None = None

    def for_reserve(self, *, fresh: bool) -> tuple[str, list[Budget]]:
        """(version, every budget): what a reserve checks, and the version its script compares."""
        now = time.monotonic()
        cached = self._read
        if cached is None or fresh or now - cached[0] >= BUDGETS_REUSE_S:
            version, budgets = self._client.retrying("read", self._read_all)
            cached = self._read = (now, version, budgets)
        return cached[1], cached[2]

    def _read_all(self) -> tuple[str, list[Budget]]:
        client = self._client
        version = client.get(self._keys.budget_version()) or "0"  # read first: a change after it is caught
        texts = client.hgetall(self._keys.budget_defs()).values()
        return version, sorted(self._book.decode(texts), key=lambda budget: budget.id)

    def listed(self, run_id: str | None) -> list[Budget]:
        """The ledger's budgets, and the run's own when ``run_id`` is given (None: every run's too)."""
        _, budgets = self.for_reserve(fresh=True)
        return [b for b in budgets if run_id is None or not b.run_id or b.run_id == run_id]

    def put(self, budget_id: str, budget: Budget | None) -> bool:
        """Keep ``budget`` under ``budget_id`` (None: remove it); whether anything changed."""
        client = self._client
        args: list[Arg] = [budget_id, "" if budget is None else encode_budget(budget)]
        changed = client.retrying("budget", partial(client.script, "budget_set", self._keys.budget_set(), args))
        self._read = None
        return bool(int(changed))

    def counters(self, scopes: Sequence[str]) -> dict[str, Counters]:
        client = self._client
        fields = [field for scope in scopes for field in (f"s:{scope}", f"f:{scope}")]
        if not fields:
            return {}
        values = client.retrying("read", partial(client.hmget, self._keys.budget_counters(), fields))
        return {scope: Counters(as_int(values[2 * i]), as_int(values[2 * i + 1])) for i, scope in enumerate(scopes)}

    def apply(self, hold_id: str, target: str, charged: int, charged_cost: int) -> None:
        """Cluster: move the hold's budget copy to the state its model-day reached (nothing without a copy)."""
        client = self._client
        args: list[Arg] = [hold_id, target, charged, charged_cost]
        client.retrying("settle", partial(client.script, "budget_apply", self._keys.budget_apply(), args))

    def gate(self, args: str, version: str) -> tuple[bool, dict[str, Counters]] | None:
        """Cluster: check the call's budgets and take their share; (taken, counters seen), None when the budgets
        changed since ``version`` was read."""
        client = self._client
        reply = client.retrying(
            "reserve", partial(client.script, "budget_gate", self._keys.budget_gate(), [args, version])
        )
        if int(reply[0]) == -1 and len(reply) == 1:
            self._read = None
            return None
        return bool(int(reply[0])), budget_counters_of(reply[1])
