"""The expiry-aware pool and `sync --b0`: the real billing SDK against the simulator, the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from quotawrap.books.sync import EXPIRY_LEAD_S, EXPIRY_MARGIN_S, SyncLoop, sync_due, sync_once
from quotawrap.config.settings import Settings
from quotawrap.core import quota
from quotawrap.core.usage import Usage
from quotawrap.ledger import open_ledger
from quotawrap.ledger.base import HoldRequest
from quotawrap.simulator import ArkSimulator, PackageSpec
from tests.conftest import beijing_noon, run_cli

MODEL = "deepseek-v4-flash"
DAY_S = 86_400.0
CREDENTIALS = {"VOLC_ACCESSKEY": "AKtest", "VOLC_SECRETKEY": "SKtest"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=CREDENTIALS)


@pytest.fixture
def credentials() -> Iterator[None]:
    """The billing SDK signs with these; the simulator only checks a signature is there."""
    saved = {key: os.environ.get(key) for key in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    yield None
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _spend(store: str, tokens: int) -> None:
    """Today's usage, as a guarded call would leave it."""
    ledger = open_ledger(store)
    now = time.time()
    hold = HoldRequest("agent", MODEL, quota.beijing_day(now), tokens, "chat", os.getpid(), "h", now + 60)
    ledger.settle(ledger.reserve(hold, lambda _s: []).hold_id, Usage(tokens, 0, tokens))


class TestExpiryAwarePool:
    def test_a_package_expiring_before_the_next_sync_is_left_out(
        self, sim: ArkSimulator, store: str, credentials: None
    ) -> None:
        """400k expiring in 10 min (< the 30 min cadence) is out of the pool now; one in 2 h stays in."""
        now = time.time()
        sim.set_packages(
            [
                PackageSpec(MODEL, 400_000, now - 29 * DAY_S, now + 600),
                PackageSpec(MODEL, 700_000, now - 29 * DAY_S, now + 7200),
                PackageSpec(MODEL, 500_000, now - DAY_S, now + 29 * DAY_S),
            ]
        )
        settings = Settings(store=store, billing_endpoint=sim.base_url, model=(MODEL,))
        snapshot = sync_once(open_ledger(store), settings, now)[MODEL]
        assert snapshot.balance == 1_200_000
        assert len(open_ledger(store).packages(MODEL)) == 3  # status still lists what expires

    def test_a_sync_is_due_just_after_each_known_expiry(self, sim: ArkSimulator, store: str) -> None:
        """Between cadence syncs, a package's ExpiryTime - lead and + margin each make the next check sync."""
        now = beijing_noon()  # the checks span half an hour, and a new Beijing day makes any sync due
        snap = quota.Snapshot(1_000_000, 0, 0, now, quota.beijing_day(now))
        settings = Settings()
        package = quota.Package(MODEL, 300_000, now + 1200)
        assert not sync_due(snap, 0, now + 1200 - EXPIRY_LEAD_S - 1, settings, [package])
        assert sync_due(snap, 0, now + 1200 - EXPIRY_LEAD_S, settings, [package])
        before = quota.Snapshot(1_000_000, 0, 0, now + 1000, quota.beijing_day(now))
        assert not sync_due(before, 0, now + 1200, settings, [package])
        assert sync_due(before, 0, now + 1200 + EXPIRY_MARGIN_S, settings, [package])
        after = quota.Snapshot(1_000_000, 0, 0, now + 1300, quota.beijing_day(now))
        assert not sync_due(after, 0, now + 1400, settings, [package])  # both edges already seen

    def test_the_loop_syncs_at_expiry_and_the_pool_drops(
        self, sim: ArkSimulator, store: str, credentials: None
    ) -> None:
        """The background loop syncs off-cadence just before and just after an expiry; the pool drops first."""
        start = beijing_noon()  # the ticks span over an hour, and a new Beijing day makes any sync due
        sim.set_packages(
            [
                PackageSpec(MODEL, 400_000, start - 29 * DAY_S, start + 3600),
                PackageSpec(MODEL, 500_000, start - DAY_S, start + 29 * DAY_S),
            ]
        )
        clock = {"t": start}
        sim.set_clock(lambda: clock["t"])
        ledger = open_ledger(store)
        loop = SyncLoop(
            ledger, Settings(store=store, billing_endpoint=sim.base_url, model=(MODEL,)), clock=lambda: clock["t"]
        )
        assert loop.tick()[MODEL].balance == 900_000
        clock["t"] = start + 1500  # not due on the cadence (30 min), and nothing expired
        assert loop.tick() == {}
        clock["t"] = start + 3600 - EXPIRY_LEAD_S  # 5 min before the expiry: due, and the package is out
        assert loop.tick()[MODEL].balance == 500_000
        clock["t"] += 60
        assert loop.tick() == {}
        clock["t"] = start + 3600 + EXPIRY_MARGIN_S  # just after the expiry: due again, off the cadence
        assert loop.tick()[MODEL].balance == 500_000


class TestExpiryWarnings:
    def _three_expiring(self, sim: ArkSimulator, store: str) -> None:
        now = time.time()
        sim.set_packages([PackageSpec(MODEL, 2_000_000, now - 28 * DAY_S, now + 2 * DAY_S) for _ in range(3)])
        assert _cli("sync", "--store", store, "--billing-endpoint", sim.base_url, "--model", MODEL).returncode == 0

    def test_keep_alive_advice_is_capped_and_says_the_shortfall(self, sim: ArkSimulator, store: str) -> None:
        """Three 2M packages expiring in two days: 'use 2,000,000 a day', and 2,000,000 expire anyway."""
        self._three_expiring(sim, store)
        text = _cli("status", "--store", store).stdout
        # seconds pass between the packages' creation and status: "two days" is a hair less
        assert "use 2,000,000 a day (the daily cap; 3,000," in text and "even so 2,000," in text
        assert "tokens expire unused" in text and "use 3,000," not in text.replace("cap; 3,000,", "")
        (row,) = json.loads(_cli("status", "--store", store, "--json").stdout)
        assert row["keep_alive_daily_usage"] == 2_000_000
        assert 3_000_000 <= row["keep_alive_needed"] < 3_001_000
        assert 2_000_000 <= row["keep_alive_shortfall"] < 2_001_000

    def test_a_run_warns_at_start_for_the_models_it_may_use(self, sim: ArkSimulator, store: str) -> None:
        """`quotawrap --model M -- cmd` names M's expiring packages; a run for another model does not."""
        self._three_expiring(sim, store)
        mine = _cli("--store", store, "--model", MODEL, "--", sys.executable, "-c", "pass")
        assert mine.returncode == 0, mine.stderr
        assert f"{MODEL}: 6,000,000 free tokens in 3 package(s) expire within 3 days" in mine.stderr
        assert "quotawrap consume" in mine.stderr
        other = _cli("--store", store, "--model", "doubao-*", "--", sys.executable, "-c", "pass")
        assert "expire within" not in other.stderr
        later = _cli("--store", store, "--expiry-warning-days", "1", "--", sys.executable, "-c", "pass")
        assert "expire within" not in later.stderr


class TestB0:
    def test_b0_sets_the_pool_whatever_was_used_since_midnight(self, store: str) -> None:
        """--b0 900,000 after 300,000 used: limit 850,000 (B0 - buffer), at any --balance-lag."""
        _spend(store, 300_000)
        result = _cli("sync", "--store", store, "--b0", f"{MODEL}=900,000")
        assert result.returncode == 0, result.stderr
        assert f"{MODEL}: initial balance 900,000 recorded (pool 900,000 at usage 300,000)" in result.stdout
        for lag in ("0", "1800"):
            (row,) = json.loads(_cli("status", "--store", store, "--json", "--balance-lag", lag).stdout)
            assert row["effective_limit"] == 850_000 and row["binding"] == "snapshot"

    def test_balance_and_b0_differ_by_todays_usage(self, store: str) -> None:
        """The same number read as the balance now gives a pool larger by today's usage."""
        _spend(store, 300_000)
        assert _cli("sync", "--store", store, "--balance", f"{MODEL}=900000").returncode == 0
        (row,) = json.loads(_cli("status", "--store", store, "--json").stdout)
        assert row["effective_limit"] == 1_150_000

    def test_bad_input_is_one_clear_line(self, store: str) -> None:
        """A malformed --b0, or --b0 with --balance, is refused with a line naming the cure."""
        bad = _cli("sync", "--store", store, "--b0", "nonsense")
        assert bad.returncode != 0 and "--b0 expects MODEL=TOKENS" in bad.stderr and "Traceback" not in bad.stderr
        both = _cli("sync", "--store", store, "--b0", f"{MODEL}=1", "--balance", f"{MODEL}=1")
        assert both.returncode == 2 and "not both" in both.stderr
        assert open_ledger(store).snapshot(MODEL) is None
