"""The SQLite ledger's budgets (ledger/budgets.py): their table, what a hold remembers of them, their counters.

A budget counter's settled part is a row of ``counters`` under its scope, as the run's is; what it has in
flight is summed from the holds that remember it (``hold_budgets`` joined with ``holds``), as every other
scope's is summed from holds (reserve.IN_FLIGHT). The tables are file.BUDGET_TABLES. ``hold_budgets`` keeps
a call's rows after it left holds, so a late settle of an unresolved call corrects the same counters; they
go with the call's row (prune).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from ...core.budgets import Budget
from ...core.quota import Counters, counts_cost
from ..budgets import encode_budget
from ..holds import Deltas

__all__ = [
    "budget_counters",
    "charge_budgets",
    "list_budget_texts",
    "remember_budgets",
    "remove_budget",
    "store_budget",
]


# A scope's tokens (or micro-CNY) in flight: the holds that remember it. Parameters: whether it counts cost, scope.
_IN_FLIGHT = (
    "SELECT SUM(CASE WHEN ?1 THEN h.reserved_cost ELSE h.reserved END) FROM hold_budgets b"
    " JOIN holds h ON h.id = b.hold_id WHERE b.scope = ?2"
)


def list_budget_texts(conn: sqlite3.Connection, run_id: str | None) -> list[str]:
    """The ledger's budgets, and the run's own when ``run_id`` is given (None: every run's too); a reserve reads
    them in its one statement (reserve.read_for_reserve)."""
    if run_id is None:
        return [text for (text,) in conn.execute("SELECT budget FROM budgets")]
    return [text for (text,) in conn.execute("SELECT budget FROM budgets WHERE run_id IN ('', ?)", (run_id,))]


def budget_counters(conn: sqlite3.Connection, scopes: Sequence[str]) -> dict[str, Counters]:
    """Each budget scope's settled and in flight, read in the caller's transaction."""
    found: dict[str, Counters] = {}
    for scope in scopes:
        row = conn.execute("SELECT settled FROM counters WHERE key = ?", (scope,)).fetchone()
        (held,) = conn.execute(_IN_FLIGHT, (counts_cost(scope), scope)).fetchone()
        found[scope] = Counters(row[0] if row else 0, held or 0)
    return found


def remember_budgets(conn: sqlite3.Connection, hold_id: str, scopes: Sequence[str]) -> None:
    """The hold counts against these budget scopes: its steps charge them."""
    conn.executemany("INSERT OR IGNORE INTO hold_budgets VALUES (?, ?)", [(hold_id, scope) for scope in scopes])


def charge_budgets(conn: sqlite3.Connection, hold_id: str, deltas: Deltas) -> None:
    """Add what a hold's step settled to the counters of the budgets it remembers (what it had in flight left
    with its row of holds)."""
    if not (deltas.settled or deltas.cost_settled):
        return
    for (scope,) in conn.execute("SELECT scope FROM hold_budgets WHERE hold_id = ?", (hold_id,)).fetchall():
        amount = deltas.cost_settled if counts_cost(scope) else deltas.settled
        if amount:
            conn.execute(
                "INSERT INTO counters (key, settled) VALUES (?, ?)"
                " ON CONFLICT (key) DO UPDATE SET settled = settled + excluded.settled",
                (scope, amount),
            )


def store_budget(conn: sqlite3.Connection, budget: Budget, now: float) -> bool:
    """Keep ``budget`` under its id (replacing the amount and softness it had); whether anything changed."""
    text = encode_budget(budget)
    row = conn.execute("SELECT budget FROM budgets WHERE id = ?", (budget.id,)).fetchone()
    if row is not None and row[0] == text:
        return False
    conn.execute("INSERT OR REPLACE INTO budgets VALUES (?, ?, ?, ?)", (budget.id, text, budget.run_id, now))
    return True


def remove_budget(conn: sqlite3.Connection, budget_id: str) -> bool:
    return conn.execute("DELETE FROM budgets WHERE id = ?", (budget_id,)).rowcount > 0
