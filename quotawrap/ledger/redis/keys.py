"""Every key the Redis ledger touches, and the KEYS list of each script, built here only.

Our keys sit under ``options.prefix``. A model-day's keys share the hash tag
``{qw:md:<day>:<model>}`` and a run's share ``{qw:run:<run>}``, so on Cluster each group is one
slot (a script may touch one slot only). The LiteLLM limiter's keys are named its way. The
layout and every hash field are described in docs/redis.md ("Key schema", "Glossary").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime, timedelta

from ...core.identity import UNMAPPED
from ...core.quota import BEIJING
from .options import DAY_S, RedisOptions

__all__ = ["Keys", "day_start", "expire_at"]

KEY_CACHE_MAX = 4096  # (script, day, model, run) key tuples a process keeps before starting afresh


@functools.lru_cache(maxsize=64)
def _midnight_after(day: str) -> float | None:
    """The Unix time of the Beijing midnight that ends ``day``; None for an unknown format.

    Cached: every reserve and settle asks, and strptime costs more than the rest of the key math.
    """
    try:
        start = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=BEIJING)
    except ValueError:
        return None
    return (start + timedelta(days=1)).timestamp()


def day_start(day: str) -> int:
    """The Unix time of the Beijing midnight that starts ``day`` (the reserve scripts check that the server's
    clock is in that day); 0 for an unknown format, which no server's day is."""
    end = _midnight_after(day)
    return 0 if end is None else int(end) - DAY_S


def expire_at(day: str, now: float, expires_at: float = 0.0) -> int:
    """Model-day keys live two days past the later of the day's end and ``now`` (late settles; the server's clock,
    which EXPIREAT is read on); an unknown day format counts as ending two days from now."""
    end = _midnight_after(day)
    day_end = now + 2 * DAY_S if end is None else end
    return int(max(day_end, expires_at, now) + 2 * DAY_S)


class Keys:
    """Key names for one prefix; the per-run, per-model-day lists are cached per process."""

    def __init__(self, options: RedisOptions) -> None:
        self.options = options
        self._prefix = options.prefix
        self._usage_dates: dict[str, str] = {}
        self._cache: dict[tuple[str, str, str, str], tuple[str, ...]] = {}

    # -- a model-day's slot ------------------------------------------------------------------

    def model_day(self, day: str, model: str) -> str:
        """The hash tag, and the start, of every key of one model-day."""
        return f"{{{self._prefix}:md:{day}:{model}}}"

    def md_counters(self, day: str, model: str) -> str:
        return f"{self.model_day(day, model)}:c"

    def md_open(self, day: str, model: str) -> str:
        return f"{self.model_day(day, model)}:open"

    def md_pids(self, day: str, model: str) -> str:
        return f"{self.model_day(day, model)}:pids"

    def md_run_totals(self, day: str, model: str, run_id: str) -> str:
        return f"{self.model_day(day, model)}:rt:{run_id}"

    def md_series(self, day: str, model: str) -> str:
        return f"{self.model_day(day, model)}:series"

    def md_audit(self, day: str, model: str) -> str:
        return f"{self.model_day(day, model)}:audit"

    def md_sync(self, day: str, model: str) -> str:
        return f"{self.model_day(day, model)}:sync"

    def md_line(self, day: str, model: str) -> tuple[str, str]:
        """The model-day's waiting line: (sorted set of waiters by ticket, hash of their leases)."""
        line = f"{self.model_day(day, model)}:line"
        return line, f"{line}:lease"

    def hold(self, day: str, model: str, hold_id: str) -> str:
        return f"{self.model_day(day, model)}:h:{hold_id}"

    # -- a run's slot ------------------------------------------------------------------------

    def _run(self, run_id: str) -> str:
        return f"{{{self._prefix}:run:{run_id}}}"

    def run_counters(self, run_id: str) -> str:
        return f"{self._run(run_id)}:c"

    def run_holds(self, run_id: str) -> str:
        return f"{self._run(run_id)}:h"

    def run_model_days(self, run_id: str) -> str:
        return f"{self._run(run_id)}:mds"

    def run_line(self, run_id: str) -> tuple[str, str]:
        """The run's waiting line: (sorted set of waiters by ticket, hash of their leases)."""
        line = f"{self._run(run_id)}:line"
        return line, f"{line}:lease"

    def run_info(self, run_id: str) -> str:
        return f"{self._run(run_id)}:info"

    # -- unslotted ---------------------------------------------------------------------------

    def meta(self) -> str:
        return f"{self._prefix}:meta"

    def tickets(self) -> str:
        """The ledger-wide sequence every waiter takes its ticket from."""
        return f"{self._prefix}:tickets"

    def active(self) -> str:
        return f"{self._prefix}:active"

    def models(self) -> str:
        return f"{self._prefix}:models"

    def runs(self) -> str:
        return f"{self._prefix}:runs"

    def packages(self, model: str) -> str:
        return f"{self._prefix}:packages:{model}"

    def lease(self, name: str) -> str:
        return f"{self._prefix}:lease:{name}"

    def location(self, hold_id: str) -> str:
        return f"{self._prefix}:loc:{hold_id}"

    def snapshot(self, model: str) -> str:
        return f"{self._prefix}:snap:{model}"

    def endpoints(self) -> str:
        """The endpoint id -> model id hash (quotawrap.core.identity)."""
        return f"{self._prefix}:endpoints"

    def member_keys(self) -> str:
        """The gateway's member keys: key hash -> record (member_keys.py)."""
        return f"{self._prefix}:member_keys"

    def member_key_names(self) -> str:
        """Member key name -> key hash: one name per key, never reused."""
        return f"{self._prefix}:member_key_names"

    # -- the budgets' slot (ledger/budgets.py) ----------------------------------------------------

    def _budgets(self) -> str:
        return f"{{{self._prefix}:budgets}}"

    def budget_defs(self) -> str:
        return f"{self._budgets()}:defs"

    def budget_version(self) -> str:
        return f"{self._budgets()}:v"

    def budget_counters(self) -> str:
        return f"{self._budgets()}:c"

    def budget_holds(self) -> str:
        return f"{self._budgets()}:h"

    def budget_gate(self) -> list[str]:
        return [self.budget_counters(), self.budget_holds(), self.budget_version()]

    def budget_apply(self) -> list[str]:
        return [self.budget_counters(), self.budget_holds()]

    def budget_set(self) -> list[str]:
        return [self.budget_defs(), self.budget_version()]

    # -- the LiteLLM limiter's ---------------------------------------------------------------

    def their_snapshot(self, model: str) -> tuple[str, str]:
        """(balance_at_sync, usage_at_sync) as the LiteLLM sync thread writes them."""
        prefix = self.options.snapshot_prefix
        return f"{prefix}:balance_at_sync:{model}", f"{prefix}:usage_at_sync:{model}"

    def _usage_date(self, day: str) -> str:
        cached = self._usage_dates.get(day)
        if cached is None:
            try:
                cached = datetime.strptime(day, "%Y-%m-%d").strftime(self.options.date_format)
            except ValueError:
                cached = day
            if len(self._usage_dates) > 64:  # a long-lived process sees one new day a day
                self._usage_dates.clear()
            self._usage_dates[day] = cached
        return cached

    def daily_usage_base(self, model: str, day: str) -> str:
        """``daily_usage:{date}:{model}:``, to which each writer appends its own hash."""
        return f"{self.options.daily_usage_prefix}:{self._usage_date(day)}:{model}:"

    def own_daily_usage(self, model: str, day: str) -> str:
        """Where our settled usage is mirrored for the LiteLLM limiter."""
        return f"{self.daily_usage_base(model, day)}{self.options.hash}"

    # -- each script's KEYS ------------------------------------------------------------------

    def _shared(self, script: str, day: str, model: str, run_id: str) -> tuple[str, ...]:
        """A script's keys besides the call's own: the same for a whole run on a model-day.

        Built once per process: a guarded call otherwise formats a dozen key names twice.
        """
        cache_key = (script, day, model, run_id)
        keys = self._cache.get(cache_key)
        if keys is not None:
            return keys
        if script == "reserve_one":  # KEYS[3..25]
            keys = (
                self.meta(),
                self.snapshot(model),
                *self.their_snapshot(model),
                self.run_counters(run_id),
                self.run_holds(run_id),
                self.run_model_days(run_id),
                self.md_counters(day, model),
                self.md_open(day, model),
                self.md_pids(day, model),
                self.md_run_totals(day, model, run_id),
                self.md_audit(day, model),
                *self.run_line(run_id),
                *self.md_line(day, model),
                self.tickets(),
                self.active(),
                self.models(),
                self.md_counters(day, UNMAPPED),
                *self.budget_gate(),
            )
        else:  # transition_one's KEYS[2..10]; md_transition's are the first six
            keys = (
                self.md_counters(day, model),
                self.md_open(day, model),
                self.md_pids(day, model),
                self.md_run_totals(day, model, run_id),
                self.md_series(day, model),
                self.md_audit(day, model),
                self.run_counters(run_id),
                self.run_holds(run_id),
                self.own_daily_usage(model, day),
            )
        if len(self._cache) >= KEY_CACHE_MAX:
            self._cache.clear()
        self._cache[cache_key] = keys
        return keys

    def reserve_one(self, day: str, model: str, run_id: str, hold_id: str, foreign: Sequence[str]) -> list[str]:
        own = (self.hold(day, model, hold_id), self.location(hold_id))
        return [*own, *self._shared("reserve_one", day, model, run_id), *foreign]

    def run_gate(self, run_id: str) -> list[str]:
        return [self.run_counters(run_id), self.run_holds(run_id), self.run_model_days(run_id), *self.run_line(run_id)]

    def md_reserve(self, day: str, model: str, run_id: str, hold_id: str) -> list[str]:
        return [
            self.md_counters(day, model),
            self.md_open(day, model),
            self.md_pids(day, model),
            self.hold(day, model, hold_id),
            self.md_run_totals(day, model, run_id),
            self.md_audit(day, model),
            *self.md_line(day, model),
        ]

    def run_apply(self, run_id: str) -> list[str]:
        return [self.run_counters(run_id), self.run_holds(run_id)]

    def transition_one(self, day: str, model: str, run_id: str, hold_id: str) -> list[str]:
        shared = self._shared("transition", day, model, run_id)
        return [self.hold(day, model, hold_id), *shared, self.location(hold_id), *self.budget_apply()]

    def md_transition(self, day: str, model: str, run_id: str, hold_id: str) -> list[str]:
        return [self.hold(day, model, hold_id), *self._shared("transition", day, model, run_id)[:6]]
