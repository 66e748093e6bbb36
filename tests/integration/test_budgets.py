"""Issue 33, team budgets held in the ledger, end to end: real `quotawrap` processes against the Ark simulator.

Budgets are set with `quotawrap budget set` on a fresh ledger; agents tagged for two teams then run in
parallel with no budget flag. Each team's bill (the simulator's) stays at or under its budget, nearly all of it
is used, and no call of one team is refused by the other team's budget. The ledger's counter of each budget
equals the simulator's bill exactly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from quotawrap.ledger import open_ledger
from quotawrap.simulator import ArkSimulator, SimConfig, serve
from tests.conftest import child, cli_json, communicate_all, run_cli, sigkill_mid_stream, start_cli
from tests.integration.gateway_process import gateway
from tests.redis_server import flushed, session_url

SEARCH_MODEL, ADS_MODEL = "deepseek-v4-flash", "doubao-seed-1-6-flash-250828"
SEARCH_BUDGET, ADS_BUDGET = 12_000, 18_000
MAX_TOKENS = 400  # what each call reserves (+ its prompt): well under either budget, so many calls fill one


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        return
    with session_url() as url:
        yield flushed(url)


def _set_budgets(store: str) -> None:
    for spec in (f"team=search:{SEARCH_BUDGET}/day", f"team=ads:{ADS_BUDGET // 1000}k/day"):
        done = run_cli("budget", "set", spec, "--store", store)
        assert done.returncode == 0, done.stderr


def _team(
    sim: ArkSimulator, store: str, team: str, model: str, *, threads: int, processes: int, report: Path
) -> subprocess.Popen[str]:
    """One wrapper of agents tagged for ``team`` (no budget flag): each worker calls until refused."""
    swarm = child("swarm.py", "--model", model, "--threads", str(threads), "--processes", str(processes))
    swarm += ["--max-calls", "40", "--max-tokens", str(MAX_TOKENS)]
    run = ["run", "--store", store, "--base-url", sim.url, "--tag", f"team={team}", "--wait", "60", "--quiet"]
    run += ["--report-json", str(report)]
    return start_cli(*run, "--", *swarm, env={"SIM_URL": sim.url})


def _check_bills(sim: ArkSimulator, store: str) -> None:
    billed = sim.billed_by_model()
    uses = {use["spec"].split(":")[0]: use for use in cli_json("budget", "list", "--json", "--store", store)}
    for team, model, budget in (("search", SEARCH_MODEL, SEARCH_BUDGET), ("ads", ADS_MODEL, ADS_BUDGET)):
        bill = billed.get(model, 0)
        assert bill <= budget, f"team {team} billed {bill} over its budget {budget}"
        assert bill >= 0.8 * budget, f"team {team} used only {bill} of its budget {budget}"
        use = uses[f"team={team}"]
        assert (use["used"], use["in_flight"]) == (bill, 0)  # the ledger counted exactly what was billed
        assert use["left"] == budget - bill
    ledger = open_ledger(store)
    try:
        refused = [record for record in ledger.call_records() if record.state == "blocked"]
    finally:
        ledger.close()
    assert refused, "the budgets never refused a call: they did not bind"
    for record in refused:
        team = record.tags.get("team")
        assert record.blocked_by is not None and f"team={team}" in record.blocked_by, (team, record.blocked_by)


def test_two_teams_each_held_to_its_budget(sim: ArkSimulator, shared_store: str, tmp_path: Path) -> None:
    """Threads in one wrapper, processes in another (on Redis a third wrapper shares the search budget)."""
    sim.configure(reply_tokens=300, latency_s=0.02)  # most of each hold is used, and holds overlap in flight
    _set_budgets(shared_store)
    reports = [tmp_path / f"report-{n}.json" for n in range(3)]
    runs = [
        _team(sim, shared_store, "search", SEARCH_MODEL, threads=4, processes=0, report=reports[0]),
        _team(sim, shared_store, "ads", ADS_MODEL, threads=2, processes=2, report=reports[1]),
    ]
    if shared_store.startswith("redis"):
        runs.append(_team(sim, shared_store, "search", SEARCH_MODEL, threads=1, processes=2, report=reports[2]))
    for proc, (_, err) in zip(runs, communicate_all(runs, timeout=300), strict=True):
        assert proc.returncode == 0, err
    _check_bills(sim, shared_store)
    finished = [json.loads(report.read_text()) for report in reports[: len(runs)]]
    for report in finished:  # each run's summary names the budget its calls count against, and no other
        (shown,) = report["budgets"]
        assert shown["spec"].startswith(f"team={report['tags']['team']}:")


def test_refusal_names_budget_numbers_reset_and_cure(sim: ArkSimulator, store: str) -> None:
    assert run_cli("budget", "set", "team=x:50/day", "--store", store).returncode == 0
    done = run_cli(
        "run",
        "--store",
        store,
        "--base-url",
        sim.url,
        "--tag",
        "team=x",
        "--quiet",
        "--",
        *child("one_call.py"),
        env={"SIM_URL": sim.url},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("BLOCKED"), done.stdout
    for words in (
        "budget team=x/day/tokens",
        "> 50",
        "resets",
        "Beijing time",
        "anyone who can reach the ledger may raise it: `quotawrap budget set 'team=x:NEW/day'`",
    ):
        assert words in done.stdout, (words, done.stdout)
    assert sim.calls() == 0
    other = run_cli(
        "run",
        "--store",
        store,
        "--base-url",
        sim.url,
        "--tag",
        "team=y",
        "--quiet",
        "--",
        *child("one_call.py"),
        env={"SIM_URL": sim.url},
    )
    assert other.stdout.startswith("TOTAL"), other.stdout  # another team's call is not the budget's business


def test_a_runs_own_budget(sim: ArkSimulator, store: str) -> None:
    """``--budget`` on a run adds a budget for that run alone."""
    run = ["run", "--store", store, "--base-url", sim.url, "--quiet"]
    limited = run_cli(*run, "--budget", "*:50/run", "--", *child("one_call.py"), env={"SIM_URL": sim.url})
    assert limited.stdout.startswith("BLOCKED") and "budget" in limited.stdout, limited.stdout
    assert cli_json("budget", "list", "--json", "--store", store) == []  # it ended with its run
    free = run_cli(*run, "--", *child("one_call.py"), env={"SIM_URL": sim.url})
    assert free.stdout.startswith("TOTAL"), free.stdout
    bad = run_cli(*run, "--budget", "*:lots/run", "--", *child("one_call.py"), env={"SIM_URL": sim.url})
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_budget_commands(store: str) -> None:
    bad = run_cli("budget", "set", "team=search:200k/fortnight", "--store", store)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "the period must be one of" in bad.stderr
    first = run_cli("budget", "set", "team=search:200k/day", "--store", store)
    again = run_cli("budget", "set", "team=search:200000/day", "--store", store)
    assert "set" in first.stdout and "already set" in again.stdout
    assert run_cli("budget", "set", "*:¥300/month,soft", "--store", store).returncode == 0
    listed = cli_json("budget", "list", "--json", "--store", store)
    assert sorted((use["spec"], use["left"]) for use in listed) == [
        ("*:cny300/month,soft", 300_000_000),
        ("team=search:200000/day", 200_000),
    ]
    raised = run_cli("budget", "set", "team=search:300k/day", "--store", store)
    assert raised.returncode == 0
    assert {use["spec"] for use in cli_json("budget", "list", "--json", "--store", store)} == {
        "*:cny300/month,soft",
        "team=search:300000/day",
    }
    assert run_cli("budget", "rm", "team=search:0/day", "--store", store).returncode == 0
    assert run_cli("budget", "rm", "team=search:0/day", "--store", store).returncode == 1
    assert [use["spec"] for use in cli_json("budget", "list", "--json", "--store", store)] == ["*:cny300/month,soft"]


# -- a monthly money budget across Beijing days: the whole command under libfaketime ---------------------------

# time.sleep as a relative wait, which libfaketime 0.9.10 breaks (tests/integration/test_redis_clock_skew.py)
SLEEP_SHIM = """
import select, time

def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    select.select([], [], [], seconds)

time.sleep = _sleep
"""


def _at(tmp_path: Path, utc: str) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of a process tree whose wall clock starts at ``utc``."""
    binary = shutil.which("faketime")
    if binary is None:
        pytest.fail("faketime is not installed (Debian: apt-get install faketime; `make test` installs it)")
    shim = tmp_path / "faketime_shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
    path = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {"FAKETIME_DONT_FAKE_MONOTONIC": "1", "PYTHONPATH": path, "TZ": "UTC"}
    return [binary, "-f", f"@{utc}"], env


def _quotawrap_at(
    tmp_path: Path, utc: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    prefix, fake_env = _at(tmp_path, utc)
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("QUOTAWRAP_")}, **fake_env, **(env or {})}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "quotawrap", *args], env=full, capture_output=True, text=True, timeout=120
    )


def test_monthly_money_budget_carries_across_beijing_days(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """Spent on one Beijing day, the month's money is still spent the next day; the next month starts afresh."""
    sim.configure(reply_tokens=100)  # each call says all its max_tokens: what it costs is near what it reserves
    env = {"SIM_URL": sim.url}
    # cut: a thinking model's call reserves its max_tokens, not the model's reasoning ceiling besides
    run = ["run", "--store", store, "--base-url", sim.url, "--quiet", "--tag", "team=m", "--reasoning-reserve", "cut"]
    run.append("--")
    one = child("one_call.py")
    list_budgets = ("budget", "list", "--json", "--store", store)
    # what one call costs, priced as the guard prices it: a first call on 2026-12-10, Beijing 23:00
    assert (
        _quotawrap_at(
            tmp_path, "2026-12-10 15:00:00", "budget", "set", "team=m:cny1000/month", "--store", store
        ).returncode
        == 0
    )
    first = _quotawrap_at(tmp_path, "2026-12-10 15:00:00", *run, *one, env=env)
    assert first.stdout.startswith("TOTAL"), first.stderr
    (use,) = json.loads(_quotawrap_at(tmp_path, "2026-12-10 15:00:01", *list_budgets).stdout)
    per_call = use["used"]
    assert per_call > 0 and use["period_key"] == "2026-12"
    # a budget of about three and a half such calls, spent on the 10th
    budget = f"team=m:cny{per_call * 7 / 2 / 1e6:.6f}/month"
    assert _quotawrap_at(tmp_path, "2026-12-10 15:00:02", "budget", "set", budget, "--store", store).returncode == 0
    answers = [_quotawrap_at(tmp_path, "2026-12-10 15:30:00", *run, *one, env=env).stdout for _ in range(6)]
    fitted = sum(answer.startswith("TOTAL") for answer in answers)
    assert fitted >= 1 and answers[-1].startswith("BLOCKED"), answers[0][:400]
    (spent,) = json.loads(_quotawrap_at(tmp_path, "2026-12-10 15:31:00", *list_budgets).stdout)
    assert spent["used"] >= (1 + fitted) * per_call
    next_day = _quotawrap_at(tmp_path, "2026-12-10 16:30:00", *run, *one, env=env)  # Beijing 00:30 on the 11th
    assert next_day.stdout.startswith("BLOCKED") and "budget team=m/month/cny" in next_day.stdout, next_day.stdout
    assert "resets 2027-01-01 00:00 Beijing time" in next_day.stdout
    (carried,) = json.loads(_quotawrap_at(tmp_path, "2026-12-10 16:31:00", *list_budgets).stdout)
    assert (carried["period_key"], carried["used"]) == ("2026-12", spent["used"])
    new_month = _quotawrap_at(tmp_path, "2026-12-31 16:30:00", *run, *one, env=env)  # Beijing 00:30 on 1 January
    assert new_month.stdout.startswith("TOTAL"), new_month.stdout
    (fresh,) = json.loads(_quotawrap_at(tmp_path, "2026-12-31 16:31:00", *list_budgets).stdout)
    assert fresh["period_key"] == "2027-01" and 0 < fresh["used"] < spent["used"]
    assert sim.calls() == 2 + fitted


def test_budgets_shown_where_people_look(sim: ArkSimulator, store: str) -> None:
    """The run's summary and live view, `status`, `report` and `budget list` show each budget: used, in flight,
    left, when it resets; the live view warns as a soft budget passes its thresholds."""
    for spec in ("team=v:100k/day", "team=v:10/hour,soft", "team=other:5/day"):
        assert run_cli("budget", "set", spec, "--store", store).returncode == 0
    run = ["run", "--store", store, "--base-url", sim.url, "--tag", "team=v", "--reasoning-reserve", "cut"]
    done = run_cli(*run, "--", *child("one_call.py"), env={"SIM_URL": sim.url})
    assert done.stdout.startswith("TOTAL"), done.stderr
    spent = int(done.stdout.split()[1])
    assert f"team=v 100,000 tokens/day: used {spent:,}, in flight 0, left {100_000 - spent:,}, resets" in done.stderr
    assert f"team=v 10 tokens/hour (soft): used {spent:,}" in done.stderr
    assert "team=other" not in done.stderr  # no call of the run could count against it
    assert "quotawrap: budget team=v/hour at 100%" in done.stderr  # the soft budget's alert
    rows = cli_json("status", "--json", "--store", store)
    assert rows and all(
        {use["spec"]: use["used"] for use in row["budgets"]}
        == {"team=v:100000/day": spent, "team=v:10/hour,soft": spent, "team=other:5/day": 0}
        for row in rows
    )
    report = cli_json("report", "--format", "json", "--store", store)
    by_spec = {use["spec"]: use for use in report["budgets"]}
    assert (by_spec["team=v:100000/day"]["left"], by_spec["team=v:100000/day"]["in_flight"]) == (100_000 - spent, 0)
    assert by_spec["team=v:100000/day"]["resets_at"] > by_spec["team=v:10/hour,soft"]["resets_at"]
    status = run_cli("status", "--store", store)
    assert "budgets:" in status.stdout and f"used {spent:,}" in status.stdout


def _spend_until_refused(client: openai.OpenAI, model: str) -> list[openai.RateLimitError]:
    """Calls until one is refused (a 429): the refusal; at most 200 calls."""
    for _ in range(200):
        try:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "say something long"}],
                max_tokens=MAX_TOKENS,
                extra_body={"thinking": {"type": "disabled"}},
            )
        except openai.RateLimitError as exc:
            return [exc]
    return []


# A refusal's numbers: settled + in flight + this call = the total, over the budget
_REFUSED_NUMBERS = re.compile(r"\(settled ([\d,]+) \+ in flight ([\d,]+) \+ this call ([\d,]+) = ([\d,]+) > ([\d,]+)\)")


def test_member_keys_each_held_to_their_teams_budget(tmp_path: Path) -> None:
    """Through the gateway with member keys (issue 33, item 3): the members carry their keys' tags, so each team's
    budget holds its members' calls, and no member holds the provider's key."""
    provider_key = str(uuid.uuid4())
    store = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    _set_budgets(store)
    keys = {}
    for name, team in (("ana", "search"), ("bob", "ads")):
        added = run_cli("keys", "add", name, "--tag", f"team={team}", "--store", store)
        assert added.returncode == 0, added.stderr
        keys[name] = next(word for word in added.stdout.split() if word.startswith("qwk-"))
    with serve(config=SimConfig(api_keys=(provider_key,), reply_tokens=300)) as sim:
        args = ["--store", store, "--base-url", sim.url, "--upstream-key-env", "QW_TEST_PROVIDER_KEY"]
        with gateway(args, env={"QW_TEST_PROVIDER_KEY": provider_key}) as gw:
            members = {name: openai.OpenAI(base_url=gw.url, api_key=key, max_retries=0) for name, key in keys.items()}
            with ThreadPoolExecutor(4) as pool:
                refusals = list(
                    pool.map(
                        _spend_until_refused,
                        [members["ana"], members["ana"], members["bob"], members["bob"]],
                        [SEARCH_MODEL, SEARCH_MODEL, ADS_MODEL, ADS_MODEL],
                    )
                )
        teams = ("search", "search", "ads", "ads")
        for (refusal,), team, budget in zip(refusals, teams, (SEARCH_BUDGET,) * 2 + (ADS_BUDGET,) * 2, strict=True):
            message = refusal.message
            assert refusal.response.headers["x-quotawrap-blocked"] == f"budget team={team}/day/tokens", message
            assert refusal.response.headers["x-should-retry"] == "false"
            assert f"would exceed the budget team={team}/day/tokens" in message, message
            numbers = _REFUSED_NUMBERS.search(message)
            assert numbers is not None, message
            settled, in_flight, this_call, total, limit = (int(n.replace(",", "")) for n in numbers.groups())
            assert settled + in_flight + this_call == total > limit == budget, message
            assert re.search(r"resets \d{4}-\d{2}-\d{2} 00:00 Beijing time", message), message
            assert f"may raise it: `quotawrap budget set 'team={team}:NEW/day'`" in message, message
            assert provider_key not in message and provider_key not in str(refusal.response.headers)
        _check_bills(sim, store)


def test_an_abandoned_stream_is_charged_to_its_budget(sim: ArkSimulator, store: str) -> None:
    """A child SIGKILLed mid-stream: the wrapper charges its hold whole (unresolved), and the budget with it."""
    assert run_cli("budget", "set", "*:10M/day", "--store", store).returncode == 0
    _, (state, charged, reserved) = sigkill_mid_stream(sim, store)
    assert state == "unresolved" and charged == reserved > 0
    (use,) = cli_json("budget", "list", "--json", "--store", store)
    assert (use["used"], use["in_flight"]) == (charged, 0)
