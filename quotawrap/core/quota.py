"""Limit math: pure functions, no I/O.

Every backend (SQLite, Redis) asks this module which limits apply to a call and evaluates
them with the same rule, so a 429, ``status`` and the live line all explain themselves from
one source.

A limit is data, independent of the live counters:

* ``kind="hold"``  -- settled + in flight + reserve must be <= cap (the pre-gate);
* ``kind="wall"``  -- settled must be < cap (the seed's soft-evict lines: once crossed the
  model is evicted and answered 429 before any token counting).

The per-model, per-Beijing-day limit is the production limiter "v6 Snapshot-Offset" of the
VolcEngine quota notes, made safe against the billing API's settlement lag (notes §7.5,
remaining risk 1). ``docs/quota-math.md`` derives every formula below; the section numbers
in comments point into the notes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import field
from datetime import datetime, timedelta, timezone
from typing import Literal

from .errors import ConfigError
from .money import format_cny
from .records import Record

__all__ = [
    "BEIJING",
    "COST_BUDGET_PREFIX",
    "DAY_S",
    "DEFAULT_LAG_CANDIDATES_S",
    "Binding",
    "CalibrationDay",
    "Counters",
    "Limit",
    "LimitKind",
    "Package",
    "QuotaSettings",
    "Scope",
    "Snapshot",
    "Verdict",
    "beijing_day",
    "beijing_day_start",
    "calibrate_lag",
    "calibrate_lag_days",
    "charge",
    "cost_limits",
    "counts_cost",
    "effective_limit",
    "evicted_by",
    "lag_fit",
    "lagged_usage",
    "model_day_limits",
    "never_fits",
    "ordered",
    "pool_estimate",
    "run_limits",
    "seconds_to_beijing_midnight",
    "series_total",
    "should_restore",
    "should_soft_evict",
    "soft_evict_walls",
    "token_room",
    "usage_at",
    "verdict",
]

# "run", "model_day", "run_cost", or a budget's counter (core.budgets.budget_scope); counts_cost says which unit
Scope = str
COST_BUDGET_PREFIX = "budget:cny:"  # a budget scope counting micro-CNY (every other budget counts tokens)
LimitKind = Literal["hold", "wall"]
Binding = Literal["daily_cap", "snapshot"]
Series = Sequence[tuple[float, int]]


# -- core types (shared with the ledgers: names and semantics are fixed) -----------------------


class Limit(Record, frozen=True):
    name: str  # "run_cap", "daily_cap", "snapshot", "usage_wall", "balance_wall"
    scope: Scope
    cap: int
    kind: LimitKind = "hold"
    detail: str = ""  # how the cap was derived, for messages


class Counters(Record, frozen=True):
    settled: int = 0
    in_flight: int = 0


class Verdict(Record, frozen=True):
    allowed: bool
    blocking: Limit | None = None  # the first limit that refused the call

    @property
    def reason(self) -> str:
        if self.blocking is None:
            return "fits"
        return "evicted" if self.blocking.kind == "wall" else "over_limit"


def counts_cost(scope: Scope) -> bool:
    """Whether a scope counts micro-CNY (the run's cost, a money budget), not tokens."""
    return scope == "run_cost" or scope.startswith(COST_BUDGET_PREFIX)


def charge(scope: Scope, reserve: int, reserve_cost: int) -> int:
    """What a call adds to a scope's counters: its cost where the scope counts money, else its tokens."""
    return reserve_cost if counts_cost(scope) else reserve


def ordered(limits: Sequence[Limit]) -> list[Limit]:
    """The order ``verdict`` checks limits in: walls first, otherwise as given (sorted() is stable).

    The Redis ledger sends limits in this order and its Lua check walks them as sent.
    """
    return sorted(limits, key=lambda limit: limit.kind != "wall")


def verdict(
    limits: Sequence[Limit], counters: Mapping[str, Counters], reserve: int, *, reserve_cost: int = 0
) -> Verdict:
    """Decide one call. Walls are checked first: an evicted model is refused whatever it asks.

    The seed blocks on ``usage + reserve >= limit``; a hold here fits iff the sum is ``<= cap``,
    so a cap admits exactly one token more than the seed's limit of the same number (the seed's
    decision is reproduced by ``cap = limit - 1``). Walls are identical to the seed's
    ``usage >= line`` soft-evict test.
    """
    for limit in ordered(limits):
        c = counters.get(limit.scope, Counters())
        if limit.kind == "wall":
            if c.settled >= limit.cap:
                return Verdict(False, limit)
        elif c.settled + c.in_flight + charge(limit.scope, reserve, reserve_cost) > limit.cap:
            return Verdict(False, limit)
    return Verdict(True)


def never_fits(
    limits: Sequence[Limit], counters: Mapping[str, Counters], reserve: int, *, reserve_cost: int = 0
) -> Limit | None:
    """The limit a call can never pass, whatever settles first; None if only holds in flight stand in its way.

    Settled usage only grows within a day, and every hold in flight settles to at least 0, so a wall
    already crossed, or ``settled + reserve > cap``, refuses the call now and later alike: waiting
    for room cannot help it. (A day's limits end at Beijing midnight; that reset is not waited for.)
    """
    for limit in ordered(limits):
        c = counters.get(limit.scope, Counters())
        if limit.kind == "wall":
            if c.settled >= limit.cap:
                return limit
        elif c.settled + charge(limit.scope, reserve, reserve_cost) > limit.cap:
            return limit
    return None


def token_room(limits: Sequence[Limit], counters: Mapping[str, Counters]) -> int | None:
    """Tokens the tightest token hold limit leaves once everything in flight has settled; None: no such limit.

    What one call may ever reserve: ``settled + reserve <= cap`` for every token limit.
    """
    rooms = [
        limit.cap - counters.get(limit.scope, Counters()).settled
        for limit in limits
        if limit.kind == "hold" and not counts_cost(limit.scope)
    ]
    return min(rooms) if rooms else None


def evicted_by(limits: Sequence[Limit], counters: Mapping[str, Counters]) -> Limit | None:
    """The wall a model stands behind, if any: checked before any token counting (§7.6 short-circuit)."""
    for limit in limits:
        if limit.kind == "wall" and counters.get(limit.scope, Counters()).settled >= limit.cap:
            return limit
    return None


# -- Beijing calendar ----------------------------------------------------------------------------

# Volc counts collection per Beijing calendar day (§6.1 `daily_usage:{北京日期}`); China has no DST.
BEIJING = timezone(timedelta(hours=8), "Asia/Shanghai")
DAY_S = 86_400.0
_BEIJING_OFFSET_S = 8 * 3600.0


def beijing_day(ts: float) -> str:
    """The Beijing calendar day of a Unix timestamp, 'YYYY-MM-DD'."""
    global _last_day
    start, end, day = _last_day
    # Asked on every guarded call: the day's text is formatted once per day (a datetime and strftime per call
    # would be a measurable share of it). A millisecond's margin keeps float rounding at midnight out of it.
    if start < ts < end:
        return day
    day = datetime.fromtimestamp(ts, BEIJING).strftime("%Y-%m-%d")
    start = beijing_day_start(ts)
    _last_day = (start + 0.001, start + DAY_S - 0.001, day)
    return day


_last_day: tuple[float, float, str] = (0.0, 0.0, "")  # (after, before, day): the day of the last beijing_day


def beijing_day_start(ts: float) -> float:
    """The Unix timestamp of the Beijing midnight that starts ``ts``'s day."""
    return ts - (ts + _BEIJING_OFFSET_S) % DAY_S


def seconds_to_beijing_midnight(ts: float) -> float:
    """Seconds until the next Beijing midnight, in (0, 86400]: at midnight the next reset is a day away."""
    return DAY_S - (ts + _BEIJING_OFFSET_S) % DAY_S


# -- settings and snapshots ----------------------------------------------------------------------


class QuotaSettings(Record, frozen=True):
    daily_cap: int = 2_000_000  # collection cap per model per Beijing day (§1.2)
    small_buffer: int = 50_000  # v6 SMALL_BUFFER: covers package expiry between syncs (§7.5)
    usage_wall: int = 1_950_000  # SOFT_EVICT_USAGE_LIMIT (§7.6)
    balance_wall: int = 100_000  # SOFT_EVICT_BALANCE_LIMIT (§7.6)
    # How far the billing balance may trail our own usage: two of the provider's settlement batches, with room
    # (docs/quota-math.md, "Default lag").
    balance_lag_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("daily_cap", "small_buffer", "usage_wall", "balance_wall"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}")
        lag = self.balance_lag_s
        if isinstance(lag, bool) or not isinstance(lag, (int, float)) or not 0 <= lag < DAY_S:
            # a lag of a day or more would need the day before yesterday's series
            raise ConfigError(f"balance_lag must be seconds in [0, 86400), got {lag!r}")


class Snapshot(Record, frozen=True):
    """One balance sync of one model, stored by the ledger."""

    balance: int  # balance_at_sync: sum of the packages' AvailableAmount (§5)
    usage_at_sync: int  # our model_day usage when the balance was read
    # usage(t_sync - lag) on today's scale, from lagged_usage(); == usage_at_sync when lag = 0.
    # Negative when t_sync - lag falls yesterday: yesterday's still-unsettled tail is in `balance`.
    lagged_usage: int
    synced_at: float
    day: str  # Beijing day of synced_at: a snapshot never applies to another day (§7.2)
    source: str = "manual"  # "billing-api" | "manual" | "command" | "litellm"
    # The lag the sync assumed (lagged_usage = usage at synced_at - lag_s), kept so a snapshot of a writer that
    # records none (the LiteLLM limiter) gets the same treatment; out of equality, as the limits read lagged_usage.
    lag_s: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if self.balance < 0 or self.usage_at_sync < 0:
            raise ValueError(f"a snapshot has non-negative balance and usage, got {self}")


# -- the usage series ----------------------------------------------------------------------------


def usage_at(series: Series, t: float) -> int:
    """The cumulative usage of the last point stamped at or before ``t``; 0 before the first point.

    ``series`` is ``(timestamp, cumulative tokens)`` in ascending time, cumulative non-decreasing.
    """
    index = bisect_right(series, t, key=lambda point: point[0])
    return series[index - 1][1] if index else 0


def series_total(series: Series) -> int:
    """The last cumulative value: the day's whole usage for a finished day."""
    return series[-1][1] if series else 0


def lagged_usage(
    t_sync: float,
    lag_s: float,
    usage_at_sync: int,
    today_series: Series,
    previous_series: Series = (),
    *,
    bucket_s: float = 60.0,
) -> int:
    """``usage(t_sync - lag)`` of today's model-day counter, never more than it can have been.

    With lag 0 this is ``usage_at_sync``: v6 exactly. Otherwise it is a lower bound of today's
    usage at ``t_sync - lag``, which is what keeps ``balance + lagged <= B0`` (docs/quota-math.md):

    * series points are minute buckets; a point stamped ``m`` may hold usage up to ``m + bucket_s``
      (the SQLite ledger stamps the minute's start), so the series is read ``bucket_s`` earlier;
    * before today's midnight the counter is negative: the balance still holds yesterday's usage
      after ``t_sync - lag`` (unsettled at the sync), and it is not today's pool. Usage stamped
      after the reading point, in either day, only makes the result smaller: the safe side.
    """
    if lag_s <= 0:
        return usage_at_sync
    read_at = t_sync - lag_s - bucket_s
    yesterday_tail = series_total(previous_series) - usage_at(previous_series, read_at)
    return min(usage_at(today_series, read_at) - yesterday_tail, usage_at_sync)


# -- the model-day limit -------------------------------------------------------------------------


def pool_estimate(snapshot: Snapshot, settings: QuotaSettings) -> int:
    """Today's free pool as seen by one sync: ``balance + usage(t_sync - lag)``.

    Billing shows ``Bal(t) = B0 - U(t - Δ)`` (§4.2), so this is ``B0 - U(t-Δ) + U(t-lag) <= B0``
    whenever lag >= Δ. With lag 0 it is v6's ``balance_at_sync + usage_at_sync = B0 + L``
    (§7.5), over-estimating by the unsettled usage L.
    """
    lagged = snapshot.usage_at_sync if settings.balance_lag_s <= 0 else snapshot.lagged_usage
    return snapshot.balance + min(lagged, snapshot.usage_at_sync)


def _applies(snapshot: Snapshot | None, today: str | None) -> bool:
    return snapshot is not None and (today is None or snapshot.day == today)


def effective_limit(
    snapshot: Snapshot | None, settings: QuotaSettings, *, today: str | None = None
) -> tuple[int, Binding]:
    """Today's cumulative cap on a model's usage and the term that sets it.

    ``min(daily_cap, pool - small_buffer)``, never negative (§5 "Limit", §7.5). Without a
    snapshot, or with one of another day than ``today``, the daily cap alone: yesterday's
    numbers never set today's cap (§7.2's yesterday anchor is not expressible).
    ``today=None`` trusts the caller to pass today's snapshot.
    """
    if not _applies(snapshot, today) or snapshot is None:
        return settings.daily_cap, "daily_cap"
    from_snapshot = max(0, pool_estimate(snapshot, settings) - settings.small_buffer)
    if settings.daily_cap <= from_snapshot:
        return settings.daily_cap, "daily_cap"
    return from_snapshot, "snapshot"


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _lag_text(snapshot: Snapshot, settings: QuotaSettings) -> str:
    if settings.balance_lag_s <= 0:
        return f"usage at sync {_n(snapshot.usage_at_sync)}"
    return f"usage {settings.balance_lag_s / 60:g} min before sync {_n(snapshot.lagged_usage)}"


def _snapshot_text(snapshot: Snapshot, settings: QuotaSettings) -> str:
    pool = pool_estimate(snapshot, settings)
    synced = datetime.fromtimestamp(snapshot.synced_at, BEIJING).strftime("%H:%M")
    return (
        f"balance {_n(snapshot.balance)} at {synced} + {_lag_text(snapshot, settings)}"
        f" - small buffer {_n(settings.small_buffer)} = {_n(pool - settings.small_buffer)}"
    )


def soft_evict_walls(
    effective: int, balance_at_sync: int | None, settings: QuotaSettings, *, effective_by: str | None = None
) -> list[Limit]:
    """The two soft-evict lines of §7.6 as walls (evicted iff settled >= cap).

    When the effective limit is 0 the usage line evicts at once, and it is that limit, not the
    usage wall, that does it: the wall then carries the limit's name (``--daily-cap 0`` is refused
    by daily_cap), so the refusal's hint names the setting that would move it.
    """
    usage_line = min(effective, settings.usage_wall)
    drawn_by = effective_by if effective_by is not None and effective == 0 else "usage_wall"
    walls = [
        Limit(
            drawn_by,
            "model_day",
            usage_line,
            "wall",
            f"evicted at usage {_n(usage_line)} = min(effective limit {_n(effective)},"
            f" usage wall {_n(settings.usage_wall)})",
        )
    ]
    if balance_at_sync is not None and balance_at_sync < settings.balance_wall:
        # cap 1 = "settled must be 0": a pool that starts below the wall is not evicted before
        # its first token, or it would never earn a return and stay evicted for good (§7.6)
        walls.append(
            Limit(
                "balance_wall",
                "model_day",
                1,
                "wall",
                f"evicted once used: balance at sync {_n(balance_at_sync)} < balance wall {_n(settings.balance_wall)}",
            )
        )
    return walls


def model_day_limits(snapshot: Snapshot | None, settings: QuotaSettings, *, today: str | None = None) -> list[Limit]:
    """The pre-gate hold at the effective limit, then the soft-evict walls."""
    applies = _applies(snapshot, today)
    cap, binding = effective_limit(snapshot, settings, today=today)
    if binding == "daily_cap":
        reason = "no balance sync today" if not applies else "below the synced pool"
        detail = f"daily cap {_n(cap)} ({reason})"
        if applies and snapshot is not None:
            detail += f"; {_snapshot_text(snapshot, settings)}"
    else:
        assert snapshot is not None
        detail = f"{_snapshot_text(snapshot, settings)} (< daily cap {_n(settings.daily_cap)})"
    hold = Limit(binding, "model_day", cap, "hold", detail)
    balance = snapshot.balance if applies and snapshot is not None else None
    return [hold, *soft_evict_walls(cap, balance, settings, effective_by=binding)]


def run_limits(run_cap: int | None) -> list[Limit]:
    """The cap on one wrapper run (settled + in flight + reserve), if any."""
    if run_cap is None:
        return []
    if run_cap < 0:
        raise ConfigError(f"cap_tokens must be >= 0, got {run_cap}")
    return [Limit("run_cap", "run", run_cap, "hold", f"run cap {_n(run_cap)}")]


def cost_limits(cap_micro_cny: int | None) -> list[Limit]:
    """The run's money cap (micro-CNY, settled + in flight + this call's pessimistic cost), if any."""
    if cap_micro_cny is None:
        return []
    if cap_micro_cny < 0:
        raise ConfigError(f"cap_cost must be >= 0, got {cap_micro_cny}")
    return [Limit("cost_cap", "run_cost", cap_micro_cny, "hold", f"run cost cap {format_cny(cap_micro_cny)}")]


def should_soft_evict(usage: int, effective: int, balance_at_sync: int | None, settings: QuotaSettings) -> bool:
    """§7.6: usage >= min(effective, usage wall), or balance at sync < balance wall with usage > 0."""
    walls = soft_evict_walls(effective, balance_at_sync, settings)
    return evicted_by(walls, {"model_day": Counters(usage)}) is not None


def should_restore(usage: int, effective: int, balance_at_sync: int | None, settings: QuotaSettings) -> bool:
    """§7.6 symmetric restore: exactly when eviction would not happen, so no kick/restore flapping."""
    return not should_soft_evict(usage, effective, balance_at_sync, settings)


# -- lag calibration -----------------------------------------------------------------------------

DEFAULT_LAG_CANDIDATES_S: Sequence[float] = range(0, 3601, 60)


class CalibrationDay(Record, frozen=True):
    syncs: Sequence[tuple[float, int]]  # (t_sync, balance), one model, one Beijing day
    series: Series  # that day's cumulative usage series
    previous_series: Series = ()  # the day before's, for syncs within the lag of midnight


def _day_spread(day: CalibrationDay, lag_s: float, bucket_s: float) -> int:
    pools = [
        balance + lagged_usage(t, lag_s, usage_at(day.series, t), day.series, day.previous_series, bucket_s=bucket_s)
        for t, balance in day.syncs
    ]
    return max(pools) - min(pools)


def lag_fit(
    days: Sequence[CalibrationDay],
    candidates_s: Sequence[float] = DEFAULT_LAG_CANDIDATES_S,
    *,
    bucket_s: float = 0.0,
) -> list[tuple[float, int, int]]:
    """For each candidate lag: (lag, summed per-day spread, worst day's spread) of balance + lagged usage.

    Within a day the true pool is constant between package events, so the right lag makes the
    estimates agree. Days with fewer than two syncs say nothing and are skipped.

    Calibration reads minute stamps at face value (``bucket_s=0``) while the guard reads one
    bucket earlier: a point stamped at a minute's start holds usage up to the minute's end, so
    the fitted lag errs long (>= the true delay) and the guard, at that lag, errs low. Both
    errors sit on the safe side.
    """
    usable = [day for day in days if len(day.syncs) >= 2]
    fit = []
    for lag in candidates_s:
        spreads = [_day_spread(day, float(lag), bucket_s) for day in usable]
        fit.append((float(lag), sum(spreads), max(spreads, default=0)))
    return fit


def calibrate_lag_days(
    days: Sequence[CalibrationDay],
    candidates_s: Sequence[float] = DEFAULT_LAG_CANDIDATES_S,
    *,
    bucket_s: float = 0.0,
) -> tuple[float, float]:
    """(best lag, worst day's spread at it): the lag whose pools vary least, summed over days.

    Ties go to the largest lag: the data cannot tell those lags apart and the larger one is the
    safe side (it never raises the pool). A package arriving or expiring between two syncs of a
    day shows up as a spread no lag removes.
    """
    if not any(len(day.syncs) >= 2 for day in days):
        raise ValueError("calibration needs a day with at least two balance syncs")
    if not candidates_s:
        raise ValueError("calibration needs at least one candidate lag")
    fit = lag_fit(days, candidates_s, bucket_s=bucket_s)
    best_total = min(total for _, total, _ in fit)
    lag, _, worst = max((row for row in fit if row[1] == best_total), key=lambda row: row[0])
    return lag, float(worst)


def calibrate_lag(
    syncs: Sequence[tuple[float, int]],
    series: Series,
    candidates_s: Sequence[float] = DEFAULT_LAG_CANDIDATES_S,
    *,
    previous_series: Series = (),
    bucket_s: float = 0.0,
) -> tuple[float, float]:
    """(best lag seconds, spread of balance + usage(t - lag) across that day's syncs) for one day."""
    return calibrate_lag_days([CalibrationDay(syncs, series, previous_series)], candidates_s, bucket_s=bucket_s)


# -- packages (the ledgers store them; expiry advice lives in quotawrap.core.expiry) -------------------


class Package(Record, frozen=True):
    model: str
    available: int  # AvailableAmount left in the package
    expires_at: float
