"""One clock per ledger: two wrappers share one Redis and one daily cap, one on a host whose clock runs 30 h ahead.

The skewed run is the whole ``quotawrap`` command under ``faketime`` (libfaketime, the OS package): the wrapper
and its hooked child both read the wrong time, as on a host with a bad clock. The simulator and redis-server run
unskewed, as the provider and the shared store do.

libfaketime 0.9.10 (Debian bookworm's) fakes CLOCK_MONOTONIC as the wall clock unless told not to, and Python 3.11
waits on locks with ``sem_clockwait(CLOCK_MONOTONIC)``, which it does not intercept: every timed wait then hangs
(wolfcw/libfaketime#390). With ``FAKETIME_DONT_FAKE_MONOTONIC`` those waits work, but ``time.sleep`` fails with
EINVAL: 0.9.10 still shifts the absolute deadline of ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` by the
fake offset (wolfcw/libfaketime#426, fixed after 0.9.10). So the skewed processes keep the real monotonic clock, and
a ``sitecustomize`` (chained by quotawrap's own in the child) makes ``time.sleep`` a relative ``select`` wait.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from quotawrap.core import quota
from quotawrap.core.quota import Limit
from quotawrap.ledger import HoldRequest
from quotawrap.ledger.redis import RedisLedger
from quotawrap.simulator import ArkSimulator
from tests.conftest import _cli_env, communicate_all, hold_request
from tests.redis_server import RedisServer, private_server

MODEL = "deepseek-v4-flash"
SKEW_H = 30
# time.time() in the child first, then calls from two threads until one is refused for the cap
CALLER = """
import json, os, sys, threading, time
import openai

def emit(**record: object) -> None:
    os.write(1, (json.dumps(record) + "\\n").encode())  # one write(2) a line: threads never interleave

emit(time=time.time())
sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)

def work() -> None:
    for i in range(200):
        try:
            sdk.chat.completions.create(
                model="deepseek-v4-flash", max_tokens=100, messages=[{"role": "user", "content": f"call {i}"}],
                extra_body={"thinking": {"type": "disabled"}},
            )
        except openai.RateLimitError:
            emit(outcome="blocked")
            return
        emit(outcome="ok")

threads = [threading.Thread(target=work) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


# time.sleep as a relative wait, which libfaketime leaves alone (see the module's docstring)
SLEEP_SHIM = """
import select, time

def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    select.select([], [], [], seconds)

time.sleep = _sleep
"""


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with private_server(appendonly=False) as running:
        yield running


def _faketime() -> str:
    binary = shutil.which("faketime")
    if binary is None:
        pytest.fail("faketime is not installed (Debian: apt-get install faketime; `make test` installs it)")
    return binary


def _skewed(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of a process tree whose wall clock runs SKEW_H hours ahead."""
    shim = tmp_path / "faketime_shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
    path = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
    return [_faketime(), "-f", f"+{SKEW_H}h"], {"FAKETIME_DONT_FAKE_MONOTONIC": "1", "PYTHONPATH": path}


def _run(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, env=_cli_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_faketime_skews_python(tmp_path: Path) -> None:
    """The premise of the test below: libfaketime moves time.time() in a Python process it starts, and that
    process still sleeps and waits as long as it asks."""
    prefix, env = _skewed(tmp_path)
    code = (
        "import threading, time\n"
        "start = time.monotonic(); time.sleep(0.05); threading.Event().wait(0.05)\n"
        "print(time.time(), time.monotonic() - start)"
    )
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code], env=_cli_env(env), capture_output=True, text=True, check=True
    ).stdout
    skewed_at, waited = (float(word) for word in out.split())
    assert skewed_at - time.time() > (SKEW_H - 1) * 3600
    assert waited >= 0.1


# A process of the skewed host: this host's time, the ledger's, and the waiters it counts in the ledger's lines
READ_CLOCKS = """
import json, sys, time
from quotawrap.ledger.redis import RedisLedger

ledger = RedisLedger(sys.argv[1])
print(json.dumps({"local": time.time(), "ledger": ledger.now(), "waiting": ledger.waiting(time.time())}))
"""


def test_a_skewed_process_reads_the_servers_clock_and_says_so_once(server: RedisServer, tmp_path: Path) -> None:
    """RedisLedger.now() is the server's time in a process 30 h ahead, a waiter's place in line is live to it (its
    lease is on the server's clock), and it warns once, naming the cure."""
    placed = RedisLedger(server.url)
    daily = [Limit("daily_cap", "model_day", 1000)]
    stop = threading.Event()

    def keep_place(waiter: HoldRequest) -> None:
        """Ask again as a waiting call does, so its lease stays live however long the process takes to start."""
        while not stop.wait(0.5):
            placed.reserve(waiter, lambda _s: daily)

    placed.reserve(hold_request(MODEL, reserve=900), lambda _s: daily)
    waiter = dataclasses.replace(hold_request(MODEL, reserve=900), waiter="w-1", can_wait=True)
    first = placed.reserve(waiter, lambda _s: daily)
    assert not first.held and first.ticket
    keeper = threading.Thread(target=keep_place, args=(dataclasses.replace(waiter, ticket=first.ticket),))
    keeper.start()
    prefix, env = _skewed(tmp_path)
    script = tmp_path / "read_clocks.py"
    script.write_text(READ_CLOCKS)
    try:
        done = subprocess.run(
            [*prefix, sys.executable, str(script), server.url], env=_cli_env(env), capture_output=True, text=True
        )
    finally:
        stop.set()
        keeper.join()
        placed.close()
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["local"] - time.time() > (SKEW_H - 1) * 3600
    assert abs(seen["ledger"] - time.time()) < 60
    assert seen["waiting"] == {MODEL: 1}
    (warning,) = done.stderr.splitlines()
    assert f"this host's clock is {SKEW_H}.0 h ahead of the Redis ledger's" in warning and "NTP" in warning


def test_a_skewed_host_shares_the_days_cap(sim: ArkSimulator, server: RedisServer, tmp_path: Path) -> None:
    """The host 30 h ahead spends from the same Beijing day as the other (the server's TIME decides it): the bill
    stays within one cap, both runs get calls through, no counters of another day exist, every hold in flight
    expires an hour (--hold-ttl) after the server's now, and the skewed run warns once, naming the cure."""
    sim.configure(reply_tokens=80, latency_s=0.05)  # calls stay in flight long enough to be seen
    cap = 4_000
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    reports = [tmp_path / "plain.json", tmp_path / "skewed.json"]
    wrapper = [sys.executable, "-m", "quotawrap"]
    common = ["--store", server.url, "--base-url", sim.url, "--daily-cap", str(cap), "--usage-wall", str(cap)]
    prefix, skew_env = _skewed(tmp_path)
    procs = [
        _run(
            [*wrapper, *common, "--report-json", str(reports[0]), "--", sys.executable, str(script)],
            {"SIM_URL": sim.url},
        ),
        _run(
            [*prefix, *wrapper, *common, "--report-json", str(reports[1]), "--", sys.executable, str(script)],
            {"SIM_URL": sim.url, **skew_env},
        ),
    ]
    started = time.time()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    stop, expiries = threading.Event(), []

    def watch_expiries() -> None:
        """How far past the server's clock each hold in flight expires, as a reclaim would compare them."""
        open_key = f"{{qw:md:{quota.beijing_day(started)}:{MODEL}}}:open"
        while not stop.wait(0.01):
            seconds, micros = client.time()
            expiries.extend(e - (seconds + micros / 1e6) for _, e in client.zrange(open_key, 0, -1, withscores=True))

    watcher = threading.Thread(target=watch_expiries)
    watcher.start()
    try:
        (plain_out, plain_err), (skewed_out, skewed_err) = communicate_all(procs, timeout=240)
    finally:
        stop.set()
        watcher.join()
    assert [p.returncode for p in procs] == [0, 0], (plain_err, skewed_err)
    # --hold-ttl 3600 on the server's clock, read through an offset good to a round trip (a host's would be 30 h on)
    assert expiries and all(3000 < left < 3660 for left in expiries), (min(expiries), max(expiries))

    plain_lines = [json.loads(line) for line in plain_out.splitlines() if line.startswith("{")]
    skewed_lines = [json.loads(line) for line in skewed_out.splitlines() if line.startswith("{")]
    assert abs(plain_lines[0]["time"] - started) < 3600
    assert skewed_lines[0]["time"] - started > (SKEW_H - 1) * 3600  # the hooked child itself ran 30 h ahead

    billed = sim.billed_total()
    assert billed <= cap
    assert billed >= 0.8 * cap
    settled = [json.loads(report.read_text())["totals"]["settled_tokens"] for report in reports]
    assert sum(settled) == billed
    assert all(sum(1 for line in lines if line.get("outcome") == "ok") > 0 for lines in (plain_lines, skewed_lines))

    today = quota.beijing_day(time.time())
    days = {key.split(":")[2] for key in client.scan_iter("{qw:md:*")}
    assert days == {today}
    assert int(client.get(f"daily_usage:{today}:{MODEL}:quotawrap") or 0) == billed

    warnings = [line for line in skewed_err.splitlines() if "clock" in line and "ahead" in line]
    assert len(warnings) == 1, skewed_err
    assert "NTP" in warnings[0] and "30" in warnings[0]
    assert "clock" not in plain_err, plain_err
