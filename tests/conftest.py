"""Shared fixtures: a real Ark simulator, a private ledger, and a way to run real `quotawrap`."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from quotawrap.ledger.sqlite.file import EVERY_CALL
from quotawrap.simulator import ArkSimulator, SimConfig, serve

CHILDREN = Path(__file__).parent / "integration" / "children"
BENCH = Path(__file__).resolve().parents[1] / "bench"

# Property tests judge answers, never speed: a loaded CI machine must not fail them by the clock.
hypothesis_settings.register_profile("quotawrap", deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile("quotawrap")


def _left_behind() -> tuple[object, int]:
    """The process's guard, and how many guards' retry memories would report at the runner's exit."""
    from quotawrap.admission import refusals
    from quotawrap.intercept import _active

    return _active._guard, refusals.unreported_retries()


@pytest.fixture(autouse=True, scope="module")
def _no_guard_left_by_the_module() -> Iterator[None]:
    """A test module cleans up what it installs in this process: the process's guard (``set_guard(None)``)
    and a guard's memory of retried refusals (``guard.retries.close()``), which would otherwise report from
    the test runner's own exit."""
    guard, unreported = _left_behind()
    yield
    now, left = _left_behind()
    assert now is guard, "a test or fixture of this module left a guard installed: set_guard(None) when done"
    assert left <= unreported, "a test or fixture of this module left a guard's retry memory open: close it"


@pytest.fixture(autouse=True)
def _no_guard_left_by_the_test() -> Iterator[None]:
    """The same for each test; a guard a module fixture installed is that fixture's to clean up."""
    guard, unreported = _left_behind()
    yield
    now, left = _left_behind()
    assert now is guard, "the test left a guard installed: set_guard(None) when it is done"
    assert guard is not None or left <= unreported, "the test left a guard's retry memory open: close it"


@pytest.fixture
def sim() -> Iterator[ArkSimulator]:
    """A real HTTP server speaking Ark's API on a free loopback port."""
    with serve(config=SimConfig()) as simulator:
        yield simulator


@pytest.fixture
def store(tmp_path: Path) -> str:
    """A private SQLite ledger for one test."""
    return f"sqlite:///{tmp_path / 'ledger.sqlite3'}"


@dataclass
class Wrapped:
    returncode: int
    stdout: str
    stderr: str


def run_quotawrap(
    args: Sequence[str],
    command: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    cwd: str | Path | None = None,
) -> Wrapped:
    """Run the real CLI in a subprocess, exactly as a user would."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("QUOTAWRAP_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "quotawrap", *args, "--", *command],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    return Wrapped(proc.returncode, proc.stdout, proc.stderr)


def _cli_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """This process's environment without quotawrap's own variables (the suite may itself run guarded), plus ``env``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("QUOTAWRAP_")}, **(env or {})}


def run_cli(*args: str, env: Mapping[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A quotawrap command (status, report, sync, consume, a wrapped run, ...) as a user types it.

    Never raises on the exit code: judging it is the test's business."""
    return subprocess.run(
        [sys.executable, "-m", "quotawrap", *args], env=_cli_env(env), capture_output=True, text=True, timeout=timeout
    )


def cli_json(*args: str, env: Mapping[str, str] | None = None) -> Any:
    """The JSON a quotawrap command printed (``status --json``, ``report --format json``, ...), once it succeeded."""
    result = run_cli(*args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def start_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``run_cli`` in the background, stdout and stderr piped: runs started together, or stopped midway."""
    return subprocess.Popen(
        [sys.executable, "-m", "quotawrap", *args],
        env=_cli_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def communicate_all(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    """Each run's (stdout, stderr), read all at once. Read one after another, a run's pipe left unread while
    the test waits for another fills (64 KiB): its processes block in write() with calls in flight, and the
    other run's calls wait for that room (--wait), so neither ends."""
    with ThreadPoolExecutor(len(procs)) as pool:
        return list(pool.map(lambda proc: proc.communicate(timeout=timeout), procs))


def load_bench(script: str, module_name: str) -> ModuleType:
    """A bench/ script imported as ``module_name`` (tests run its own core rather than a copy of it)."""
    spec = importlib.util.spec_from_file_location(module_name, BENCH / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def child(name: str, *args: str) -> list[str]:
    return [sys.executable, str(CHILDREN / name), *args]


def run_python(script: str, *, cwd: str | Path, env: dict[str, str]) -> tuple[Any, str]:
    """Run ``script`` in a fresh interpreter; it prints one JSON value as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def beijing_noon() -> float:
    """Noon of today's Beijing day: a test whose clock runs on for minutes or hours from it stays in one quota
    day, whenever the suite runs (from time.time() it crossed Beijing midnight when run after ~23:00)."""
    from datetime import datetime

    from quotawrap.core.quota import BEIJING

    return datetime.now(BEIJING).replace(hour=12, minute=0, second=0, microsecond=0).timestamp()


def ledger_rows(store_url: str, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    path = store_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        return conn.execute(sql, params).fetchall()


def sigkill_mid_stream(sim: ArkSimulator, store: str) -> tuple[str, tuple[object, ...]]:
    """A guarded child SIGKILLed while its stream is read: once the wrapper has ended as its child did
    and no hold stays open, the wrapper's stderr and the call's (state, charged, reserved)."""
    import signal

    proc = start_cli(
        "--store", store, "--base-url", sim.url, "--", *child("slow_stream.py"),
        env={"SIM_URL": sim.url, "CHUNK_DELAY": "0.2"},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("STREAMING"), proc.stderr.read() if proc.stderr else line
    os.kill(int(line.split()[1]), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    assert ledger_rows(store, f"SELECT COUNT(*) FROM {EVERY_CALL} WHERE state = 'held'") == [(0,)]
    (call,) = ledger_rows(store, "SELECT state, charged, reserved FROM calls")
    return stderr, call


def hold_request(model: str, *, endpoint: str = "chat", reserve: int = 1_000, enforce: bool = True) -> Any:
    """A HoldRequest of today for ``model``, as a guarded call of this process would make it."""
    import time

    from quotawrap.core.quota import beijing_day
    from quotawrap.ledger import HoldRequest

    return HoldRequest(
        run_id="r",
        model=model,
        day=beijing_day(time.time()),
        reserve=reserve,
        endpoint=endpoint,
        pid=os.getpid(),
        host="h",
        expires_at=time.time() + 600,
        enforce=enforce,
    )
