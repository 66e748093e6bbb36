"""Team budgets: a limit on what the calls matching some tags, a model or a key may spend per period.

Pure: the spec's grammar, the periods (Beijing time, like the model's day), which calls a budget
matches, and the limits a call's hold is checked against. The stores keep the budgets and their
counters; the check itself is ``quota.verdict`` on the limits built here (a budget is one more
counter scope, see :func:`budget_scope`), so a budget refuses, waits and explains itself as the
run cap does, and lua/lib.lua's ``blocking`` mirrors it.

A spec reads ``SELECTOR:AMOUNT/PERIOD[,soft]``:

* ``SELECTOR``: ``*`` (every call) or ``name=pattern`` pairs joined by ``,`` that must all match.
  ``model`` is the call's model, ``key`` its API key's fingerprint, any other name one of its tags;
  a pattern may hold ``*`` (any run of characters).
* ``AMOUNT``: tokens (``200000``, ``500k``, ``2M``, ``1.5m``) or CNY (``¥300``, ``300cny``, ``cny300``),
  priced as ``--cap-cost`` is.
* ``PERIOD``: ``run``, ``hour``, ``day``, ``week`` (ISO, from Monday) or ``month``, in Beijing time.
* ``soft``: never refuses; ``status`` and the live view show it, and the live view warns as it passes
  the thresholds it warns at for every limit.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from fnmatch import fnmatchcase
from typing import Any, Literal, get_args

from .errors import ConfigError
from .money import format_cny, parse_cny
from .quota import BEIJING, Counters, Limit, beijing_day
from .records import Record

__all__ = [
    "BUDGET_LIMIT",
    "BUDGET_PREFIX",
    "PERIODS",
    "Budget",
    "BudgetUse",
    "Period",
    "Unit",
    "applicable",
    "budget_limits",
    "budget_scope",
    "parse_budget",
    "period_end",
    "period_key",
    "uses_in",
]

Unit = Literal["tokens", "cny"]
Period = Literal["run", "hour", "day", "week", "month"]
PERIODS: tuple[Period, ...] = get_args(Period)

BUDGET_LIMIT = "budget"  # a budget's Limit is named "budget <its id>" (what a refusal, its hint and the records name)
BUDGET_PREFIX = "budget:"

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_TOKENS = re.compile(r"(\d+(?:\.\d+)?)([kKmMbB]?)")
_TOKEN_SCALE = {"": 1, "k": 1_000, "m": 1_000_000, "b": 1_000_000_000}
_CNY = re.compile(r"(?:[¥￥]|cny)\s*(\d+(?:\.\d+)?)|(\d+(?:\.\d+)?)\s*(?:cny|元)", re.IGNORECASE)
_SPEC_FORM = "SELECTOR:AMOUNT/PERIOD (e.g. team=search:200k/day or '*:cny300/month')"


class Budget(Record, frozen=True):
    """One budget. Its :attr:`id` (selector, period, unit, run) names its counters: setting the same id again
    replaces its amount and softness and keeps what was counted."""

    match: tuple[tuple[str, str], ...]  # (name, pattern), sorted by name; () matches every call
    amount: int  # tokens, or micro-CNY when unit is "cny"
    unit: Unit
    period: Period
    soft: bool = False
    run_id: str = ""  # a run's own budget (``--budget``): it counts and limits that run's calls alone

    @property
    def selector(self) -> str:
        return ",".join(f"{name}={pattern}" for name, pattern in self.match) or "*"

    @property
    def id(self) -> str:
        own = f"@run={self.run_id}" if self.run_id else ""
        return f"{self.selector}/{self.period}/{self.unit}{own}"

    def amount_text(self) -> str:
        return format_cny(self.amount) if self.unit == "cny" else f"{self.amount:,} tokens"

    @property
    def spec(self) -> str:
        """The spec that parses back to this budget (the run it belongs to aside)."""
        amount = f"cny{Decimal(self.amount).scaleb(-6).normalize():f}" if self.unit == "cny" else str(self.amount)
        return f"{self.selector}:{amount}/{self.period}{',soft' if self.soft else ''}"

    def matches(self, tags: Mapping[str, str], model: str, key: str | None = None, run_id: str = "") -> bool:
        """Whether a call with these tags, model, key fingerprint and run counts against this budget."""
        if self.run_id and self.run_id != run_id:
            return False
        for name, pattern in self.match:
            value = model if name == "model" else key if name == "key" else tags.get(name)
            if value is None or not fnmatchcase(value, pattern):
                return False
        return True

    def matches_any_key(self, tags: Mapping[str, str], model: str, run_id: str) -> bool:
        """Whether a call with these tags, model and run counts against it through some API key (a process's
        calls to one model may use several)."""
        other = tuple((name, pattern) for name, pattern in self.match if name != "key")
        return Budget(other, self.amount, self.unit, self.period, run_id=self.run_id).matches(tags, model, None, run_id)

    def may_match(self, tags: Mapping[str, str], run_id: str) -> bool:
        """Whether some call of a run with these tags may count against it (whatever its model and key): the
        budgets a run's live view and summary show."""
        if self.run_id and self.run_id != run_id:
            return False
        tags_only = tuple((name, pattern) for name, pattern in self.match if name not in ("model", "key"))
        return Budget(tags_only, self.amount, self.unit, self.period).matches(tags, "")


def _amount(text: str, spec: str) -> tuple[int, Unit]:
    money = _CNY.fullmatch(text)
    if money is not None:
        return parse_cny(money.group(1) or money.group(2)), "cny"
    tokens = _TOKENS.fullmatch(text.replace("_", "").replace(",", ""))
    if tokens is None:
        raise ConfigError(
            f"budget {spec!r}: {text!r} is no amount: write tokens (200000, 500k, 2M) or CNY (¥300, cny300, 300cny)"
        )
    try:
        value = Decimal(tokens.group(1)) * _TOKEN_SCALE[tokens.group(2).lower()]
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ConfigError(f"budget {spec!r}: {text!r} is no amount") from None
    if value != value.to_integral_value():
        raise ConfigError(f"budget {spec!r}: {text!r} is not a whole number of tokens")
    return int(value), "tokens"


def _selector(text: str, spec: str) -> tuple[tuple[str, str], ...]:
    if text.strip() == "*":
        return ()
    pairs: dict[str, str] = {}
    for part in text.split(","):
        name, sep, pattern = part.partition("=")
        name, pattern = name.strip(), pattern.strip()
        if not sep or not _NAME.fullmatch(name) or not pattern:
            raise ConfigError(f"budget {spec!r}: {part.strip()!r} is not NAME=VALUE (or '*' for every call)")
        if any(char.isspace() or ord(char) < 0x20 for char in pattern):
            raise ConfigError(f"budget {spec!r}: the value of {name} must not hold spaces or control characters")
        if name in pairs:
            raise ConfigError(f"budget {spec!r}: {name} is named twice")
        pairs[name] = pattern
    return tuple(sorted(pairs.items()))


def parse_budget(spec: str, *, soft: bool = False, run_id: str = "") -> Budget:
    """A spec as a :class:`Budget`; a ConfigError (one line, naming the form) for anything else."""
    text = spec.strip()
    selector, colon, rest = text.rpartition(":")
    if not colon or not selector.strip():
        raise ConfigError(f"budget {spec!r}: write {_SPEC_FORM}")
    amount_text, slash, after = rest.partition("/")
    period, *marks = (part.strip() for part in after.split(","))
    if not slash or not amount_text.strip():
        raise ConfigError(f"budget {spec!r}: write {_SPEC_FORM}")
    if period not in PERIODS:
        raise ConfigError(f"budget {spec!r}: the period must be one of {', '.join(PERIODS)}, got {period!r}")
    for mark in marks:
        if mark != "soft":
            raise ConfigError(f"budget {spec!r}: {mark!r} is no mark (only 'soft' may follow the period)")
    amount, unit = _amount(amount_text.strip(), spec)
    return Budget(_selector(selector, spec), amount, unit, period, soft or bool(marks), run_id)


# -- periods (Beijing time; China keeps no daylight saving) ----------------------------------------


def _beijing(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, BEIJING)


def period_key(period: Period, ts: float, run_id: str) -> str:
    """The period ``ts`` falls in, as its counters are named: the run's id, ``2026-12-07T17`` (hour),
    ``2026-12-07`` (day), ``2026-W49`` (ISO week) or ``2026-12`` (month)."""
    if period == "run":
        return run_id
    if period == "day":
        return beijing_day(ts)
    at = _beijing(ts)
    if period == "hour":
        return at.strftime("%Y-%m-%dT%H")
    if period == "week":
        year, week, _ = at.isocalendar()
        return f"{year}-W{week:02d}"
    return at.strftime("%Y-%m")


def period_end(period: Period, ts: float) -> float | None:
    """When the period ``ts`` falls in ends (its counters start afresh); None for a run's (it ends with the run)."""
    if period == "run":
        return None
    at = _beijing(ts)
    start = at.replace(minute=0, second=0, microsecond=0)
    if period == "hour":
        return (start + timedelta(hours=1)).timestamp()
    start = start.replace(hour=0)
    if period == "day":
        return (start + timedelta(days=1)).timestamp()
    if period == "week":
        return (start + timedelta(days=7 - start.weekday())).timestamp()
    days = calendar.monthrange(start.year, start.month)[1]
    return (start.replace(day=1) + timedelta(days=days)).timestamp()


def _when(ts: float | None) -> str:
    return "at the run's end" if ts is None else _beijing(ts).strftime("%Y-%m-%d %H:%M Beijing time")


# -- what a call is checked against ----------------------------------------------------------------


def budget_scope(budget: Budget, key: str) -> str:
    """The counter scope (and counter key) of ``budget`` in the period ``key``: the unit leads, so the stores
    and lua/lib.lua tell a money budget from a token one by the prefix alone (:func:`counts_cost`)."""
    unit = "cny" if budget.unit == "cny" else "tok"
    return f"{BUDGET_PREFIX}{unit}:{budget.id}|{key}"


def applicable(
    budgets: Iterable[Budget], tags: Mapping[str, str], model: str, key: str | None, run_id: str
) -> list[Budget]:
    """The budgets a call counts against, in id order (every store lists them alike)."""
    return sorted((b for b in budgets if b.matches(tags, model, key, run_id)), key=lambda b: b.id)


def budget_limits(budgets: Sequence[Budget], now: float, run_id: str) -> tuple[list[Limit], list[str]]:
    """For the budgets a call counts against (:func:`applicable`): the hold limits of the hard ones, and the
    scope of every one (hard or soft), which its hold charges as it charges the run's counters."""
    limits: list[Limit] = []
    scopes: list[str] = []
    for budget in budgets:
        scope = budget_scope(budget, period_key(budget.period, now, run_id))
        scopes.append(scope)
        if not budget.soft:
            detail = (
                f"budget {budget.spec} ({budget.amount_text()} per {budget.period}), resets"
                f" {_when(period_end(budget.period, now))}; anyone who can reach the ledger may raise it:"
                f" `quotawrap budget set '{budget.selector}:NEW/{budget.period}'`"
            )
            limits.append(Limit(f"{BUDGET_LIMIT} {budget.id}", scope, budget.amount, "hold", detail))
    return limits, scopes


class BudgetUse(Record, frozen=True):
    """A budget in its current period, as ``status``, ``report``, the live view and a run's summary show it."""

    budget: Budget
    period: str  # period_key's
    used: int  # settled (tokens, or micro-CNY)
    in_flight: int
    resets_at: float | None  # None: at the run's end

    @property
    def left(self) -> int:
        return max(self.budget.amount - self.used - self.in_flight, 0)

    @property
    def fraction(self) -> float:
        """The share of the budget used (settled), 1.0 for a budget of nothing."""
        return self.used / self.budget.amount if self.budget.amount else 1.0

    @property
    def label(self) -> str:
        return f"budget {self.budget.selector}/{self.budget.period}"

    def numbers(self) -> str:
        """``1,200 / 200,000 tokens, +300 in flight`` (or in CNY)."""
        fmt = format_cny if self.budget.unit == "cny" else (lambda n: f"{n:,}")
        unit = "" if self.budget.unit == "cny" else " tokens"
        flight = f", +{fmt(self.in_flight)} in flight" if self.in_flight else ""
        return f"{fmt(self.used)} / {fmt(self.budget.amount)}{unit}{flight}"

    def as_json(self) -> dict[str, object]:
        return {
            "id": self.budget.id,
            "spec": self.budget.spec,
            "unit": self.budget.unit,
            "amount": self.budget.amount,
            "soft": self.budget.soft,
            "period": self.budget.period,
            "period_key": self.period,
            "used": self.used,
            "in_flight": self.in_flight,
            "left": self.left,
            "resets_at": self.resets_at,
            "run_id": self.budget.run_id,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BudgetUse:
        """The use ``as_json`` wrote (a run's report read back)."""
        budget = parse_budget(data["spec"], run_id=data.get("run_id", ""))
        return cls(budget, data["period_key"], data["used"], data["in_flight"], data["resets_at"])

    def line(self) -> str:
        """One line: ``team=search 200,000 tokens/day: used 1,200, in flight 300, left 198,500, resets ...``."""
        fmt = format_cny if self.budget.unit == "cny" else (lambda n: f"{n:,}")
        soft = " (soft)" if self.budget.soft else ""
        return (
            f"{self.budget.selector} {self.budget.amount_text()}/{self.budget.period}{soft}: used {fmt(self.used)},"
            f" in flight {fmt(self.in_flight)}, left {fmt(self.left)}, resets {_when(self.resets_at)}"
        )


def uses_in(budgets: Sequence[Budget], now: float, run_id: str, counters: Mapping[str, Counters]) -> list[BudgetUse]:
    """Each budget's use in the period ``now`` falls in (a run's own budget: in its run), from the counters of
    its scope (``budget_scope``)."""
    uses = []
    for budget in budgets:
        key = period_key(budget.period, now, run_id or budget.run_id)
        seen = counters.get(budget_scope(budget, key), Counters())
        uses.append(BudgetUse(budget, key, seen.settled, seen.in_flight, period_end(budget.period, now)))
    return uses
