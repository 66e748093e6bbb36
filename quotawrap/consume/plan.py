"""What ``quotawrap consume`` may spend today, and when it stops: pure functions, no I/O.

The seed's 23:20 task (notes §1.1, §8.4, §9) clamps its plan twice: ``2M - usage`` and
``b0_est - SMALL_BUFFER - usage``. Here both clamps are the gate's own limit: the plan is
``effective_limit - usage - in_flight``, where ``effective_limit = min(daily_cap, pool -
small_buffer)`` on the lag-aware pool of :func:`quota.pool_estimate`. So the task can never plan
past what the gate would admit, and the seed's open item (``b0_est`` inflated by the billing
lag L) is closed by the same ``balance + usage(t_sync - lag)`` that closes it for the gate.
"""

from __future__ import annotations

import re

from ..core import quota
from ..core.records import Record

__all__ = [
    "DEFAULT_MAX_TOKENS_PER_CALL",
    "DEFAULT_STOP_BEFORE_S",
    "LEASE_TTL_S",
    "MIN_CALL_TOKENS",
    "ConsumePlan",
    "lease_name",
    "next_call_tokens",
    "parse_at",
    "plan_model",
    "render_plan",
    "seconds_until",
    "stop_reason",
]

# Ark's deepseek and doubao models all accept 16k output tokens; a larger max_tokens is a 400 on some.
DEFAULT_MAX_TOKENS_PER_CALL = 16_384
# Below this a call is not worth its round trip: the plan counts as spent.
MIN_CALL_TOKENS = 256
# Stop this long before Beijing midnight: a call still generating at 0:00 would count tomorrow
# for the collection but against today's pool, and the grant for today comes from today's usage.
DEFAULT_STOP_BEFORE_S = 600.0
LEASE_TTL_S = 48 * 3600.0  # §6.1: consume:last_run:{date}, TTL 48 h


def lease_name(day: str) -> str:
    """The per-day dedupe lease of §6.1: one consume run per Beijing day, from any host."""
    return f"consume:last_run:{day}"


class ConsumePlan(Record, frozen=True):
    """One model's plan for today: ``budget`` tokens, and the two clamps that bound it."""

    model: str
    day: str
    usage: int
    in_flight: int
    budget: int
    by_daily_cap: int  # daily_cap - usage - in_flight
    by_pool: int | None  # pool - small_buffer - usage - in_flight; None: no balance synced today
    pool: int | None
    binding: str  # "daily_cap", "snapshot" or "no_balance"
    detail: str  # the gate's own explanation of its limit


def plan_model(
    model: str,
    snapshot: quota.Snapshot | None,
    counters: quota.Counters,
    settings: quota.QuotaSettings,
    today: str,
) -> ConsumePlan:
    """Today's plan for one model, from the same limit the gate applies to every call.

    Without a balance synced today the plan is 0: the daily cap alone says nothing about the
    free pool, and spending blind up to 2M is exactly the overspend the task exists to avoid.
    """
    used = counters.settled + counters.in_flight
    by_cap = settings.daily_cap - used
    if snapshot is None or snapshot.day != today:
        return ConsumePlan(
            model,
            today,
            counters.settled,
            counters.in_flight,
            0,
            by_cap,
            None,
            None,
            "no_balance",
            "no balance synced today: run `quotawrap sync` (or pass --balance / --b0) first",
        )
    pool = quota.pool_estimate(snapshot, settings)
    effective, binding = quota.effective_limit(snapshot, settings, today=today)
    hold = next(limit for limit in quota.model_day_limits(snapshot, settings, today=today) if limit.kind == "hold")
    return ConsumePlan(
        model=model,
        day=today,
        usage=counters.settled,
        in_flight=counters.in_flight,
        budget=max(0, effective - used),
        by_daily_cap=by_cap,
        by_pool=pool - settings.small_buffer - used,
        pool=pool,
        binding=binding,
        detail=hold.detail,
    )


def render_plan(plan: ConsumePlan) -> str:
    """Two lines per model: the budget, then both clamps with their numbers."""
    head = f"{plan.model}: plan {plan.budget:,} tokens today ({plan.day})"
    if plan.by_pool is None:
        return f"{head}: {plan.detail}"
    return (
        f"{head}, bound by {plan.binding}\n"
        f"  daily cap - usage {plan.usage:,} - in flight {plan.in_flight:,} = {plan.by_daily_cap:,}\n"
        f"  pool {plan.pool:,} - small buffer - usage - in flight = {plan.by_pool:,}  [{plan.detail}]"
    )


def next_call_tokens(unassigned: int, prompt_tokens: int, max_tokens_per_call: int) -> int:
    """``max_tokens`` of the next call: its whole hold (prompt + output) fits what is unassigned.

    0 means stop: less than :data:`MIN_CALL_TOKENS` of output fits.
    """
    output = min(max_tokens_per_call, unassigned - prompt_tokens)
    return output if output >= MIN_CALL_TOKENS else 0


def stop_reason(
    *,
    unassigned: int,
    prompt_tokens: int,
    seconds_to_midnight: float,
    stop_before_s: float,
    error_streak: int,
    max_errors: int,
    blocked_by: str | None,
) -> str | None:
    """Why the task must stop now, or None to go on (checked before every call)."""
    if blocked_by is not None:
        return f"stopped at the {blocked_by} limit"
    if error_streak >= max_errors:
        return f"stopped after {error_streak} errors in a row"
    if seconds_to_midnight <= stop_before_s:
        return f"stopped {stop_before_s / 60:g} min before Beijing midnight"
    if next_call_tokens(unassigned, prompt_tokens, 1 << 62) == 0:
        return "plan spent"
    return None


_AT = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")


def parse_at(text: str) -> tuple[int, int]:
    """``HH:MM`` (Beijing) -> (hour, minute); ValueError on anything else."""
    match = _AT.match(text.strip())
    if match is None:
        raise ValueError(f"--at expects HH:MM (Beijing time, 24 h), got {text!r}")
    return int(match.group(1)), int(match.group(2))


def seconds_until(now: float, hour: int, minute: int) -> float:
    """Seconds from ``now`` to HH:MM Beijing today; 0 when that time has passed (run at once)."""
    target = quota.beijing_day_start(now) + hour * 3600 + minute * 60
    return max(0.0, target - now)
