"""`quotawrap consume` end to end: the real CLI, a real guarded agent, the simulator's bill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quotawrap.books.sync import record_balance
from quotawrap.config.settings import Settings
from quotawrap.consume.plan import LEASE_TTL_S, lease_name
from quotawrap.consume.spend import ConsumeOptions, run_consume
from quotawrap.core import quota
from quotawrap.ledger import model_day_key, open_ledger
from quotawrap.simulator import ArkSimulator
from tests.conftest import child, communicate_all, run_cli, run_quotawrap, start_cli

MODEL = "deepseek-v4-flash"
BALANCE = 900_000
SMALL_BUFFER = 50_000
AGENT_TOKENS = 300_000
PER_CALL = 100_000  # a few big calls keep the test at a few seconds
ENV = {"ARK_API_KEY": "sk-consume-test"}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={**ENV, **(env or {})})


def _two_at_once(*args: str) -> list[str]:
    """Two `quotawrap ARGS` started together (two hosts, or two timers firing): their stderr, both having exited 0."""
    procs = [start_cli(*args, env=ENV) for _ in range(2)]
    outputs = communicate_all(procs, timeout=120)
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    return [err for _, err in outputs]


def _consume_args(sim: ArkSimulator, store: str, *extra: str) -> list[str]:
    return [
        "consume",
        "--store",
        store,
        "--model",
        MODEL,
        "--base-url",
        sim.url,
        "--max-tokens-per-call",
        str(PER_CALL),
        "--stop-before",
        "0",
        *extra,
    ]


@pytest.fixture
def spent_day(sim: ArkSimulator, store: str) -> ArkSimulator:
    """The acceptance setup: a 900,000 balance synced, then a guarded agent spends ~300,000 of it."""
    sim.configure(reply_tokens=AGENT_TOKENS, tokens_per_chunk=4096)
    assert _cli("sync", "--store", store, "--balance", f"{MODEL}={BALANCE}").returncode == 0
    agent = run_quotawrap(
        ["--store", store, "--base-url", sim.url],
        child("one_call.py"),
        env={"SIM_URL": sim.url, "MAX_TOKENS": str(AGENT_TOKENS)},
    )
    assert agent.returncode == 0 and "TOTAL" in agent.stdout, agent.stdout + agent.stderr
    assert AGENT_TOKENS <= sim.billed_total() < AGENT_TOKENS + 100
    return sim


def _left(sim: ArkSimulator) -> int:
    return BALANCE - SMALL_BUFFER - sim.billed_total()


class TestAcceptance:
    def test_consume_spends_what_is_left_and_never_more(
        self, spent_day: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """The day's bill stays <= min(2M, 900,000 - 50,000) and consume spends >= 90% of what was left."""
        left = _left(spent_day)
        before = spent_day.billed_total()
        report = tmp_path / "consume.json"
        result = _cli(*_consume_args(spent_day, store, "--report-json", str(report)))
        assert result.returncode == 0, result.stderr
        spent = spent_day.billed_total() - before
        assert spent_day.billed_total() <= min(2_000_000, BALANCE - SMALL_BUFFER)
        assert spent >= 0.9 * left
        assert "spent" in result.stderr and "plan spent" in result.stderr
        data = json.loads(report.read_text())
        assert data["consume"]["models"][MODEL]["spent"] == spent
        assert data["totals"]["settled_tokens"] == spent  # the guard settled exactly what was billed
        ledger = open_ledger(store)
        key = model_day_key(MODEL, quota.beijing_day(time.time()))
        assert ledger.counters([key])[key].settled == spent_day.billed_total()  # counted in today's usage

    def test_a_second_run_the_same_day_spends_nothing_and_says_why(self, spent_day: ArkSimulator, store: str) -> None:
        """consume:last_run:{date} makes a second consume a no-op that names the lease and --force."""
        assert _cli(*_consume_args(spent_day, store)).returncode == 0
        billed = spent_day.billed_total()
        again = _cli(*_consume_args(spent_day, store))
        assert again.returncode == 0, again.stderr
        assert spent_day.billed_total() == billed
        day = quota.beijing_day(time.time())
        assert f"already ran for Beijing day {day}" in again.stderr
        assert lease_name(day) in again.stderr and "--force" in again.stderr

    def test_two_started_at_once_spend_the_plan_once(self, spent_day: ArkSimulator, store: str) -> None:
        """Two consume processes started together: one spends the plan, the other nothing."""
        left = _left(spent_day)
        before = spent_day.billed_total()
        errors = _two_at_once(*_consume_args(spent_day, store))
        assert sum("already ran" in err for err in errors) == 1
        spent = spent_day.billed_total() - before
        assert 0.9 * left <= spent <= left


class TestLeaseAndForce:
    def test_two_forced_runs_at_once_still_stay_inside_the_pool(self, spent_day: ArkSimulator, store: str) -> None:
        """--force skips the lease, not the gate: two forced runs together never pass pool - S."""
        left = _left(spent_day)
        _two_at_once(*_consume_args(spent_day, store, "--force"))
        assert spent_day.billed_total() <= BALANCE - SMALL_BUFFER
        assert spent_day.billed_total() >= BALANCE - SMALL_BUFFER - 0.1 * left

    def test_force_runs_although_the_day_was_leased(self, spent_day: ArkSimulator, store: str) -> None:
        """Another host's lease on today stops a plain run; --force spends anyway."""
        day = quota.beijing_day(time.time())
        assert open_ledger(store).try_lease(lease_name(day), "other-host:1", LEASE_TTL_S, time.time())
        before = spent_day.billed_total()
        plain = _cli(*_consume_args(spent_day, store))
        assert "already ran" in plain.stderr and spent_day.billed_total() == before
        forced = _cli(*_consume_args(spent_day, store, "--force"))
        assert forced.returncode == 0, forced.stderr
        assert spent_day.billed_total() - before >= 0.9 * (BALANCE - SMALL_BUFFER - before)

    def test_dry_run_prints_the_plan_and_spends_nothing(self, spent_day: ArkSimulator, store: str) -> None:
        """--dry-run shows both clamps and the budget; it neither calls Ark nor takes the day's lease."""
        before = spent_day.billed_total()
        result = _cli(*_consume_args(spent_day, store, "--dry-run"))
        assert result.returncode == 0, result.stderr
        assert f"{MODEL}: plan {BALANCE - SMALL_BUFFER - before:,} tokens" in result.stdout
        assert "daily cap" in result.stdout and "small buffer" in result.stdout
        assert spent_day.billed_total() == before
        day = quota.beijing_day(time.time())
        assert open_ledger(store).try_lease(lease_name(day), "someone-else", 1.0, time.time())


class TestStops:
    def test_an_error_streak_stops_the_run(self, sim: ArkSimulator, store: str) -> None:
        """A provider answering 500 each time: consume stops after --max-errors, exits 1, bills nothing."""
        assert _cli("sync", "--store", store, "--balance", f"{MODEL}={BALANCE}").returncode == 0
        sim.configure(fault="error_500")
        result = _cli(*_consume_args(sim, store, "--max-errors", "2", "--concurrency", "1"))
        assert result.returncode == 1
        assert "stopped after 2 errors in a row" in result.stderr and "HTTP 500" in result.stderr
        assert sim.billed_total() == 0

    def test_the_midnight_margin_stops_before_any_call(self, spent_day: ArkSimulator, store: str) -> None:
        """With the whole day inside --stop-before, consume says so and calls nothing."""
        before = spent_day.billed_total()
        result = _cli(*_consume_args(spent_day, store), "--stop-before", "1440")
        assert result.returncode == 0, result.stderr
        assert "stopped 1440 min before Beijing midnight" in result.stderr
        assert spent_day.billed_total() == before

    def test_at_a_time_already_passed_runs_at_once_and_bad_times_are_refused(
        self, spent_day: ArkSimulator, store: str
    ) -> None:
        """--at 00:00 has passed today: no wait. --at 25:00 is one clear line, exit 2."""
        bad = _cli(*_consume_args(spent_day, store, "--at", "25:00"))
        assert bad.returncode == 2 and "--at expects HH:MM" in bad.stderr and "Traceback" not in bad.stderr
        now = _cli(*_consume_args(spent_day, store, "--at", "00:00", "--dry-run"))
        assert now.returncode == 0 and "plan" in now.stdout and "waiting" not in now.stderr

    def test_without_model_it_takes_the_models_synced_today(self, spent_day: ArkSimulator, store: str) -> None:
        """No --model: every model with today's balance (a glob filters them); others are left alone."""
        base = ["consume", "--store", store, "--base-url", spent_day.url, "--dry-run"]
        assert f"{MODEL}: plan" in _cli(*base).stdout
        assert _cli(*base, "--model", "doubao-*").returncode == 2  # nothing matches: one clear line

    def test_no_balance_synced_today_plans_nothing(self, sim: ArkSimulator, store: str) -> None:
        """Without today's balance the plan is 0: spending blind up to the daily cap is refused."""
        result = _cli(*_consume_args(sim, store))
        assert result.returncode == 0, result.stderr
        assert "no balance synced today" in result.stderr
        assert sim.billed_total() == 0
        day = quota.beijing_day(time.time())
        assert open_ledger(store).try_lease(lease_name(day), "later-run", 1.0, time.time())  # not taken

    def test_an_unreachable_store_spends_nothing_and_says_so(self, sim: ArkSimulator) -> None:
        """No ledger, no consume: one line naming the store, exit 4, and no call to Ark."""
        result = _cli(*_consume_args(sim, "redis://127.0.0.1:1/0"))
        assert result.returncode == 4, result.stderr
        assert "127.0.0.1:1" in result.stderr and "Traceback" not in result.stderr
        assert sim.billed_total() == 0 and sim.calls() == 0

    def test_ctrl_c_charges_the_calls_in_flight_and_says_so(self, sim: ArkSimulator, store: str) -> None:
        """SIGINT mid-run: exit 130, one line, and every open hold charged (none left held)."""
        import signal

        assert _cli("sync", "--store", store, "--balance", f"{MODEL}={BALANCE}").returncode == 0
        sim.configure(latency_s=60.0)  # every call waits before its first byte; stop() ends the wait
        proc = start_cli(*_consume_args(sim, store, "--concurrency", "2"), env=ENV)
        while sum(sim.requests_by_path().values()) < 2:  # both workers' calls reached the provider
            assert proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        assert "consume interrupted: 2 call(s) in flight charged at their hold" in stderr
        assert "Traceback" not in stderr
        records = open_ledger(store).call_records()
        assert len(records) == 2 and {record.state for record in records} == {"unresolved"}

    def test_without_an_api_key_it_names_the_cure(self, sim: ArkSimulator, store: str) -> None:
        """No ARK_API_KEY: one line naming it, exit 2, no traceback."""
        result = _cli(*_consume_args(sim, store), env={"ARK_API_KEY": ""})
        assert result.returncode == 2
        assert "set ARK_API_KEY" in result.stderr and "Traceback" not in result.stderr


class TestSoftWalls:
    def test_consume_passes_the_usage_wall_but_not_the_pool(self, spent_day: ArkSimulator, store: str) -> None:
        """A usage wall below today's usage evicts the agent, yet consume spends up to the pool limit."""
        from quotawrap.admission.guard import Guard

        ledger = open_ledger(store)
        settings = Settings(store=store, usage_wall=100_000)
        day = quota.beijing_day(time.time())
        walls = [limit.name for limit in Guard(settings, ledger).limits_for(ledger.snapshot(MODEL), day)]
        assert "usage_wall" in walls  # the agent's guard stands behind it
        options = ConsumeOptions(api_key="sk-x", base_url=spent_day.url, max_tokens_per_call=PER_CALL, stop_before_s=0)
        left = _left(spent_day)
        result = run_consume(ledger, settings, options, [MODEL], run_id="consume-walls")
        (outcome,) = result.outcomes
        assert outcome.stop == "plan spent"
        assert 0.9 * left <= outcome.spent <= left
        assert spent_day.billed_total() <= BALANCE - SMALL_BUFFER

    def test_a_lower_balance_synced_meanwhile_is_respected(self, spent_day: ArkSimulator, store: str) -> None:
        """A fresher, smaller balance lowers the gate's limit; consume stays inside it."""
        ledger = open_ledger(store)
        now = time.time()
        usage = spent_day.billed_total()
        record_balance(ledger, MODEL, 200_000, now, quota.QuotaSettings(), source="manual", settled=True)
        options = ConsumeOptions(api_key="sk-x", base_url=spent_day.url, max_tokens_per_call=PER_CALL, stop_before_s=0)
        result = run_consume(ledger, Settings(store=store), options, [MODEL], run_id="consume-lower")
        assert result.outcomes[0].plan.budget == 200_000 - SMALL_BUFFER
        assert spent_day.billed_total() - usage <= 200_000 - SMALL_BUFFER


class TestRedis:
    @pytest.fixture
    def redis_url(self) -> Iterator[str]:
        """A Redis server shared by the session (tests/redis_server.py)."""
        from tests.redis_server import session_url

        with session_url() as url:
            yield url

    def test_consume_counts_in_the_limiters_keys_and_leases_across_hosts(
        self, sim: ArkSimulator, redis_url: str
    ) -> None:
        """On Redis: LiteLLM's own daily_usage counts against the plan, consume INCRs the shared keys,
        and of two runs started at once (two "hosts") one spends and one says why not."""
        import redis

        sim.configure(reply_tokens=AGENT_TOKENS, tokens_per_chunk=4096)
        client = redis.Redis.from_url(redis_url)
        day = quota.beijing_day(time.time())
        assert _cli("sync", "--store", redis_url, "--balance", f"{MODEL}={BALANCE}").returncode == 0
        client.set(f"daily_usage:{day}:{MODEL}:ba0383d3", AGENT_TOKENS, ex=48 * 3600)  # then the proxy's users
        left = BALANCE - SMALL_BUFFER - AGENT_TOKENS
        errors = _two_at_once(*_consume_args(sim, redis_url))
        assert sum("already ran" in err for err in errors) == 1
        assert 0.9 * left <= sim.billed_total() <= left
        assert int(client.get(f"daily_usage:{day}:{MODEL}:quotawrap") or 0) == sim.billed_total()


class TestLiveView:
    def test_a_terminal_shows_the_models_bar_filling_up(self, spent_day: ArkSimulator, store: str) -> None:
        """On a terminal, consume draws the guarded run's live bar; it ends full at the day's limit."""
        import io
        import re

        import pexpect
        import pyte

        transcript = io.StringIO()
        terminal = pexpect.spawn(
            sys.executable,
            ["-m", "quotawrap", *_consume_args(spent_day, store)],
            env={**os.environ, **ENV, "TERM": "xterm"},
            encoding="utf-8",
            dimensions=(24, 100),
            timeout=60,
        )
        terminal.logfile_read = transcript
        try:
            terminal.expect(pexpect.EOF)
        finally:
            terminal.close(force=True)
        assert terminal.exitstatus == 0, transcript.getvalue()
        screen = pyte.Screen(100, 24)
        pyte.Stream(screen).feed(transcript.getvalue())
        lines = [line.rstrip() for line in screen.display if line.strip()]
        assert any(re.fullmatch(rf"{MODEL} +850k / 850k [█░]+ (99|100)%", line) for line in lines), "\n".join(lines)
        assert any("plan spent" in line for line in lines)
