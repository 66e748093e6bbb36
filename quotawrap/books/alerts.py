"""Webhook alerts: a Slack-compatible message (``{"text": ...}``) when a limit or budget crosses a threshold.

``--alert-webhook URL`` (with ``--alert-at 50,80,100``) starts an :class:`AlertWatcher` in the process
that owns the run or the service (the wrapper, ``quotawrap serve``), never in a guarded child. Each poll
reads the read side's snapshot, and for every limit (each model's daily limit, the run's cap, each budget)
claims the thresholds its settled share has reached. The claim is a lease in the ledger named after the
limit, its period and the threshold, held until the period ends and never released: the first process of
any host to take it sends the alert, every other one finds it taken, so each threshold fires once per limit
and period. A poll that claims several (50% and 80% at once) sends one message naming the highest.

Posting happens on a thread of its own, retried with a growing pause a bounded number of times, so a slow
or failing webhook never holds up a call. The message names the limit, its numbers, the period, the host
and the session: no key, no prompt, no answer, no tag other than a budget's name.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..config.settings import Settings
from ..core.records import Record
from ..core.thresholds import crossed, highest
from ..ledger import CallPath, Ledger
from ..support.host import hostname
from ..support.log import printable, warn

__all__ = [
    "AlertSender",
    "AlertWatcher",
    "Watched",
    "alert_payload",
    "budget_row",
    "claim_name",
    "day_limit_watched",
    "run_cap_watched",
    "shown_webhook",
    "start_alerts",
    "watched_limits",
]

DAILY_LIMIT = "daily limit"
RUN_CAP = "run cap"
BUDGET = "budget"
# A claim outlives its period by a day: a host whose clock is behind still finds it taken.
_CLAIM_MARGIN_S = 86_400.0
_RUN_PERIOD_S = 7 * 86_400.0  # a run's cap has no end of its own: its claims outlast any run
_POST_TIMEOUT_S = 10.0
BACKOFF_S: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)  # the pauses before each retry: five tries in all
_STOP_WAIT_S = 20.0  # what a stopping watcher waits for alerts still being posted
# Between two looks at the store: each reads the day's snapshot, and a threshold can wait seconds to be told.
POLL_S = 5.0


class Watched(Record, frozen=True):
    """One limit as an alert sees it: what it is, the period it counts, and its numbers now."""

    kind: str  # DAILY_LIMIT, RUN_CAP or BUDGET
    name: str  # the model, the run id or the budget's name
    period: str  # the Beijing day, the run id, or the budget's period
    used: int  # settled
    in_flight: int
    limit: int
    ends_at: float  # when the period ends (Unix seconds)
    unit: str = "tokens"  # or "cny" (micro-CNY) for a money budget
    stopped: bool = False  # the guard stops calling it for the period (a model evicted by a wall)

    @property
    def fraction(self) -> float:
        """Settled over the limit; a limit that stops calls has reached all of it, whatever the numbers."""
        if self.stopped:
            return float("inf")
        if self.limit <= 0:
            return float("inf") if self.used > 0 else 0.0
        return self.used / self.limit


def budget_row(budget: Mapping[str, Any]) -> dict[str, Any]:
    """A budget of the snapshot as /metrics and the alerts read it: ``name``, ``used``, ``in_flight``, ``limit``,
    ``left``, ``unit``, ``period`` and ``resets_at``, from the snapshot's keys (``name``/``limit``) or the budget
    records' own (``id``/``amount``/``period_key``/``left``, ``BudgetUse.as_json``). Pure."""
    limit = int(budget["limit"] if "limit" in budget else budget["amount"])
    used, in_flight = int(budget["used"]), int(budget.get("in_flight", 0))
    resets_at = budget.get("resets_at")
    return {
        "name": str(budget.get("name") or budget.get("id") or budget.get("spec")),
        "used": used,
        "in_flight": in_flight,
        "limit": limit,
        "left": int(budget["left"]) if "left" in budget else max(limit - used - in_flight, 0),
        "unit": str(budget.get("unit", "tokens")),
        "period": str(budget.get("period_key") or (f"{resets_at:.0f}" if resets_at is not None else "run")),
        "resets_at": None if resets_at is None else float(resets_at),
    }


def day_limit_watched(row: Mapping[str, Any], now: float) -> Watched:
    """A model's day as the live view draws it: against the lower of its effective limit and its usage line (where
    the model is stopped for the day), and reached whole once a wall stopped it. Pure."""
    limit = int(row["effective_limit"])
    walls = (row.get("limits") or {}).get("walls") or []
    if walls:
        limit = min(limit, int(walls[0]["cap"]))  # the first wall is the usage line (quota.soft_evict_walls)
    return Watched(
        DAILY_LIMIT,
        str(row["model"]),
        str(row["day"]),
        int(row["usage"]),
        int(row["in_flight"]),
        limit,
        now + float(row["seconds_to_reset"]),
        stopped=bool(row.get("evicted")),
    )


def watched_limits(data: Mapping[str, Any], now: float) -> list[Watched]:
    """Each model's daily limit and each budget of a read-side snapshot (``status_snapshot``'s shape). Pure."""
    watched = [day_limit_watched(row, now) for row in data.get("models", [])]
    for row in map(budget_row, data.get("budgets", [])):
        ends = row["resets_at"] if row["resets_at"] is not None else now + _RUN_PERIOD_S
        watched.append(
            Watched(BUDGET, row["name"], row["period"], row["used"], row["in_flight"], row["limit"], ends, row["unit"])
        )
    return watched


def run_cap_watched(run_id: str, settled: int, in_flight: int, cap: int, now: float) -> Watched:
    return Watched(RUN_CAP, run_id, run_id, settled, in_flight, cap, now + _RUN_PERIOD_S)


def claim_name(watched: Watched, threshold: float) -> str:
    """The lease that says an alert for ``threshold`` of this limit and period was sent."""
    return f"alert:{watched.kind}:{watched.name}:{watched.period}:{threshold * 100:g}"


def _amount(value: int, unit: str) -> str:
    return f"{value / 1_000_000:,.2f} CNY" if unit == "cny" else f"{value:,} tokens"


def alert_text(watched: Watched, threshold: float, passed: Sequence[float]) -> str:
    """``quotawrap: deepseek-v4 reached 80% of its daily limit (1,560,000 of 1,950,000 tokens settled, ...)``."""
    what = {DAILY_LIMIT: "its daily limit", RUN_CAP: "the run cap", BUDGET: "its budget"}.get(watched.kind, "a limit")
    subject = f"budget {watched.name}" if watched.kind == BUDGET else watched.name
    numbers = f"{_amount(watched.used, watched.unit)} of {_amount(watched.limit, watched.unit)} settled"
    if watched.in_flight > 0:
        numbers += f", +{_amount(watched.in_flight, watched.unit)} in flight"
    if watched.stopped:
        numbers += "; no more calls to it this day"
    period = f"Beijing day {watched.period}" if watched.kind == DAILY_LIMIT else None
    text = f"quotawrap: {printable(subject)} reached {threshold * 100:g}% of {what} ({numbers}"
    text += f"; {period})" if period else ")"
    lower = [t for t in passed if t < threshold]
    if lower:
        text += f"; also past {', '.join(f'{t * 100:g}%' for t in lower)} since the last check"
    return text


def alert_payload(
    watched: Watched, threshold: float, passed: Sequence[float], *, host: str, session: str | None
) -> dict[str, Any]:
    """Slack's incoming-webhook shape (``text``), and the same facts as fields for other receivers."""
    return {
        "text": alert_text(watched, threshold, passed)
        + f" on host {printable(host)}"
        + (f", session {printable(session)}" if session else ""),
        "quotawrap": {
            "limit": watched.kind,
            "name": watched.name,
            "period": watched.period,
            "threshold_percent": threshold * 100,
            "thresholds_percent": [t * 100 for t in passed],
            "used": watched.used,
            "in_flight": watched.in_flight,
            "limit_amount": watched.limit,
            "unit": watched.unit,
            "host": host,
            "session": session,
        },
    }


def shown_webhook(url: str) -> str:
    """The webhook as messages name it: scheme and host only (a Slack webhook's path is its secret)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0].rpartition('@')[2]}"


class AlertSender:
    """Posts payloads to the webhook on a daemon thread, in order; each retried after the pauses of
    ``backoff_s`` and then given up with one warning line. Never raises into its caller."""

    def __init__(
        self, url: str, *, backoff_s: Sequence[float] = BACKOFF_S, post: Callable[[str, bytes], None] | None = None
    ) -> None:
        self._url = url
        self._backoff = tuple(backoff_s)
        self._post = post or _post_json
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._wake = threading.Event()
        self._deadline: float | None = None  # set by close(): the pauses shrink to fit before it
        self._thread = threading.Thread(target=self._loop, name="quotawrap-alerts", daemon=True)
        self._thread.start()
        self.sent = 0
        self.failed = 0

    def submit(self, payload: dict[str, Any]) -> None:
        self._queue.put(payload)

    def close(self, timeout: float = _STOP_WAIT_S) -> None:
        """Send what is queued, waiting at most ``timeout``: each pause from then on is a quarter of the time
        left at most, so the retries still happen, sooner."""
        self._deadline = time.monotonic() + timeout
        self._queue.put(None)
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            warn(f"alerts: gave up waiting for the webhook at {shown_webhook(self._url)}; alerts may be lost")

    def _loop(self) -> None:
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            self._deliver(json.dumps(payload).encode())

    def _pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            if self._deadline is not None:
                end = min(end, time.monotonic() + max(0.0, self._deadline - time.monotonic()) / 4)
            left = end - time.monotonic()
            if left <= 0 or not self._wake.wait(left):
                return

    def _deliver(self, body: bytes) -> None:
        error: Exception | None = None
        for pause in (0.0, *self._backoff):
            self._pause(pause)
            try:
                self._post(self._url, body)
            except Exception as exc:
                error = exc
                continue
            self.sent += 1
            return
        self.failed += 1
        warn(
            f"alerts: the webhook at {shown_webhook(self._url)} refused an alert {len(self._backoff) + 1} times"
            f" ({type(error).__name__}: {printable(str(error))[:200]}); that alert is lost"
        )


def _post_json(url: str, body: bytes) -> None:
    """POST ``body`` as JSON; raises unless answered 2xx."""
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=_POST_TIMEOUT_S) as answer:
        answer.read()


class AlertWatcher:
    """Polls ``read`` (the limits to watch, now) on a daemon thread; claims and posts each threshold crossed.

    ``ledger`` keeps the claims (its leases, on its clock ``clock``). A context manager (start/stop)."""

    def __init__(
        self,
        ledger: CallPath,
        read: Callable[[float], list[Watched]],
        thresholds: Sequence[float],
        sender: AlertSender,
        *,
        clock: Callable[[], float],
        session: str | None = None,
        interval_s: float = POLL_S,
    ) -> None:
        self._ledger = ledger
        self._read = read
        self._thresholds = tuple(sorted(thresholds))
        self._sender = sender
        self._clock = clock
        self._session = session
        self._interval_s = interval_s
        self._host = hostname()
        self._holder = f"{self._host}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._decided: set[str] = set()  # claims this process took or found taken: not asked again
        self._failing = False  # said once that the ledger cannot be read, until it can again
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> AlertWatcher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="quotawrap-alert-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """One last poll (the run's final numbers), then the alerts still being posted, within a bound."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()
        self._sender.close()

    def __enter__(self) -> AlertWatcher:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self.poll()

    def poll(self) -> int:
        """Claim every threshold reached and not yet decided; post one alert per limit that won any. Returns
        how many alerts were queued. Never raises: the ledger's trouble is the guard's to report."""
        with self._lock:  # the final poll of stop() and the thread's last one never claim side by side
            try:
                now = self._clock()
                queued = sum(self._check(watched, now) for watched in self._read(now))
            except Exception as exc:
                if not self._failing:
                    warn(
                        f"alerts: cannot read the limits ({type(exc).__name__}: {printable(str(exc))[:200]});"
                        " trying again"
                    )
                self._failing = True
                return 0
            self._failing = False
            return queued

    def _check(self, watched: Watched, now: float) -> int:
        won = []
        for threshold in crossed(0.0, watched.fraction, self._thresholds):
            name = claim_name(watched, threshold)
            if name in self._decided:
                continue
            ttl = max(watched.ends_at - now, 0.0) + _CLAIM_MARGIN_S
            if self._ledger.try_lease(name, self._holder, ttl, now):
                won.append(threshold)
            self._decided.add(name)
        top = highest(won)
        if top is None:
            return 0
        self._sender.submit(alert_payload(watched, top, won, host=self._host, session=self._session))
        return 1


def start_alerts(ledger: Ledger, settings: Settings) -> AlertWatcher | None:
    """The ``--alert-webhook`` watcher of a wrapper or a gateway, started (None without a webhook): every model's
    daily limit and every budget of the store, and the cap, own budgets (``--budget``) and share of the store's
    per-run budgets of this run or session."""
    if not settings.alert_webhook:
        return None
    from ..core.budgets import parse_budget
    from ..core.thresholds import parse_thresholds
    from ..ledger.base import ledger_clock, run_key
    from ..ledger.budgets import uses_of
    from .status import status_snapshot

    run_id = settings.run_id
    # from the flags, not the ledger: the run removes its own budgets from it before the watcher's last look
    own = [parse_budget(spec, run_id=run_id) for spec in settings.budget] if run_id else []

    def read(now: float) -> list[Watched]:
        data = status_snapshot(ledger, settings, now)
        # what the store shows of a budget counted per run is no run's: this run's count of each is watched
        per_run = [budget for budget in ledger.budgets("") if budget.period == "run"] if run_id else []
        budgets = [*data["budgets"], *(use.as_json() for use in uses_of(ledger, [*per_run, *own], now, run_id))]
        watched = watched_limits({**data, "budgets": budgets}, now)
        if settings.cap_tokens is not None and run_id:
            spent = ledger.counters([run_key(run_id)])[run_key(run_id)]
            watched.append(run_cap_watched(run_id, spent.settled, spent.in_flight, settings.cap_tokens, now))
        return watched

    sender = AlertSender(settings.alert_webhook)
    thresholds = parse_thresholds(settings.alert_at)
    return AlertWatcher(ledger, read, thresholds, sender, clock=ledger_clock(ledger), session=run_id).start()
