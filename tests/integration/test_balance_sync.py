"""Balance sync end to end: the real billing SDK against the simulator's ListResourcePackages,
console readings, balance commands, the wrapper's background cadence, and `status`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quotawrap.books.balance import BalanceUnavailable, packages_from_items, parse_balance_args
from quotawrap.books.sync import BILLING_LEASE, SyncLoop, record_balance, sync_due, sync_once
from quotawrap.config.settings import Settings
from quotawrap.core import quota
from quotawrap.ledger import model_day_key, open_ledger
from quotawrap.simulator import ArkSimulator, PackageSpec
from tests.conftest import child, ledger_rows, run_cli, run_quotawrap

MODEL = "deepseek-v4-flash"
DAY_S = 86_400.0
CREDENTIALS = {"VOLC_ACCESSKEY": "AKtest", "VOLC_SECRETKEY": "SKtest"}


@pytest.fixture
def packaged_sim(sim: ArkSimulator) -> ArkSimulator:
    now = time.time()
    sim.set_packages(
        [
            PackageSpec(MODEL, 1_500_000, now - 25 * DAY_S, now + 5 * DAY_S),
            PackageSpec(MODEL, 300_000, now - DAY_S, now + 29 * DAY_S),
            PackageSpec("doubao-seed-1.6", 500_000, now - DAY_S, now + 29 * DAY_S),
        ]
    )
    return sim


class TestBillingApi:
    def test_sync_reads_packages_through_the_official_sdk(self, packaged_sim: ArkSimulator, store: str) -> None:
        """`quotawrap sync` pages ListResourcePackages and stores each model's summed balance and packages."""
        result = run_cli(
            "sync",
            "--store",
            store,
            "--billing-endpoint",
            packaged_sim.base_url,
            "--model",
            MODEL,
            "--model",
            "doubao-seed-1.6",
            env=CREDENTIALS,
        )
        assert result.returncode == 0, result.stderr
        ledger = open_ledger(store)
        assert ledger.snapshot(MODEL).balance == 1_800_000
        assert ledger.snapshot("doubao-seed-1.6").balance == 500_000
        assert sorted(p.available for p in ledger.packages(MODEL)) == [300_000, 1_500_000]
        assert any("ListResourcePackages" in path for path in packaged_sim.requests_by_path())

    def test_status_explains_limit_and_expiry(self, packaged_sim: ArkSimulator, store: str) -> None:
        """status --json: the snapshot binds below 2M; the package expiring in 5 days gets a daily usage."""
        assert (
            run_cli(
                "sync",
                "--store",
                store,
                "--billing-endpoint",
                packaged_sim.base_url,
                "--model",
                MODEL,
                env=CREDENTIALS,
            ).returncode
            == 0
        )
        rows = json.loads(run_cli("status", "--store", store, "--json").stdout)
        (row,) = [r for r in rows if r["model"] == MODEL]
        assert row["binding"] == "snapshot"
        assert row["effective_limit"] == 1_800_000 - 50_000
        assert row["balance_known"] is True
        assert [p["available"] for p in row["expiring_within_9_days"]] == [1_500_000]
        assert row["keep_alive_daily_usage"] >= 1_500_000 // 5
        assert 0 < row["seconds_to_reset"] <= DAY_S

    def test_missing_credentials_is_a_clear_error(self, packaged_sim: ArkSimulator, store: str) -> None:
        """Without AK/SK the sync fails saying which variables to set, and stores nothing."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("VOLC")}
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "quotawrap",
                "sync",
                "--store",
                store,
                "--billing-endpoint",
                packaged_sim.base_url,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1
        assert "VOLC_ACCESSKEY" in result.stderr

    def test_only_one_process_calls_the_billing_api(self, packaged_sim: ArkSimulator, store: str) -> None:
        """While another holder has the billing lease, a sync reads nothing and makes no request."""
        ledger = open_ledger(store)
        settings = Settings(store=store, billing_endpoint=packaged_sim.base_url, model=(MODEL,))
        now = time.time()
        assert ledger.try_lease(BILLING_LEASE, "other-host:1", 60.0, now)
        os.environ.update(CREDENTIALS)
        try:
            assert sync_once(ledger, settings, now) == {}
            assert not any("ListResourcePackages" in p for p in packaged_sim.requests_by_path())
            ledger.release_lease(BILLING_LEASE, "other-host:1")
            assert MODEL in sync_once(ledger, settings, now)
        finally:
            for key in CREDENTIALS:
                os.environ.pop(key, None)


class TestManualAndCommand:
    def test_console_reading_sets_the_pool_and_blocks_past_it(self, sim: ArkSimulator, store: str) -> None:
        """--balance MODEL=N (fully settled) makes limit = N + usage − buffer; a call past it gets a 429."""
        assert run_cli("sync", "--store", store, "--balance", f"{MODEL}=50100").returncode == 0
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url],
            child("one_call.py"),
            env={"SIM_URL": sim.url, "MAX_TOKENS": "200"},
        )
        assert "BLOCKED" in result.stdout
        assert "snapshot" in result.stdout and "quotawrap sync" in result.stdout
        assert sim.billed_total() == 0

    def test_failed_command_keeps_the_old_snapshot_and_says_its_age(self, store: str, tmp_path: Path) -> None:
        """A failing --balance-cmd leaves the previous snapshot in force and warns how old it is."""
        ledger = open_ledger(store)
        old = record_balance(ledger, MODEL, 900_000, time.time() - 600, quota.QuotaSettings(), source="manual")
        messages: list[str] = []
        loop = SyncLoop(ledger, Settings(store=store, balance_cmd="false", sync_interval=1.0), on_error=messages.append)
        assert loop.tick() == {}
        assert ledger.snapshot(MODEL) == old
        assert len(messages) == 1 and "keeping the previous snapshot" in messages[0] and "s old" in messages[0]

    def test_balance_command_json_and_lines(self, tmp_path: Path, store: str) -> None:
        """A --balance-cmd may print JSON or model=N lines."""
        script = tmp_path / "bal.py"
        script.write_text(f"print('{MODEL}=1,234,567')\n")
        settings = Settings(store=store, balance_cmd=f"{sys.executable} {script}")
        snaps = sync_once(open_ledger(store), settings, time.time())
        assert snaps[MODEL].balance == 1_234_567
        script.write_text(f"import json; print(json.dumps({{'{MODEL}': 7}}))\n")
        assert sync_once(open_ledger(store), settings, time.time())[MODEL].balance == 7


class TestBackgroundSync:
    def test_wrapper_syncs_in_the_background_and_after_a_burst(self, packaged_sim: ArkSimulator, store: str) -> None:
        """The running wrapper syncs at start and again once a burst passes --sync-burst."""
        packaged_sim.configure(reply_tokens=400)
        result = run_quotawrap(
            [
                "--store",
                store,
                "--base-url",
                packaged_sim.url,
                "--billing-endpoint",
                packaged_sim.base_url,
                "--model",
                MODEL,
                "--sync-check",
                "0.2",
                "--sync-burst",
                "500",
            ],
            [
                sys.executable,
                "-c",
                "import subprocess, sys, time\n"
                f"for _ in range(3): subprocess.run([sys.executable, {str(child('one_call.py')[1])!r}])\n"
                "time.sleep(1.5)\n",
            ],
            env={"SIM_URL": packaged_sim.url, "MAX_TOKENS": "400", **CREDENTIALS},
        )
        assert result.returncode == 0, result.stderr
        syncs = ledger_rows(store, "SELECT usage_at_sync FROM sync_history WHERE model = ?", (MODEL,))
        assert syncs[0] == (0,)
        assert len(syncs) >= 2 and syncs[-1][0] > 500


class TestPureHelpers:
    def test_sync_due_cadence(self) -> None:
        """Due: no snapshot, another day, a burst, 30 min normally, 5 min when the balance is low."""
        settings = Settings()
        now = time.time()
        snap = quota.Snapshot(1_000_000, 0, 0, now - 60, quota.beijing_day(now))
        assert sync_due(None, 0, now, settings)
        assert not sync_due(snap, 1_000, now, settings)
        assert sync_due(snap, 100_001, now, settings)
        assert sync_due(quota.Snapshot(1_000_000, 0, 0, now - 1801, quota.beijing_day(now)), 0, now, settings)
        low = quota.Snapshot(250_000, 0, 0, now - 301, quota.beijing_day(now))
        assert sync_due(low, 0, now, settings)
        assert not sync_due(quota.Snapshot(1_000_000, 0, 0, now - 301, quota.beijing_day(now)), 0, now, settings)
        yesterday = quota.Snapshot(1_000_000, 0, 0, now - 60, quota.beijing_day(now - DAY_S))
        assert sync_due(yesterday, 0, now, settings)

    def test_packages_match_the_longest_model_id(self) -> None:
        """A 'deepseek-v4-flash' package is not counted for 'deepseek-v4'; expired ones are skipped."""
        items = [
            {
                "ConfigurationName": "deepseek-v4-flash 免费资源包",
                "AvailableAmount": "100",
                "ExpiryTime": "2030-01-01T00:00:00Z",
                "Status": "Effective",
            },
            {
                "ConfigurationName": "deepseek-v4 免费资源包",
                "AvailableAmount": "7",
                "ExpiryTime": "2030-01-01T00:00:00Z",
                "Status": "Effective",
            },
            {
                "ConfigurationName": "deepseek-v4 免费资源包",
                "AvailableAmount": "9",
                "ExpiryTime": "2020-01-01T00:00:00Z",
                "Status": "Expired",
            },
        ]
        found = packages_from_items(items, ["deepseek-v4", "deepseek-v4-flash"], {})
        assert [p.available for p in found["deepseek-v4-flash"]] == [100]
        assert [p.available for p in found["deepseek-v4"]] == [7]

    def test_balance_args(self) -> None:
        """MODEL=N pairs parse with separators; junk is a clear error."""
        assert parse_balance_args(["a=1,000", "b-c=2_000"]) == {"a": 1000, "b-c": 2000}
        with pytest.raises(Exception, match="MODEL=TOKENS"):
            parse_balance_args(["nonsense"])

    def test_lagged_snapshot_uses_usage_before_the_lag(self, store: str) -> None:
        """A billing reading with lag records usage from the series before t − lag, not the usage now."""
        ledger = open_ledger(store)
        now = time.time()
        day = quota.beijing_day(now)
        ledger._conn().execute(  # a usage series: 1,000 an hour ago, 9,000 now
            "INSERT INTO usage_series VALUES (?, ?, ?, ?), (?, ?, ?, ?)",
            (MODEL, day, int((now - 3600) // 60), 1_000, MODEL, day, int(now // 60), 9_000),
        )
        ledger._conn().execute("INSERT INTO counters VALUES (?, 9000)", (model_day_key(MODEL, day),))
        snap = record_balance(ledger, MODEL, 500_000, now, quota.QuotaSettings(balance_lag_s=1800), source="x")
        assert (snap.usage_at_sync, snap.lagged_usage) == (9_000, 1_000)
        v6 = record_balance(ledger, MODEL, 500_000, now, quota.QuotaSettings(balance_lag_s=0), source="x")
        assert v6.lagged_usage == 9_000

    def test_unavailable_source_is_an_error(self, store: str) -> None:
        """With no source configured, sync_once raises a clear BalanceUnavailable."""
        env_keys = [k for k in os.environ if k.startswith("VOLC")]
        saved = {k: os.environ.pop(k) for k in env_keys}
        try:
            with pytest.raises(BalanceUnavailable, match="no balance source"):
                sync_once(open_ledger(store), Settings(store=store), time.time())
        finally:
            os.environ.update(saved)


class TestPackagesGone:
    def test_a_model_whose_packages_all_expired_gets_a_zero_balance(
        self, packaged_sim: ArkSimulator, store: str
    ) -> None:
        """Packages listed before and none now: the balance is 0 (evicting the model), not the stale pool."""
        ledger = open_ledger(store)
        settings = Settings(store=store, billing_endpoint=packaged_sim.base_url, model=(MODEL, "doubao-seed-1.6"))
        os.environ.update(CREDENTIALS)
        try:
            assert sync_once(ledger, settings, time.time())[MODEL].balance == 1_800_000
            packaged_sim.set_packages(
                [PackageSpec("doubao-seed-1.6", 500_000, time.time() - DAY_S, time.time() + DAY_S)]
            )
            snaps = sync_once(ledger, settings, time.time())
        finally:
            for key in CREDENTIALS:
                os.environ.pop(key, None)
        assert snaps[MODEL].balance == 0 and ledger.packages(MODEL) == []
        assert snaps["doubao-seed-1.6"].balance == 500_000
        limits = quota.model_day_limits(snaps[MODEL], quota.QuotaSettings(), today=snaps[MODEL].day)
        assert limits[0].cap == 0  # nothing more may be reserved on a model with no free balance


class TestCalibrateCommand:
    def test_calibrate_finds_the_billing_delay_from_stored_syncs(self, tmp_path: Path) -> None:
        """`sync --calibrate` reads yesterday's syncs and usage series and reports the 14-minute delay."""
        from quotawrap.core.usage import Usage
        from quotawrap.ledger.base import HoldRequest
        from quotawrap.ledger.sqlite.ledger import SQLiteLedger

        now = {"t": 0.0}
        path = tmp_path / "ledger.sqlite3"
        ledger = SQLiteLedger(path, clock=lambda: now["t"])
        start = quota.beijing_day_start(time.time()) - DAY_S + 8 * 3600  # yesterday 08:00 Beijing
        day = quota.beijing_day(start)
        b0, delay = 5_000_000, 14 * 60
        spent: list[tuple[float, int]] = []
        rng = random.Random(7)  # aperiodic traffic: a periodic one would fit lag + period as well
        for minute in range(600):
            now["t"] = start + minute * 60 + 17
            tokens = rng.choice((0, 0, 50, 900, 12_000))
            decision = ledger.reserve(
                HoldRequest("r", MODEL, day, tokens, "chat", os.getpid(), "h", now["t"] + 60), lambda _s: []
            )
            ledger.settle(decision.hold_id, Usage(tokens, 0, tokens))
            spent.append((now["t"], tokens))
            if minute >= 60 and minute % 7 == 3:  # a billing read every 7 minutes, lagging 14
                balance = b0 - sum(n for t, n in spent if t <= now["t"] - delay)
                record_balance(ledger, MODEL, balance, now["t"], quota.QuotaSettings(), source="billing-api")
        result = run_cli("sync", "--store", f"sqlite:///{path}", "--calibrate", "--days", "2")
        assert result.returncode == 0, result.stderr
        assert f"{MODEL}: billing lag ~14 min (spread 0 tokens)" in result.stdout


class TestSyncLoop:
    def test_sync_loop_daemon_syncs_and_stops_on_ctrl_c(self, store: str, tmp_path: Path) -> None:
        """`sync --loop` syncs on its cadence until interrupted, then exits cleanly."""
        import signal

        script = tmp_path / "bal.py"
        script.write_text(f"print('{MODEL}=777777')\n")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "quotawrap",
                "sync",
                "--loop",
                "--store",
                store,
                "--model",
                MODEL,
                "--balance-cmd",
                f"{sys.executable} {script}",
                "--sync-check",
                "0.1",
                "--sync-interval",
                "0.3",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        assert stdout.count(f"{MODEL}: balance 777,777 synced (command)") >= 2
        assert len(ledger_rows(store, "SELECT * FROM sync_history")) >= 2
