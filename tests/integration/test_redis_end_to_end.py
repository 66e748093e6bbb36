"""The real CLI on the Redis ledger: processes, two "hosts", a restart, and the LiteLLM limiter's keys."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from quotawrap.core import quota
from quotawrap.core.quota import Counters
from quotawrap.ledger.base import model_day_key
from quotawrap.ledger.redis import RedisLedger
from quotawrap.simulator import ArkSimulator
from tests.conftest import Wrapped, child, communicate_all, run_quotawrap, start_cli
from tests.redis_server import RedisServer, private_server, session_url

MODEL = "deepseek-v4-flash"


@pytest.fixture
def redis_url() -> Iterator[str]:
    with session_url() as url:
        yield url


@pytest.fixture
def aof_server() -> Iterator[RedisServer]:
    with private_server(appendonly=True) as server:
        yield server


def _wrapper(args: list[str], command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return start_cli(*args, "--", *command, env=env)


def _capped(redis_url: str, sim: ArkSimulator, cap: int, report: Path) -> list[str]:
    """A wrapper's options for a run on the Redis ledger whose model-day may settle at most ``cap`` tokens."""
    limits = ["--daily-cap", str(cap), "--usage-wall", str(cap)]
    return ["--store", redis_url, "--base-url", sim.url, *limits, "--report-json", str(report)]


class TestRedisFleet:
    def test_two_hosts_of_eight_processes_share_one_cap(
        self, sim: ArkSimulator, redis_url: str, tmp_path: Path
    ) -> None:
        """Two wrapper runs (two hosts), each 8 processes x 4 threads, one daily cap in Redis: no overspend, exact."""
        sim.configure(reply_tokens=400)
        cap = 30_000
        reports = [tmp_path / "a.json", tmp_path / "b.json"]
        procs = [
            _wrapper(
                _capped(redis_url, sim, cap, report),
                child("swarm.py", "--processes", "8", "--threads", "4"),
                {"SIM_URL": sim.url},
            )
            for report in reports
        ]
        for proc, (_, stderr) in zip(procs, communicate_all(procs, timeout=240), strict=True):
            assert proc.returncode == 0, stderr
        settled = sum(json.loads(report.read_text())["totals"]["settled_tokens"] for report in reports)
        billed = sim.billed_total()
        assert billed <= cap
        assert billed >= 0.8 * cap
        assert settled == billed
        # and the day's counter in Redis says the same
        client = redis.Redis.from_url(redis_url)
        day = quota.beijing_day(time.time())
        assert int(client.get(f"daily_usage:{day}:{MODEL}:quotawrap") or 0) == billed

    def test_two_wrappers_drawing_from_advances_share_one_cap_exactly(
        self, sim: ArkSimulator, redis_url: str, tmp_path: Path
    ) -> None:
        """Two wrappers, each 4 processes x 8 threads, on a cap 64 times their advances and more: most calls are
        drawn from advances (lua/advance.lua splits each from its advance as its settle lands), the cap holds,
        every call is settled exactly once and nothing is left in flight."""
        sim.configure(reply_tokens=100)
        cap = 200_000
        reports = [tmp_path / "a.json", tmp_path / "b.json"]
        swarm = child("swarm.py", "--processes", "4", "--threads", "8", "--max-calls", "400", "--max-tokens", "120")
        procs = [
            _wrapper(_capped(redis_url, sim, cap, report), swarm, {"SIM_URL": sim.url, "SWARM_DRAWN": "1"})
            for report in reports
        ]
        drawn = calls = 0
        for proc, (stdout, stderr) in zip(procs, communicate_all(procs, timeout=300), strict=True):
            assert proc.returncode == 0, stderr
            records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            drawn += sum(r["drawn"] for r in records if "drawn" in r)
            calls += sum(1 for r in records if r.get("outcome") == "ok")
        assert drawn > calls // 2  # most calls never asked Redis alone
        billed = sim.billed_total()
        assert 0.9 * cap <= billed <= cap
        totals = [json.loads(report.read_text())["totals"] for report in reports]
        assert sum(t["settled_tokens"] for t in totals) == billed
        assert sum(t["calls"] for t in totals) == calls
        ledger = RedisLedger(redis_url)
        try:
            key = model_day_key(MODEL, quota.beijing_day(time.time()))
            assert ledger.counters([key])[key] == Counters(billed, 0)
        finally:
            ledger.close()


class TestRedisFaults:
    def test_restart_mid_run_fails_closed_then_recovers_without_double_count(
        self, sim: ArkSimulator, aof_server: RedisServer, tmp_path: Path
    ) -> None:
        """Redis restarts mid-run: calls while it is down are refused (503, never sent); none counted twice."""
        script = tmp_path / "loop.py"
        script.write_text(
            "import os, sys, time, openai\n"
            "sdk = openai.OpenAI(base_url=os.environ['SIM_URL'], api_key='sk-test', max_retries=0)\n"
            "for i in range(40):\n"
            "    try:\n"
            "        sdk.chat.completions.create(model='deepseek-v4-flash', max_tokens=50,\n"
            "                                    messages=[{'role': 'user', 'content': 'hi'}])\n"
            "        print('ok', flush=True)\n"
            "    except openai.APIStatusError as exc:\n"
            "        print(f'refused {exc.status_code}', flush=True)\n"
            "    time.sleep(0.1)\n"
        )
        report = tmp_path / "r.json"
        proc = _wrapper(
            ["--store", aof_server.url, "--base-url", sim.url, "--report-json", str(report)],
            [sys.executable, str(script)],
            {"SIM_URL": sim.url},
        )
        assert proc.stdout is not None and proc.stderr is not None
        lines: list[str] = []

        def read_until(wanted: str, count: int) -> None:
            """The program's own lines pace the outage: on a loaded machine its first call may come late."""
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if lines.count(wanted) >= count:
                    return
            raise AssertionError(f"the program ended before {count} {wanted!r}: {lines}")

        read_until("ok", 3)
        aof_server.stop()
        read_until("refused 503", 1)  # fail closed while the store is down
        aof_server.start()
        lines += [line.rstrip("\n") for line in proc.stdout]
        stderr = proc.stderr.read()
        assert proc.wait(timeout=120) == 0, stderr
        oks = lines.count("ok")
        assert oks >= 10 and lines[-1] == "ok", lines  # and it recovered by itself
        assert sim.calls() == oks  # a refused call never reached the provider
        data = json.loads(report.read_text())
        assert data["totals"]["settled_tokens"] == sim.billed_total()

    def test_litellm_limiter_usage_counts_against_the_same_day(
        self, sim: ArkSimulator, redis_url: str, tmp_path: Path
    ) -> None:
        """A process INCRing `daily_usage:` keys like the LiteLLM limiter shares the day's cap with the wrapper."""
        sim.configure(reply_tokens=400)
        cap = 20_000
        client = redis.Redis.from_url(redis_url)
        day = quota.beijing_day(time.time())
        foreign_key = f"daily_usage:{day}:{MODEL}:ba0383d3"
        stop = threading.Event()

        def proxy() -> None:  # the existing limiter's success callback: INCR per request, TTL 48h
            while not stop.is_set():
                client.incrby(foreign_key, 500)
                client.expire(foreign_key, 48 * 3600)
                if int(client.get(foreign_key) or 0) >= 8_000:
                    return
                time.sleep(0.05)

        thread = threading.Thread(target=proxy)
        thread.start()
        report = tmp_path / "r.json"
        proc = _wrapper(
            _capped(redis_url, sim, cap, report),
            child("swarm.py", "--threads", "8"),
            {"SIM_URL": sim.url},
        )
        _, stderr = proc.communicate(timeout=120)
        stop.set()
        thread.join()
        assert proc.returncode == 0, stderr
        foreign = int(client.get(foreign_key))
        assert foreign >= 8_000
        assert sim.billed_total() + foreign <= cap
        assert json.loads(report.read_text())["totals"]["settled_tokens"] == sim.billed_total()
        assert int(client.get(f"daily_usage:{day}:{MODEL}:quotawrap")) == sim.billed_total()
        assert 0 < client.ttl(f"daily_usage:{day}:{MODEL}:quotawrap") <= 48 * 3600


# One call, then wait until the test has emptied Redis, then exit.
CALL_THEN_WAIT = """
import os, sys, time
import openai
sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
sdk.chat.completions.create(model="deepseek-v4-flash", messages=[{"role": "user", "content": "hi"}], max_tokens=20)
print("called", flush=True)
while not os.path.exists(os.environ["GO_ON"]):
    time.sleep(0.05)
"""


class TestDataLostMidRun:
    def test_totals_say_they_are_incomplete_not_zero(self, sim: ArkSimulator, tmp_path: Path) -> None:
        """Redis loses its data (restart without persistence) mid-run: the summary must not say 0 calls as a fact."""
        go_on = tmp_path / "go-on"
        with private_server(appendonly=False) as server:
            wrapper = _wrapper(
                ["--store", server.url, "--base-url", sim.url],
                [sys.executable, "-c", CALL_THEN_WAIT],
                {"SIM_URL": sim.url, "GO_ON": str(go_on)},
            )
            assert wrapper.stdout is not None
            assert wrapper.stdout.readline().strip() == "called"
            time.sleep(0.5)  # the background settle lands
            redis.Redis.from_url(server.url).flushall()
            go_on.touch()
            _, stderr = wrapper.communicate(timeout=120)
        assert sim.billed_total() > 0
        assert "totals above are incomplete" in stderr, stderr
        assert "Redis lost quotawrap's counters" in stderr


class TestPersistenceWarning:
    """A Redis keeping nothing on disk forgets the day's spend if it restarts between runs: the run says so once."""

    def _run(self, store: str, sim: ArkSimulator) -> Wrapped:
        return run_quotawrap(["--store", store, "--base-url", sim.url], child("one_call.py"), env={"SIM_URL": sim.url})

    def test_without_persistence_the_run_says_what_a_restart_loses_once(self, sim: ArkSimulator) -> None:
        with private_server(appendonly=False) as server:
            result = self._run(server.url, sim)
        assert result.returncode == 0, result.stderr
        assert result.stderr.count("keeps nothing on disk") == 1, result.stderr
        assert "today's spend is forgotten" in result.stderr and "appendonly yes" in result.stderr

    def test_with_aof_nothing_is_said(self, sim: ArkSimulator, aof_server: RedisServer) -> None:
        result = self._run(aof_server.url, sim)
        assert result.returncode == 0, result.stderr
        assert "keeps nothing on disk" not in result.stderr

    def test_where_config_is_refused_nothing_is_said_and_the_run_goes_on(self, sim: ArkSimulator) -> None:
        """Managed Redis forbids CONFIG (here an ACL user without it): the run cannot judge, says nothing, runs."""
        with private_server(appendonly=False) as server:
            admin = redis.Redis.from_url(server.url)
            admin.acl_setuser(
                "agent",
                enabled=True,
                passwords=["+agent-pw"],
                keys=["*"],
                channels=["*"],
                commands=["+@all", "-config"],
            )
            admin.close()
            store = server.url.replace("redis://", "redis://agent:agent-pw@")
            result = self._run(store, sim)
        assert result.returncode == 0, result.stderr
        assert "keeps nothing on disk" not in result.stderr
        assert sim.calls() == 1
