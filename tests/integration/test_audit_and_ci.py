"""Attribution, money, reports and the CI gate, through the real CLI against the simulator."""

from __future__ import annotations

import json
import os
import sys
from decimal import Decimal
from pathlib import Path

from quotawrap.core.money import format_cny
from quotawrap.core.prices import PriceTable
from quotawrap.core.usage import Usage
from quotawrap.ledger import open_ledger
from quotawrap.simulator import ArkSimulator
from tests.conftest import child, ledger_rows, run_cli, run_quotawrap

MODEL = "deepseek-v3-1"


class TestAttribution:
    def test_report_by_tag_matches_what_the_simulator_billed_each(self, sim: ArkSimulator, store: str) -> None:
        """Two wrapped programs with different tags on one ledger: per-tag totals equal each one's bill."""
        sim.configure(reply_tokens=300)
        billed = {}
        for team, threads in (("alpha", "3"), ("beta", "5")):
            before = sim.billed_total()
            result = run_quotawrap(
                ["--store", store, "--base-url", sim.url, "--tag", f"team={team}", "--cap-tokens", "6000"],
                child("swarm.py", "--threads", threads, "--max-calls", "3", "--model", MODEL),
                env={"SIM_URL": sim.url},
            )
            assert result.returncode == 0, result.stderr
            billed[team] = sim.billed_total() - before
        report = run_cli("report", "--store", store, "--by", "tag:team", "--format", "json")
        rows = {row["key"]: row for row in json.loads(report.stdout)["rows"]}
        assert {team: rows[team]["settled_tokens"] for team in billed} == billed
        assert billed["alpha"] != billed["beta"]
        users = json.loads(run_cli("report", "--store", store, "--by", "tag:user", "--format", "json").stdout)["rows"]
        assert sum(row["settled_tokens"] for row in users) == sum(billed.values())

    def test_sessions_list_runs_with_totals_and_tags(self, sim: ArkSimulator, store: str) -> None:
        """`quotawrap sessions` lists each run with its command, exit code, tags and totals."""
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--tag", "job=nightly"],
            child("one_call.py"),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        (session,) = json.loads(run_cli("sessions", "--store", store, "--json").stdout)
        assert session["tags"]["job"] == "nightly" and "host" in session["tags"]
        assert session["exit_code"] == 0 and "one_call.py" in session["command"]
        assert session["calls"] == 1 and session["settled_tokens"] == sim.billed_total()

    def test_audit_log_has_every_call_and_never_the_key(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """--audit-log gets one JSON line per guarded call (blocked too) with a key fingerprint, not the key."""
        log = tmp_path / "audit.jsonl"
        result = run_quotawrap(
            # --wait 0: calls that do not fit are refused (a waiting call leaves no refused row to log)
            ["--store", store, "--base-url", sim.url, "--audit-log", str(log), "--cap-tokens", "1500", "--wait", "0"],
            child("swarm.py", "--threads", "4", "--max-calls", "2", "--model", MODEL),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(lines) == ledger_rows(store, "SELECT COUNT(*) FROM calls")[0][0]
        assert {line["outcome"] for line in lines} >= {"settled", "blocked"}
        assert all(line["key_fingerprint"].startswith("sha256:") for line in lines)
        assert "sk-test" not in log.read_text()
        assert oct(log.stat().st_mode & 0o777) == "0o600"
        from_log = json.loads(run_cli("report", "--audit-log", str(log), "--format", "json").stdout)["rows"]
        from_ledger = json.loads(run_cli("report", "--store", store, "--format", "json").stdout)["rows"]
        assert from_log == from_ledger


class TestMoney:
    def test_cost_cap_holds_and_costs_are_priced_from_usage(self, sim: ArkSimulator, store: str) -> None:
        """--cap-cost blocks before the money runs out; each call's cost is the price table applied to its usage."""
        sim.configure(reply_tokens=400)
        cap_cny = Decimal("0.03")
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--cap-cost", str(cap_cny)],
            child("swarm.py", "--threads", "6", "--model", MODEL),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        rows = ledger_rows(
            store, "SELECT prompt_tokens, completion_tokens, charged_cost FROM calls WHERE state = 'settled'"
        )
        assert rows
        table = PriceTable()
        for prompt, completion, cost in rows:
            assert cost == table.actual_cost(MODEL, Usage(prompt, completion, prompt + completion)) > 0
        assert sum(cost for *_, cost in rows) <= cap_cny * 1_000_000
        assert ledger_rows(store, "SELECT COUNT(*) FROM calls WHERE blocked_by = 'cost_cap'")[0][0] > 0

    def test_cost_block_message_is_in_money(self, sim: ArkSimulator, store: str) -> None:
        """The 429 of a cost cap names the cap and its numbers in CNY, and how to raise it."""
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--cap-cost", "0.0001"],
            child("one_call.py"),
            env={"SIM_URL": sim.url, "MODEL": MODEL},
        )
        assert "BLOCKED" in result.stdout and "cost_cap" in result.stdout
        assert "> ¥0.000100" in result.stdout and "--cap-cost" in result.stdout

    def test_unknown_price_error_policy_refuses_the_model(self, sim: ArkSimulator, store: str) -> None:
        """--unknown-price error: a model with no price is refused rather than priced at zero."""
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--unknown-price", "error"],
            child("one_call.py"),
            env={"SIM_URL": sim.url, "MODEL": "no-such-model-xyz"},
        )
        assert sim.billed_total() == 0
        assert "no-such-model-xyz" in result.stdout + result.stderr


class TestCiGate:
    def test_capped_run_fails_the_job_and_reports_agree(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """A child that keeps calling past --cap-tokens: exit 3, and report JSON, step summary and ledger agree."""
        sim.configure(reply_tokens=300)
        report = tmp_path / "report.json"
        summary = tmp_path / "summary.md"
        summary.write_text("# earlier step\n")
        result = run_quotawrap(
            [
                "--store",
                store,
                "--base-url",
                sim.url,
                "--cap-tokens",
                "5000",
                "--fail-on-block",
                "--report-json",
                str(report),
            ],
            child("swarm.py", "--threads", "2", "--model", MODEL),
            env={"SIM_URL": sim.url, "GITHUB_STEP_SUMMARY": str(summary)},
        )
        assert result.returncode == 3, result.stderr
        data = json.loads(report.read_text())
        (settled, blocked) = ledger_rows(
            store, "SELECT SUM(charged), SUM(state = 'blocked') FROM calls WHERE run_id = ?", (data["session"],)
        )[0]
        assert data["totals"]["settled_tokens"] == settled == sim.billed_total() <= 5000
        # blocked = calls answered 429; a call that waited may have left refused attempts in the ledger too
        answered_429 = [line for line in result.stdout.splitlines() if '"outcome": "blocked"' in line]
        assert data["totals"]["blocked_calls"] == len(answered_429) >= 1
        assert blocked >= len(answered_429)
        text = summary.read_text()
        assert text.startswith("# earlier step\n")
        assert f"{settled:,} tokens settled" in text and f"**blocked calls: {len(answered_429)}**" in text
        assert f"| {MODEL} |" in text
        # the exit code CI saw, in the report and on the step summary's page; the command's beside it
        assert data["exit_code"] == 3 and data["command_exit_code"] == 0
        assert "exit code 3 (--fail-on-block; the command exited 0)" in text and "exit code 0 " not in text
        # one name and one unit for money: report --format json's cost_micro_cny, shown by one rule everywhere
        rows = json.loads(run_cli("report", "--store", store, "--format", "json").stdout)["rows"]
        (session,) = json.loads(run_cli("sessions", "--store", store, "--json").stdout)
        cost = data["totals"]["cost_micro_cny"]
        assert "settled_cost" not in data["totals"] and "settled_cost" not in data["models"][MODEL]
        assert cost == data["models"][MODEL]["cost_micro_cny"] == sum(row["cost_micro_cny"] for row in rows) > 0
        assert cost == session["cost_micro_cny"]
        shown = format_cny(cost)
        assert f"({shown})" in result.stderr and f"({shown})" in text
        assert shown in run_cli("report", "--store", store).stdout
        assert shown in run_cli("sessions", "--store", store).stdout

    def test_ledger_totals_survive_for_status_after_the_run(self, sim: ArkSimulator, store: str) -> None:
        """After a run, `status` shows today's usage of the model equal to the bill."""
        run_quotawrap(["--store", store, "--base-url", sim.url], child("one_call.py"), env={"SIM_URL": sim.url})
        rows = json.loads(run_cli("status", "--store", store, "--json").stdout)
        assert rows[0]["usage"] == sim.billed_total() > 0
        assert open_ledger(store).known_models() == [rows[0]["model"]]


def test_no_secret_in_the_environment_reaches_tags(sim: ArkSimulator, store: str) -> None:
    """An API key in the environment never becomes a tag of the run."""
    run_quotawrap(
        ["--store", store, "--base-url", sim.url],
        child("one_call.py"),
        env={"SIM_URL": sim.url, "ARK_API_KEY": "sk-very-secret", "GITHUB_TOKEN": "ghp_secret", "CI": "true"},
    )
    dumped = json.dumps(ledger_rows(store, "SELECT tags FROM runs") + ledger_rows(store, "SELECT tags FROM calls"))
    assert "secret" not in dumped
    assert os.environ.get("ARK_API_KEY") != "sk-very-secret"


def test_ci_example_suite_is_cut_off_at_the_cap(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """examples/ci: the guarded pytest suite fails the job with exit 3 once it would pass the cap."""
    sim.configure(reply_tokens=150)
    report = tmp_path / "llm-cost.json"
    example = Path(__file__).resolve().parents[2] / "examples" / "ci"
    result = run_quotawrap(
        [
            "--store",
            store,
            "--base-url",
            sim.url,
            "--cap-tokens",
            "700",
            "--fail-on-block",
            "--report-json",
            str(report),
        ],
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(example)],
        env={"ARK_BASE_URL": sim.url, "LLM_MODEL": "deepseek-v4-flash"},
    )
    assert result.returncode == 3, result.stdout + result.stderr
    data = json.loads(report.read_text())
    assert data["totals"]["blocked_calls"] >= 1
    assert data["totals"]["settled_tokens"] == sim.billed_total() <= 700
    assert "failed" in result.stdout  # the blocked tests failed inside pytest, with the 429 in their output


def test_quotawrap_toml_reaches_children_in_another_directory(sim: ArkSimulator, tmp_path: Path) -> None:
    """./quotawrap.toml sets options and prices for the wrapper and for a child that changed directory."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "quotawrap.toml").write_text(
        f'store = "sqlite:///{tmp_path / "ledger.sqlite3"}"\n'
        'tag = ["team=from-toml"]\n'
        '[prices."deepseek-v4-flash"]\ninput = 1000.0\ncached_input = 1000.0\noutput = 1000.0\n'
    )
    script = tmp_path / "elsewhere.py"
    script.write_text(
        "import os, runpy, sys\n"
        f"os.chdir({str(tmp_path)!r})\n"
        f"runpy.run_path({str(child('one_call.py')[1])!r}, run_name='__main__')\n"
    )
    result = run_quotawrap(
        ["--base-url", sim.url], [sys.executable, str(script)], env={"SIM_URL": sim.url}, cwd=project
    )
    assert result.returncode == 0, result.stderr
    store = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    ((charged, cost, tags),) = ledger_rows(store, "SELECT charged, charged_cost, tags FROM calls")
    assert charged == sim.billed_total() > 0
    assert cost == charged * 1000  # ¥1000 per million tokens = 1,000 micro-CNY per token
    assert json.loads(tags)["team"] == "from-toml"
