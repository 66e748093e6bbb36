"""The hold state machine, as pure functions both stores apply (the Redis Lua library mirrors it).

::

    reserve ─┬─ blocked                       (refused: nothing held, nothing charged)
             └─ held ─┬─ settled             (actual usage charged; ``overshoot`` if it beat the hold)
                      ├─ released            (never reached generation: nothing charged)
                      └─ unresolved ── settled (real usage arrived after the whole hold was charged)

A hold sits on two counters per unit (tokens, micro-CNY cost): ``in_flight`` while held, and
``settled`` by what it was charged. Every transition is judged from the stored state, so a
retried or late event never counts twice: :func:`follow` moves the counters from what a hold
had to what its new state charges, and refuses any move that does not advance the state's rank.
(Redis keeps both counters; SQLite keeps ``settled`` and sums ``in_flight`` from its holds table,
sqlite/reserve.IN_FLIGHT, so there a move's ``in_flight`` delta is the row leaving holds.)
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["MAX_CHARGE", "RANK", "Deltas", "Event", "HoldState", "Step", "add_deltas", "clamp", "follow", "step"]

HoldState = Literal["blocked", "held", "settled", "released", "unresolved"]
Event = Literal["settle", "release", "resolve"]  # resolve: charge an open hold whose outcome is unknown

# The most one hold may count: the largest integer a double (a Lua number) holds exactly. No real
# call comes near it (it is 9e15 tokens); a usage or cost beyond it can only be a provider's or a
# parser's anomaly, and counting it as is would wrap Lua's integer formatting negative (lifting
# every limit) or overflow SQLite's 64-bit integers.
MAX_CHARGE = 2**53 - 1


def clamp(amount: int) -> int:
    """An amount as a ledger counts it: within 0..MAX_CHARGE, so no counter wraps or goes negative."""
    return 0 if amount < 0 else min(amount, MAX_CHARGE)


# How far along a hold is; a transition must go strictly forward. "gone" is the Redis run slot's
# word for a hold its model-day never took (a Cluster reserve refused or cut short).
RANK: dict[str, int] = {"held": 0, "unresolved": 1, "settled": 2, "released": 2, "gone": 2}


class Deltas(NamedTuple):  # a NamedTuple: built on every guarded call, and cheaper than a frozen dataclass
    """What one transition adds to a hold's counters (negative: taken off)."""

    settled: int
    in_flight: int
    cost_settled: int
    cost_in_flight: int


def add_deltas(total: Deltas | None, deltas: Deltas) -> Deltas:
    """Two transitions' deltas as one (``total`` None: none yet): a batch charges each counter once."""
    if total is None:
        return deltas
    return Deltas(
        total.settled + deltas.settled,
        total.in_flight + deltas.in_flight,
        total.cost_settled + deltas.cost_settled,
        total.cost_in_flight + deltas.cost_in_flight,
    )


class Step(NamedTuple):
    state: HoldState
    charged: int
    charged_cost: int
    overshoot: bool  # settled on more tokens than it held
    deltas: Deltas
    clamped: bool  # the usage or cost was outside 0..MAX_CHARGE and was charged as the bound


def follow(
    state: str,
    reserved: int,
    charged: int,
    reserved_cost: int,
    charged_cost: int,
    target: str,
    new_charged: int,
    new_charged_cost: int,
) -> Deltas | None:
    """Move a hold's counters from ``state`` (with its amounts) to ``target`` charged ``new_charged``.

    None when ``target`` is not ahead of ``state``: the same move applied twice, or two moves out
    of order, converge on the same counters.
    """
    if state not in RANK or RANK[target] <= RANK[state]:
        return None
    held = state == "held"
    return Deltas(
        settled=new_charged - charged,
        in_flight=-reserved if held else 0,
        cost_settled=new_charged_cost - charged_cost,
        cost_in_flight=-reserved_cost if held else 0,
    )


def step(
    state: str,
    event: Event,
    *,
    reserved: int,
    charged: int,
    reserved_cost: int,
    charged_cost: int,
    usage_total: int | None = None,
    cost: int | None = None,
) -> Step | None:
    """Apply one event to a hold; None when it changes nothing (unknown, final, or not applicable).

    ``settle`` with usage charges ``usage_total`` and ``cost`` (the reserved cost when no cost is
    known), each clamped to 0..MAX_CHARGE; ``settle`` without usage, and ``resolve``, charge the
    whole hold (outcome unknown: the crash-safe default); ``release`` charges nothing. Only a
    ``settle`` with real usage may correct an ``unresolved`` hold.
    """
    target: HoldState
    if event == "settle":
        if not (state == "held" or (state == "unresolved" and usage_total is not None)):
            return None
        if usage_total is None:
            target, actual, actual_cost = "unresolved", reserved, reserved_cost
        else:
            target, actual = "settled", clamp(usage_total)
            actual_cost = reserved_cost if cost is None else clamp(cost)
    elif state != "held":
        return None
    elif event == "release":
        target, actual, actual_cost = "released", 0, 0
    else:
        target, actual, actual_cost = "unresolved", reserved, reserved_cost
    deltas = follow(state, reserved, charged, reserved_cost, charged_cost, target, actual, actual_cost)
    if deltas is None:  # pragma: no cover - every case above moves forward
        return None
    clamped = target == "settled" and (actual != usage_total or (cost is not None and actual_cost != cost))
    return Step(target, actual, actual_cost, target == "settled" and actual > reserved, deltas, clamped)
