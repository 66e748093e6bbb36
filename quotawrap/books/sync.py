"""Balance sync: turn a balance reading into the model-day snapshot the limit math uses.

The snapshot records ``usage(t_sync - lag)`` from the ledger's per-minute series, so the
pool estimate ``balance + lagged usage`` stays at or below the day's true pool B0 whenever
the billing lag is within ``--balance-lag`` (docs/quota-math.md). A console reading
(``--balance``) is taken as fully settled: its lagged usage is the usage at sync.

Cadence (wrapper and ``sync --loop``): every ``sync_interval`` (30 min); every
``sync_interval_low`` (5 min) when the remaining free balance is low; at once after a burst
of more than ``sync_burst`` tokens since the last sync; and just after each known package's
``ExpiryTime`` (``EXPIRY_LEAD_S`` before and ``EXPIRY_MARGIN_S`` after), because an expiry
drops the balance without any usage. A package that expires before the next sync can come is
left out of the balance at once: the pool must not count tokens that vanish before anyone looks
again (notes §7.5, remaining risk 2).
One process per ledger calls the
billing API at a time (a lease in the ledger); the others read the stored snapshot. A
failed sync keeps the old snapshot and says how old it is.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import date, timedelta

from ..config.settings import Settings
from ..core import quota
from ..core.errors import QuotawrapError
from ..core.expiry import expiring_before
from ..core.identity import UNMAPPED, canonical
from ..core.records import Record
from ..ledger import CallPath, Ledger, Reader, model_day_key
from ..ledger.base import ledger_clock
from ..support.log import warn
from .balance import BalanceUnavailable, read_balance_command, read_billing_api, sync_source

__all__ = [
    "EXPIRY_LEAD_S",
    "EXPIRY_MARGIN_S",
    "SyncLoop",
    "calibrate",
    "record_b0",
    "record_balance",
    "sync_due",
    "sync_once",
    "sync_source",
]

BILLING_LEASE = "billing-api"
# Billing flips a package to Expired at its ExpiryTime; a minute later the listing is sure to show it.
EXPIRY_MARGIN_S = 60.0
# The background loop also syncs this long before each expiry and leaves the package out then:
# the pool stops counting it shortly before it vanishes, not a whole cadence interval before.
EXPIRY_LEAD_S = 300.0


def record_balance(
    ledger: Ledger,
    model: str,
    balance: int,
    now: float,
    settings: quota.QuotaSettings,
    *,
    source: str,
    settled: bool = False,
) -> quota.Snapshot:
    """Store one balance reading as today's snapshot for ``model``."""
    day = quota.beijing_day(now)
    usage = ledger.counters([model_day_key(model, day)])[model_day_key(model, day)].settled
    if settled:
        lagged = usage
    else:
        yesterday = quota.beijing_day(now - quota.DAY_S)
        lagged = quota.lagged_usage(
            now,
            settings.balance_lag_s,
            usage,
            ledger.usage_series(model, day),
            ledger.usage_series(model, yesterday),
        )
    lag_s = 0.0 if settled else settings.balance_lag_s
    snapshot = quota.Snapshot(balance, usage, lagged, now, day, source, lag_s)
    ledger.put_snapshot(model, snapshot)
    return snapshot


def record_b0(ledger: Ledger, model: str, b0: int, now: float) -> quota.Snapshot:
    """Store the console's initial balance of the day (B0, read at usage 0) as today's snapshot.

    B0 is settled by construction (§4.2: the reading the notes trust to judge charges), so the
    pool is B0 itself at any lag: stored as the balance ``B0 - usage`` at today's usage, a
    settled reading. A usage already past B0 stores balance 0 (the limit is then 0 anyway).
    """
    day = quota.beijing_day(now)
    usage = ledger.counters([model_day_key(model, day)])[model_day_key(model, day)].settled
    snapshot = quota.Snapshot(max(0, b0 - usage), usage, usage, now, day, "console-b0")
    ledger.put_snapshot(model, snapshot)
    return snapshot


def candidate_models(ledger: CallPath, settings: Settings) -> list[str]:
    exact = [canonical(m) for m in settings.model if not any(ch in m for ch in "*?[")]
    named = [canonical(m) for m in settings.package_matches]
    return sorted({*exact, *ledger.known_models(), *named} - {UNMAPPED})


def sync_once(
    ledger: Ledger, settings: Settings, now: float, *, expiry_horizon_s: float | None = None
) -> dict[str, quota.Snapshot]:
    """Read the configured source once and store a snapshot per model it names.

    Packages expiring within ``expiry_horizon_s`` are left out of the balance. A one-off sync
    cannot count on another one soon, so by default that is a whole cadence interval; the
    background loop, which also syncs just before each expiry, passes a shorter one.
    """
    source = sync_source(settings)
    qsettings = settings.quota
    if source == "command":
        assert settings.balance_cmd is not None
        balances = read_balance_command(settings.balance_cmd)
        return {
            model: record_balance(ledger, model, balance, now, qsettings, source="command")
            for model, balance in balances.items()
        }
    if source == "billing-api":
        holder = f"{socket.gethostname()}:{os.getpid()}"
        if not ledger.try_lease(BILLING_LEASE, holder, 60.0, now):
            return {}  # another process is syncing this ledger; its snapshot is ours too
        try:
            packages = read_billing_api(
                candidate_models(ledger, settings),
                endpoint=settings.billing_endpoint,
                package_match={canonical(model): text for model, text in settings.package_matches.items()},
            )
        finally:
            ledger.release_lease(BILLING_LEASE, holder)
        # Packages listed before and none now were used up or expired, so the free balance is 0, not "unknown"
        # (which would keep yesterday's pool); a model that never matched a package may just be named otherwise.
        for model in candidate_models(ledger, settings):
            if model not in packages and _had_packages(ledger, model):
                packages[model] = []
        snapshots = {}
        ahead = settings.sync_interval + EXPIRY_MARGIN_S if expiry_horizon_s is None else expiry_horizon_s
        horizon = now + ahead  # the latest the next sync can come
        for model, owned in packages.items():
            ledger.put_packages(model, owned, now)
            gone = expiring_before(owned, now, horizon)
            balance = sum(p.available for p in owned if p.expires_at > now and p not in gone)
            snapshots[model] = record_balance(ledger, model, balance, now, qsettings, source="billing-api")
        return snapshots
    raise BalanceUnavailable(
        "no balance source: pass --balance MODEL=N, --balance-cmd CMD, or set VolcEngine credentials"
    )


def _had_packages(ledger: Ledger, model: str) -> bool:
    snapshot = ledger.snapshot(model)
    return bool(ledger.packages(model)) or (snapshot is not None and snapshot.source == "billing-api")


def sync_due(
    snapshot: quota.Snapshot | None,
    settled_now: int,
    now: float,
    settings: Settings,
    packages: Sequence[quota.Package] = (),
) -> bool:
    """Whether a model's snapshot should be refreshed now (the cadence of the module docstring)."""
    if snapshot is None or snapshot.day != quota.beijing_day(now):
        return True
    for package in packages:
        if any(snapshot.synced_at < package.expires_at + edge <= now for edge in (-EXPIRY_LEAD_S, EXPIRY_MARGIN_S)):
            return True
    age = now - snapshot.synced_at
    used_since = settled_now - snapshot.usage_at_sync
    if used_since > settings.sync_burst:
        return True
    remaining = snapshot.balance - used_since
    interval = settings.sync_interval_low if remaining < settings.low_balance else settings.sync_interval
    return age >= interval


class SyncLoop(Record):
    """Background sync for the wrapper's run and ``quotawrap sync --loop``."""

    ledger: Ledger
    settings: Settings
    clock: Callable[[], float] | None = None  # None: the ledger's (ledger_clock), whose day the guard keeps
    on_error: Callable[[str], None] = warn

    def __post_init__(self) -> None:
        self.check_every_s = self.settings.sync_check
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    def due_models(self, now: float) -> list[str]:
        day = quota.beijing_day(now)
        due = []
        for model in candidate_models(self.ledger, self.settings):
            settled = self.ledger.counters([model_day_key(model, day)])[model_day_key(model, day)].settled
            if sync_due(self.ledger.snapshot(model), settled, now, self.settings, self.ledger.packages(model)):
                due.append(model)
        return due

    def tick(self) -> Mapping[str, quota.Snapshot]:
        now = (self.clock or ledger_clock(self.ledger))()
        if not self.due_models(now):
            return {}
        try:
            # the next sync comes at the latest one cadence check after the next expiry lead
            horizon = EXPIRY_LEAD_S + self.settings.sync_check + EXPIRY_MARGIN_S
            result = sync_once(self.ledger, self.settings, now, expiry_horizon_s=horizon)
            self.last_error = None
            return result
        except QuotawrapError as exc:
            ages = [
                f"{model} {now - snap.synced_at:,.0f}s old"
                for model in candidate_models(self.ledger, self.settings)
                if (snap := self.ledger.snapshot(model)) is not None
            ]
            kept = ", ".join(ages) if ages else "no snapshot: daily caps alone apply"
            message = f"balance sync failed ({exc}); keeping the previous snapshot ({kept})"
            if message != self.last_error:
                self.on_error(message)
            self.last_error = message
            return {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="quotawrap-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.list_endpoints()
        while True:
            self.tick()
            if self._stop.wait(self.check_every_s):
                return

    def list_endpoints(self) -> dict[str, str]:
        """With the billing API as source (VolcEngine credentials), keep the account's endpoint ids and their
        models in the ledger (quotawrap.books.ark_endpoints); a failure is said and changes nothing."""
        if sync_source(self.settings) != "billing-api":
            return {}
        from .ark_endpoints import sync_endpoints

        try:
            return sync_endpoints(self.ledger, self.settings)
        except QuotawrapError as exc:
            self.on_error(f"endpoint listing failed ({exc}); endpoint ids are learned from their first answers")
            return {}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def calibrate(ledger: Reader, model: str, days: Sequence[str]) -> tuple[float, float]:
    """Estimate the billing lag from stored syncs: (lag seconds, worst day's spread in tokens)."""
    calibration_days = []
    for day in days:
        previous = (date.fromisoformat(day) - timedelta(days=1)).isoformat()
        calibration_days.append(
            quota.CalibrationDay(
                ledger.sync_history(model, day),
                ledger.usage_series(model, day),
                ledger.usage_series(model, previous),
            )
        )
    return quota.calibrate_lag_days(calibration_days)
