"""A process of the run that is not Python cannot carry the hook: when it connects to a guarded
host it is named loudly (and --strict stops it), pointing at --proxy (issue 13's silent bypass)."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from quotawrap.simulator import ArkSimulator, SimConfig, serve
from tests.conftest import run_quotawrap


@pytest.fixture
def slow_sim() -> Iterator[ArkSimulator]:
    """Answers after 1.5 s, as a real model does: the caller holds its connection meanwhile."""
    with serve(config=SimConfig(latency_s=1.5)) as simulator:
        yield simulator


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def _bash_holding_a_connection(port: int, seconds: float) -> list[str]:
    """bash opens a TCP connection by itself (/dev/tcp), holds it, then says it finished."""
    script = f"exec 3<>/dev/tcp/127.0.0.1/{port}; sleep {seconds} 3>&-; exec 3>&-; echo FINISHED"  # sleep: no fd 3
    return ["bash", "-c", script]


def _run(sim: ArkSimulator, store: str, tmp_path: Path, args: list[str], command: list[str]) -> tuple:
    report = tmp_path / "report.json"
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url, "--report-json", str(report), *args], command, timeout=60
    )
    return result, json.loads(report.read_text())


def test_a_shell_connected_to_the_base_url_is_named(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    result, report = _run(sim, store, tmp_path, [], _bash_holding_a_connection(_port(sim.url), 1.0))
    assert result.returncode == 0, result.stderr
    assert "FINISHED" in result.stdout
    (process,) = report["totals"]["unguarded_processes"]
    assert "bash -c exec 3<>/dev/tcp" in process["command"]
    assert f"connected to 127.0.0.1:{_port(sim.url)}" in process["reason"]
    assert "--proxy" in process["reason"] and process["stopped"] is False
    assert "UNGUARDED PROCESS" in result.stderr
    assert "not a Python program" in result.stderr


def test_strict_stops_it(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    script = f"exec 3<>/dev/tcp/127.0.0.1/{_port(sim.url)}; exec sleep 30"  # sleep inherits the connection
    result, report = _run(sim, store, tmp_path, ["--strict"], ["bash", "-c", script])
    assert result.returncode != 0
    (process,) = report["totals"]["unguarded_processes"]
    assert process["stopped"] is True


def test_a_connection_elsewhere_is_not_named(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        result, report = _run(
            sim, store, tmp_path, ["--strict"], _bash_holding_a_connection(listener.getsockname()[1], 0.5)
        )
    assert "FINISHED" in result.stdout, result.stderr
    assert report["totals"]["unguarded_processes"] == []


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on PATH")
def test_curl_calling_the_model_is_named(slow_sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """The everyday case: a shell script's curl to chat/completions under `quotawrap -- CMD` without --proxy."""
    body = json.dumps({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hi"}]})
    curl = ["curl", "-s", "-o", "/dev/null", "-H", "Authorization: Bearer test", "-H", "Content-Type: application/json"]
    command = [*curl, "-d", body, f"{slow_sim.url}/chat/completions"]
    result, report = _run(slow_sim, store, tmp_path, [], command)
    (process,) = report["totals"]["unguarded_processes"]
    assert "curl -s" in process["command"]
    assert "Bearer test" not in process["command"]  # its Authorization header is masked
    assert result.returncode == 0
