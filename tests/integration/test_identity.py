"""One identity per model, end to end: endpoint ids and spellings of one model share its limits.

The real CLI, the openai SDK from threads and processes, the simulator serving two endpoint ids as one
foundation model (and billing it as that model, as Ark does), SQLite and Redis.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quotawrap.core.identity import UNMAPPED
from quotawrap.ledger import open_ledger
from quotawrap.simulator import ArkSimulator, SimConfig, serve
from tests.conftest import child, run_cli, run_quotawrap
from tests.redis_server import flushed, session_url

EP_A, EP_B = "ep-20250101123456-abcde", "ep-20250202123456-fghij"
FLASH = "deepseek-v4-flash-260425"
CREDENTIALS = {"VOLC_ACCESSKEY": "AKtest", "VOLC_SECRETKEY": "SKtest"}


@pytest.fixture
def ep_sim() -> Iterator[ArkSimulator]:
    """The simulator serving EP_A and EP_B as FLASH: answered with FLASH's id, billed as FLASH."""
    with serve(config=SimConfig(endpoints=((EP_A, FLASH), (EP_B, FLASH)), reply_tokens=40)) as simulator:
        yield simulator


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        return
    with session_url() as url:
        yield flushed(url)


def _records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _agent(names: list[str], *extra: str) -> list[str]:
    return child("identity_agent.py", "--names", ",".join(names).replace("\n", "\\n"), *extra)


def _capped(store: str, sim: ArkSimulator, cap: int, report: Path, *model: str) -> list[str]:
    limits = ["--daily-cap", str(cap), "--usage-wall", str(cap)]
    return ["--store", store, "--base-url", sim.url, *limits, "--report-json", str(report), *model]


class TestOneCapPerModel:
    def test_calls_that_may_think_share_it_too(self, ep_sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """The same with thinking left on: each call is bounded by the guard (an unmapped one to fit every model's
        day), and the three names still share one cap, used nearly whole."""
        cap = 8_000  # above the thinking floor (4,096): a call that may think needs that much room
        report = tmp_path / "report.json"
        result = run_quotawrap(
            _capped(store, ep_sim, cap, report, "--model", "deepseek-v4-flash"),
            _agent([EP_A, EP_B, FLASH], "--processes", "2", "--threads", "4", "--thinking", "--max-calls", "80"),
            env={"SIM_URL": ep_sim.url},
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        answered = Counter(r["name"] for r in _records(result.stdout) if r["outcome"] == "ok")
        assert set(answered) == {EP_A, EP_B, FLASH}, answered
        billed = ep_sim.billed_total()
        assert 0.8 * cap <= billed <= cap and ep_sim.billed_by_model() == {FLASH: billed}
        assert json.loads(report.read_text())["models"][FLASH]["settled_tokens"] == billed

    def test_two_endpoint_ids_and_the_name_share_one_daily_cap(
        self, ep_sim: ArkSimulator, any_store: str, tmp_path: Path
    ) -> None:
        """Under --model naming the model and --daily-cap, calls through two endpoint ids nobody mapped and the
        model's own id, from 3 processes x 6 threads, share the one cap: billed within it, most of it used, every
        call settled on the model, the endpoints learned in the ledger."""
        cap = 1_500
        report = tmp_path / "report.json"
        result = run_quotawrap(
            _capped(any_store, ep_sim, cap, report, "--model", "deepseek-v4-flash"),
            _agent([EP_A, EP_B, FLASH], "--processes", "3", "--threads", "6"),
            env={"SIM_URL": ep_sim.url},
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        answered = Counter(r["name"] for r in _records(result.stdout) if r["outcome"] == "ok")
        assert set(answered) == {EP_A, EP_B, FLASH}, answered  # each name was served, and guarded
        billed = ep_sim.billed_total()
        assert ep_sim.billed_by_model() == {FLASH: billed}
        assert 0.8 * cap <= billed <= cap
        data = json.loads(report.read_text())
        assert set(data["models"]) - {UNMAPPED} == {FLASH}, data["models"]  # no row per endpoint id
        unmapped = data["models"].get(UNMAPPED, {"settled_tokens": 0, "calls": 0})
        # an unmapped call refused (no room left for it) stays one; every other moved to the model it is
        assert unmapped["settled_tokens"] == unmapped["calls"] == 0
        assert data["models"][FLASH]["settled_tokens"] == data["totals"]["settled_tokens"] == billed
        assert data["totals"]["outside_filter_calls"] == 0 and "UNGUARDED" not in result.stderr
        ledger = open_ledger(any_store)
        try:
            assert ledger.endpoint_models() == {EP_A: FLASH, EP_B: FLASH}
        finally:
            ledger.close()

    def test_spellings_share_the_model_cap(self, ep_sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """Spellings of the model (case, whitespace around it, a trailing newline) count against its cap: once the
        model's own calls filled it, each of them is refused by quotawrap and never reaches the provider."""
        cap = 600
        report = tmp_path / "report.json"
        filled = run_quotawrap(
            _capped(store, ep_sim, cap, report), _agent([FLASH], "--threads", "4"), env={"SIM_URL": ep_sim.url}
        )
        assert filled.returncode == 0, filled.stderr
        billed = ep_sim.billed_total()
        assert cap - 200 <= billed <= cap  # full: no room for another call of ~100 tokens
        seen = dict(ep_sim.requests_by_path())
        spellings = ["DeepSeek-V4-Flash-260425", f" {FLASH}", f"{FLASH}\n", f"\t{FLASH.upper()} "]
        result = run_quotawrap(
            _capped(store, ep_sim, cap, report),
            _agent(spellings, "--threads", "2", "--max-calls", "4", "--keep-going"),
            env={"SIM_URL": ep_sim.url},
        )
        assert result.returncode == 0, result.stderr
        outcomes = Counter((r["name"], r["outcome"]) for r in _records(result.stdout))
        assert outcomes == {(spelling, "blocked"): 2 for spelling in spellings}
        assert dict(ep_sim.requests_by_path()) == seen and ep_sim.billed_total() == billed
        data = json.loads(report.read_text())
        assert set(data["models"]) == {FLASH} and data["models"][FLASH]["blocked_calls"] == 8


class TestModelFilter:
    def test_a_filter_that_names_another_model_says_which_calls_went_unguarded(
        self, ep_sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """--model naming another model: calls to the model and through its endpoint ids go out, and the run says
        so on stderr and per model in the summary table and the report JSON (not "0 guarded calls" alone)."""
        report = tmp_path / "report.json"
        result = run_quotawrap(
            ["--store", store, "--base-url", ep_sim.url, "--model", "doubao-seed", "--report-json", str(report)],
            _agent([EP_A, FLASH], "--threads", "1", "--max-calls", "6"),
            env={"SIM_URL": ep_sim.url},
        )
        assert result.returncode == 0, result.stderr
        assert len([r for r in _records(result.stdout) if r["outcome"] == "ok"]) == 6
        data = json.loads(report.read_text())
        # EP_A's first call was guarded (its model was not known); its answer named FLASH, outside the filter
        unguarded = data["models"][FLASH]["outside_filter_calls"]
        assert unguarded == 5 and data["totals"]["outside_filter_calls"] == 5
        assert data["models"][FLASH]["calls"] == 1 and data["model_filter"] == ["doubao-seed"]
        assert f"--model doubao-seed does not name {FLASH}: its calls go out UNGUARDED" in result.stderr
        assert f"5 call(s) to {FLASH} went out UNGUARDED: --model doubao-seed does not name that model" in result.stderr
        assert "NOT everything went through the guard" in result.stderr
        header = next(line for line in result.stderr.splitlines() if line.strip().startswith("model "))
        assert header.rstrip().endswith("UNGUARDED")

    def test_a_filter_by_endpoint_id_still_guards_its_calls(
        self, ep_sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """--model naming an endpoint id (as before) guards the calls through it, counted as its model."""
        report = tmp_path / "report.json"
        result = run_quotawrap(
            ["--store", store, "--base-url", ep_sim.url, "--model", "ep-2025*", "--report-json", str(report)],
            _agent([EP_A, EP_B], "--threads", "1", "--max-calls", "4"),
            env={"SIM_URL": ep_sim.url},
        )
        assert result.returncode == 0, result.stderr
        data = json.loads(report.read_text())
        assert data["models"][FLASH]["calls"] == 4 and data["totals"]["outside_filter_calls"] == 0


class TestEndpointTable:
    def test_a_mapped_endpoint_is_never_unmapped(self, ep_sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """An endpoint named in quotawrap.toml's [endpoints] counts against its model from its first call on."""
        (tmp_path / "quotawrap.toml").write_text(f'[endpoints]\n"{EP_A.upper()}" = "{FLASH}"\n')
        result = run_quotawrap(
            ["--store", store, "--base-url", ep_sim.url, "--daily-cap", "100000"],
            _agent([EP_A], "--threads", "3", "--max-calls", "3"),
            env={"SIM_URL": ep_sim.url},
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
        ledger = open_ledger(store)
        try:
            records = ledger.call_records()
        finally:
            ledger.close()
        assert len(records) == 9 and {r.model for r in records} == {FLASH}  # not one went through UNMAPPED

    def test_a_table_that_is_no_table_stops_the_run_before_it_starts(self, store: str, tmp_path: Path) -> None:
        """A key that is no endpoint id is a usage error naming it (exit 2), before the child starts."""
        (tmp_path / "quotawrap.toml").write_text(f'[endpoints]\n"{FLASH}" = "{FLASH}"\n')
        result = run_quotawrap(["--store", store], ["python", "-c", "print('ran')"], cwd=tmp_path)
        assert result.returncode == 2 and "ran" not in result.stdout
        assert f"[endpoints]: '{FLASH}' is not an endpoint id" in result.stderr


class TestManagementApi:
    def test_sync_lists_the_endpoints_into_the_ledger(self, ep_sim: ArkSimulator, store: str) -> None:
        """`quotawrap sync` with VolcEngine credentials lists the account's endpoints (ListEndpoints through the
        official SDK, against the simulator's management API) and keeps each pair in the ledger."""
        result = run_cli("sync", "--store", store, "--billing-endpoint", ep_sim.base_url, env=CREDENTIALS)
        assert result.returncode == 0, result.stderr
        assert f"{EP_A}: serves {FLASH}" in result.stdout
        assert any("ListEndpoints" in path for path in ep_sim.requests_by_path())
        ledger = open_ledger(store)
        try:
            assert ledger.endpoint_models() == {EP_A: FLASH, EP_B: FLASH}
        finally:
            ledger.close()

    def test_a_run_with_credentials_lists_them_too(self, ep_sim: ArkSimulator, store: str) -> None:
        """The wrapper of a run with credentials lists the endpoints as it starts; a listing that fails is said
        and the run goes on."""
        args = ["--store", store, "--base-url", ep_sim.url, "--billing-endpoint", ep_sim.base_url]
        result = run_quotawrap(args, ["python", "-c", "import time; time.sleep(1)"], env=CREDENTIALS)
        assert result.returncode == 0, result.stderr
        ledger = open_ledger(store)
        try:
            assert ledger.endpoint_models() == {EP_A: FLASH, EP_B: FLASH}
        finally:
            ledger.close()
        failed = run_quotawrap([*args[:2], "--billing-endpoint", "http://127.0.0.1:9"], ["true"], env=CREDENTIALS)
        assert failed.returncode == 0 and "endpoint listing failed" in failed.stderr


def test_unmapped_is_no_model_a_run_reports(ep_sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """Every unmapped call of a run moved to the model its answer named: no row of UNMAPPED is left to show."""
    report = tmp_path / "report.json"
    result = run_quotawrap(
        ["--store", store, "--base-url", ep_sim.url, "--report-json", str(report)],
        _agent([EP_A, EP_B], "--threads", "2", "--max-calls", "2"),
        env={"SIM_URL": ep_sim.url},
    )
    assert result.returncode == 0, result.stderr
    assert UNMAPPED not in json.loads(report.read_text())["models"] and UNMAPPED not in result.stderr
