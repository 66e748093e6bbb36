"""Where a counter lives: typed scopes, and the counter keys callers pass to ``Ledger.counters``.

A counter key is a string so that callers can build one without importing a store, but it is
written and parsed here only: ``counter_key(scope)`` and ``parse_counter_key(key)`` are inverses
(model names may contain ``:``; a day never does). The limit scopes of ``quota.Scope`` map onto
these one to one (``scope_keys``), which is how a verdict's counters are named in either store.
"""

from __future__ import annotations

from ..core.records import Record

__all__ = [
    "CounterScope",
    "ModelDay",
    "Run",
    "RunCost",
    "counter_key",
    "model_day_key",
    "parse_counter_key",
    "run_cost_key",
    "run_key",
    "scope_keys",
]


class Run(Record, frozen=True):
    """The tokens of one run, over every model and day."""

    run_id: str


class RunCost(Record, frozen=True):
    """The cost of one run in micro-CNY."""

    run_id: str


class ModelDay(Record, frozen=True):
    """The tokens of one model on one Beijing day (what the provider's daily cap counts)."""

    model: str
    day: str


CounterScope = Run | RunCost | ModelDay

_RUN, _COST, _MODEL_DAY = "run:", "cost:", "md:"


def run_key(run_id: str) -> str:
    return f"{_RUN}{run_id}"


def run_cost_key(run_id: str) -> str:
    return f"{_COST}{run_id}"  # micro-CNY


def model_day_key(model: str, day: str) -> str:
    return f"{_MODEL_DAY}{day}:{model}"


def counter_key(scope: CounterScope) -> str:
    if isinstance(scope, Run):
        return run_key(scope.run_id)
    if isinstance(scope, RunCost):
        return run_cost_key(scope.run_id)
    return model_day_key(scope.model, scope.day)


def parse_counter_key(key: str) -> CounterScope | None:
    """The scope a counter key names; None for a key no ledger keeps (its counters read as zero)."""
    if key.startswith(_RUN):
        return Run(key.removeprefix(_RUN))
    if key.startswith(_COST):
        return RunCost(key.removeprefix(_COST))
    if key.startswith(_MODEL_DAY):
        day, sep, model = key.removeprefix(_MODEL_DAY).partition(":")
        if sep:
            return ModelDay(model, day)
    return None


def scope_keys(run_id: str, model: str, day: str) -> dict[str, str]:
    """The counter key of each limit scope (``quota.Scope``) for one call: what its verdict reads."""
    return {"run": run_key(run_id), "model_day": model_day_key(model, day), "run_cost": run_cost_key(run_id)}
