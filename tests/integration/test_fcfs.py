"""Issue 9, first come first served across processes, runs and hosts: the ledger's waiting line, end to end.

Real `quotawrap` wrappers (separate runs; on Redis, separate "hosts" sharing one store) run
tests/integration/children/line_caller.py against the bundled Ark simulator under one daily cap:

* a HOLDER's call takes most of the cap for a few seconds;
* a LARGE call then has to wait for that hold;
* SMALL calls, sent only once the large call waits, would fit in the gap the holder leaves.

The ledger's admission order (its call records) must put the large call before every small one.
Before the line (a backoff race between processes) the small calls took the gap at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quotawrap.ledger import open_ledger
from quotawrap.simulator import ArkSimulator
from tests.conftest import child
from tests.redis_server import flushed, session_url

CAP = 10_000
HOLDER, LARGE, SMALL = 8_000, 5_000, 200  # max_completion_tokens: what each call reserves (+ a few input tokens)


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        return
    with session_url() as url:
        yield flushed(url)


class Wrapper:
    """One `quotawrap run` (its own run id: another process, run or host) around line_caller.py."""

    def __init__(self, sim: ArkSimulator, store: str, events: Path, *caller: str, wait: str = "120") -> None:
        self.events = events
        command = [sys.executable, "-m", "quotawrap", "run", "--store", store, "--base-url", sim.url]
        command += ["--daily-cap", str(CAP), "--wait", wait, "--events-log", str(events), "--quiet"]
        env = {**os.environ, "SIM_URL": sim.url}
        env.pop("QUOTAWRAP_RUN_ID", None)
        self.proc = subprocess.Popen(
            [*command, "--", *child("line_caller.py", *caller)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.child_pid = json.loads(self.proc.stdout.readline())["pid"]  # type: ignore[union-attr]

    def records(self, timeout: float = 240) -> list[dict]:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode in (0, -signal.SIGKILL, 128 + signal.SIGKILL, 137), err
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def waiting(self) -> bool:
        """Whether one of its calls waits for room (its events log says so)."""
        try:
            return '"ev":"wait"' in self.events.read_text()
        except OSError:
            return False


def _until(condition: object, what: str, timeout: float = 60) -> None:
    give_up = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.05)


def _held(store: str) -> bool:
    ledger = open_ledger(store)
    try:
        return any(record.state == "held" for record in ledger.call_records())
    finally:
        ledger.close()


def test_a_large_call_is_not_overtaken_by_small_ones(sim: ArkSimulator, shared_store: str, tmp_path: Path) -> None:
    """A large call waiting for a hold in flight is admitted before every small call sent after it began
    waiting, though each of those would have fit in the gap: across runs, processes and (Redis) hosts."""
    holder = Wrapper(sim, shared_store, tmp_path / "holder.jsonl", "--max-tokens", str(HOLDER), "--latency", "3")
    _until(lambda: _held(shared_store), "the holder's hold")
    large = Wrapper(sim, shared_store, tmp_path / "large.jsonl", "--max-tokens", str(LARGE))
    _until(large.waiting, "the large call to wait")
    # `status` sees the waiter in the ledger's line (its events log is not where status looks for them)
    status = subprocess.run(
        [sys.executable, "-m", "quotawrap", "status", "--json", "--store", shared_store],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
    )
    assert status.returncode == 0, status.stderr
    assert [row["waiting"] for row in json.loads(status.stdout)] == [1]
    small = [
        Wrapper(
            sim,
            shared_store,
            tmp_path / f"small{n}.jsonl",
            "--max-tokens",
            str(SMALL),
            "--threads",
            "3",
            "--calls",
            "4",
            "--latency",
            "0.1",
        )
        for n in range(2)
    ]
    records = [r for wrapper in (holder, large, *small) for r in wrapper.records()]
    assert [r["outcome"] for r in records] == ["ok"] * len(records)  # nothing refused: everyone waited its turn
    ledger = open_ledger(shared_store)
    try:
        admitted = sorted((c for c in ledger.call_records() if c.state != "blocked"), key=lambda c: c.started_at)
    finally:
        ledger.close()
    sizes = ["holder" if c.reserved > LARGE * 1.5 else "large" if c.reserved > SMALL * 2 else "small" for c in admitted]
    assert sizes.count("small") == 2 * 3 * 4
    assert sizes.index("large") < sizes.index("small"), sizes  # every small call came after the large one
    assert sim.billed_total() <= CAP


def test_a_killed_waiter_blocks_the_others_only_until_its_lease_ends(
    sim: ArkSimulator, shared_store: str, tmp_path: Path
) -> None:
    """A waiter SIGKILLed in line is skipped once its lease runs out: a small call behind it is admitted
    while the holder still holds, instead of waiting behind a dead process until its own --wait ends."""
    holder = Wrapper(sim, shared_store, tmp_path / "holder.jsonl", "--max-tokens", str(HOLDER), "--latency", "40")
    _until(lambda: _held(shared_store), "the holder's hold")
    large = Wrapper(sim, shared_store, tmp_path / "large.jsonl", "--max-tokens", str(LARGE))
    _until(large.waiting, "the large call to wait")
    small = Wrapper(sim, shared_store, tmp_path / "small.jsonl", "--max-tokens", str(SMALL), wait="30")
    time.sleep(0.5)  # the small call queues behind the large one
    os.kill(large.child_pid, signal.SIGKILL)
    records = small.records()
    assert [r["outcome"] for r in records] == ["ok"]
    assert holder.proc.poll() is None  # still holding: the small call got the gap, not room the holder freed
    # Its child too: a SIGKILLed wrapper's child lives on, holding the pipe open through its 40 s call.
    os.kill(holder.child_pid, signal.SIGKILL)
    holder.proc.kill()
    holder.proc.communicate()
    large.records()
