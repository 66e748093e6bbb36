"""litellm under the real `quotawrap` CLI against the real simulator (child: children/litellm_calls.py).

Which HTTP client carries each litellm path (litellm 1.110, openai SDK 3.x; each child reports
the client objects that sent its requests and the tests check them):

* ``litellm.completion`` (``openai/...`` and litellm's Ark route ``volcengine/...``, which honours
  ``api_base``), streamed or not: litellm builds its own legacy ``httpx.Client`` (default
  ``HTTPTransport``) and hands it to the openai SDK as ``http_client``, so the SDK's own httpx2
  client is not used. quotawrap's httpx patch sees it.
* ``litellm.acompletion``, streamed or not: an ``httpx.AsyncClient`` whose transport is litellm's
  ``LiteLLMAiohttpTransport`` (aiohttp under httpx's API), again handed to the openai SDK.
  quotawrap wraps ``AsyncClient._send_single_request``, above any transport, so it sees these too.
* ``aiohttp_openai/...`` (an opt-in litellm provider): ``aiohttp.ClientSession`` directly, no
  httpx at all. quotawrap wraps ``ClientSession._request``, so these are guarded too (TestAiohttpProvider).

TestGuardedPaths: sync, sync stream, async and async stream on both routes; TestConcurrentCap:
concurrent acompletions (async path) under --cap-tokens; TestStreamParity: sync and async streams
that did not ask for usage; TestAiohttpProvider: the aiohttp_openai path.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from quotawrap.simulator import ArkSimulator, SimConfig, serve
from tests.conftest import child, ledger_rows, run_quotawrap

HTTPX_SYNC = "httpx.Client/HTTPTransport"
HTTPX_ASYNC_OVER_AIOHTTP = "httpx.AsyncClient/LiteLLMAiohttpTransport"
AIOHTTP = "aiohttp.ClientSession"
USAGE_SQL = "SELECT prompt_tokens, completion_tokens FROM calls ORDER BY prompt_tokens, completion_tokens"


@dataclass
class ChildRun:
    calls: list[dict[str, Any]]
    carriers: list[str]
    stderr: str


def _parse(stdout: str, stderr: str) -> ChildRun:
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    (egress,) = [r["egress"] for r in records if "egress" in r]
    # litellm must not reach past loopback (model cost map, catalogs, telemetry): the child refuses it.
    assert egress == [], egress
    (carriers,) = [r["carriers"] for r in records if "carriers" in r]
    return ChildRun([r for r in records if "outcome" in r], carriers, stderr)


def _guarded(sim: ArkSimulator, store: str, args: list[str], mode: str, *child_args: str) -> ChildRun:
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url, *args],
        child("litellm_calls.py", "--mode", mode, *child_args),
        env={"SIM_URL": sim.url},
    )
    assert result.returncode == 0, result.stderr
    return _parse(result.stdout, result.stderr)


def _unguarded(sim: ArkSimulator, mode: str) -> ChildRun:
    proc = subprocess.run(
        child("litellm_calls.py", "--mode", mode),
        env={**os.environ, "SIM_URL": sim.url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return _parse(proc.stdout, proc.stderr)


def _bill_usage(sim: ArkSimulator) -> list[tuple[int, int]]:
    return sorted((bill.prompt_tokens, bill.completion_tokens) for bill in sim.bills())


@dataclass
class MixOutcome:
    run: ChildRun
    report: dict[str, Any]
    billed: int
    bill_usage: list[tuple[int, int]]
    ledger_states: list[tuple[object, ...]]
    ledger_usage: list[tuple[object, ...]]


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MixOutcome]:
    """One guarded run of every guarded litellm path (litellm's import is slow: shared by the class)."""
    tmp = tmp_path_factory.mktemp("litellm_mix")
    store = f"sqlite:///{tmp / 'ledger.sqlite3'}"
    report = tmp / "report.json"
    with serve(config=SimConfig(reply_tokens=50)) as sim:
        run = _guarded(sim, store, ["--report-json", str(report)], "mix", "--calls", "4")
        yield MixOutcome(
            run=run,
            report=json.loads(report.read_text()),
            billed=sim.billed_total(),
            bill_usage=_bill_usage(sim),
            ledger_states=ledger_rows(store, "SELECT state, COUNT(*) FROM calls GROUP BY state"),
            ledger_usage=ledger_rows(store, USAGE_SQL),
        )


class TestGuardedPaths:
    def test_every_path_and_route_answered(self, mix: MixOutcome) -> None:
        """Sync, sync stream, async and async stream, via openai/ and volcengine/, all answered."""
        kinds = {(c["path"], c["route"], c["stream"]) for c in mix.run.calls if c["outcome"] == "ok"}
        assert kinds == {
            (path, route, stream)
            for path in ("sync", "async")
            for route in ("openai", "volcengine")
            for stream in (False, True)
        }
        assert len(mix.run.calls) == 12

    def test_one_settled_ledger_row_per_call(self, mix: MixOutcome) -> None:
        """Each of the 12 litellm calls is one settled row: none unseen, none unresolved."""
        assert mix.ledger_states == [("settled", 12)]

    def test_settled_total_is_the_simulators_bill(self, mix: MixOutcome) -> None:
        """quotawrap's settled tokens equal the simulator's bill exactly, call by call too."""
        assert mix.billed > 0
        assert mix.report["totals"]["settled_tokens"] == mix.billed
        assert mix.ledger_usage == mix.bill_usage

    def test_litellm_reports_the_usage_the_guard_settled(self, mix: MixOutcome) -> None:
        """The usage litellm returns for non-streamed calls is what the ledger recorded."""
        seen: Counter[tuple[object, ...]] = Counter(
            (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in mix.run.calls if not c["stream"]
        )
        assert seen.total() == 6
        assert not seen - Counter(mix.ledger_usage)

    def test_sync_goes_through_httpx_and_async_through_httpx_over_aiohttp(self, mix: MixOutcome) -> None:
        """The clients this module's docstring names are the ones that carried the guarded calls."""
        assert set(mix.run.carriers) == {HTTPX_SYNC, HTTPX_ASYNC_OVER_AIOHTTP, AIOHTTP}


class TestConcurrentCap:
    def test_concurrent_acompletions_never_overspend_the_cap(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """8 concurrent acompletion workers calling until blocked: the bill stays under --cap-tokens."""
        sim.configure(reply_tokens=400)
        cap = 6_000
        report = tmp_path / "report.json"
        # Unguarded these workers would make 80 calls of 412 tokens: 32,960 tokens, over 5x the cap.
        run = _guarded(
            sim,
            store,
            ["--cap-tokens", str(cap), "--report-json", str(report)],
            "swarm",
            *("--calls", "8", "--max-calls", "10", "--max-tokens", "500"),
        )
        billed = sim.billed_total()
        assert 0.5 * cap <= billed <= cap
        assert json.loads(report.read_text())["totals"]["settled_tokens"] == billed
        blocked = [c for c in run.calls if c["outcome"] == "blocked"]
        # the summary counts calls answered 429; a call that waited may also have left refused attempts
        assert json.loads(report.read_text())["totals"]["blocked_calls"] == len(blocked)
        assert ledger_rows(store, "SELECT COUNT(*) FROM calls WHERE state = 'blocked'")[0][0] >= len(blocked)
        # At most 14 calls fit, so at most one worker can finish its 10 calls: the rest were blocked.
        assert len(blocked) >= 7
        assert {c["route"] for c in blocked} == {"openai", "volcengine"}

    def test_block_surfaces_as_litellm_rate_limit_error_naming_the_limit(self, sim: ArkSimulator, store: str) -> None:
        """quotawrap's 429 reaches the program as litellm.RateLimitError saying which limit and how to raise it."""
        run = _guarded(sim, store, ["--cap-tokens", "10"], "swarm", "--calls", "2", "--max-calls", "1")
        assert [c["outcome"] for c in run.calls] == ["blocked", "blocked"]
        for call in run.calls:
            assert call["error"] == "litellm.exceptions.RateLimitError"
            assert call["status"] == 429
            assert "quotawrap blocked this request" in call["message"]
            assert "run_cap" in call["message"] and "--cap-tokens" in call["message"]
        assert sim.billed_total() == 0


@dataclass
class StreamPair:
    plain: ChildRun
    guarded: ChildRun
    billed: int
    bill_usage: list[tuple[int, int]]
    ledger_states: list[tuple[object, ...]]
    ledger_usage: list[tuple[object, ...]]


@pytest.fixture(scope="module")
def stream_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamPair]:
    """The same streaming child (sync and async, no usage asked) run once plain and once under quotawrap."""
    store = f"sqlite:///{tmp_path_factory.mktemp('litellm_stream') / 'ledger.sqlite3'}"
    with serve(config=SimConfig(reply_tokens=50)) as sim:
        plain = _unguarded(sim, "stream")
        sim.reset()
        guarded = _guarded(sim, store, [], "stream")
        yield StreamPair(
            plain=plain,
            guarded=guarded,
            billed=sim.billed_total(),
            bill_usage=_bill_usage(sim),
            ledger_states=ledger_rows(store, "SELECT state, SUM(charged) FROM calls GROUP BY state"),
            ledger_usage=ledger_rows(store, USAGE_SQL),
        )


class TestStreamParity:
    def test_stream_without_usage_settles_at_the_real_usage(self, stream_pair: StreamPair) -> None:
        """Streams that did not ask for usage settle at the billed usage (quotawrap asked for it), not a hold."""
        assert stream_pair.ledger_states == [("settled", stream_pair.billed)]
        assert len(stream_pair.ledger_usage) == 2
        assert stream_pair.ledger_usage == stream_pair.bill_usage

    def test_litellm_yields_the_same_chunks_as_without_quotawrap(self, stream_pair: StreamPair) -> None:
        """Chunk count, concatenated text and every chunk litellm yields are as in the unguarded run."""
        assert [(c["path"], c["outcome"]) for c in stream_pair.guarded.calls] == [("sync", "ok"), ("async", "ok")]
        for plain, guarded in zip(stream_pair.plain.calls, stream_pair.guarded.calls, strict=True):
            assert guarded["chunks"] == plain["chunks"] > 2
            assert guarded["text"] == plain["text"] != ""
            assert guarded["dumps"] == plain["dumps"]

    def test_the_injected_usage_chunk_stays_hidden_from_litellm(self, stream_pair: StreamPair) -> None:
        """litellm sees no usage on any chunk, as when the program runs unguarded."""
        assert [c["usage"] for c in stream_pair.plain.calls] == [[], []]
        assert [c["usage"] for c in stream_pair.guarded.calls] == [[], []]


class TestAiohttpProvider:
    def test_aiohttp_openai_provider_is_guarded(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """litellm's aiohttp_openai/ provider calls aiohttp directly: quotawrap's aiohttp seam settles it
        at the simulator's bill, and refuses it under a --cap-tokens of 10 before anything is billed.
        litellm turns that provider's 429 into an InternalServerError built from the reason phrase,
        so the refusal's reason carries quotawrap's message."""
        run = _guarded(sim, store, [], "aiohttp")
        assert run.carriers == [AIOHTTP]
        assert [c["outcome"] for c in run.calls] == ["ok"]
        (settled,) = ledger_rows(store, "SELECT SUM(charged) FROM calls WHERE state = 'settled'")[0]
        assert settled == sim.billed_total() > 0
        billed = sim.billed_total()
        report = tmp_path / "report.json"
        capped = _guarded(sim, store, ["--cap-tokens", "10", "--report-json", str(report)], "aiohttp")
        assert [c["outcome"] for c in capped.calls] == ["blocked"]
        assert "run_cap" in capped.calls[0]["message"]
        assert sim.billed_total() == billed
        assert json.loads(report.read_text())["totals"]["blocked_calls"] == 1
