"""``--alert-webhook``: real wrapped runs (and a gateway) post each threshold of the day's limit once to a real
receiver on 127.0.0.1, however many wrappers share the store, and whatever posts the receiver fails first."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, cli_json, communicate_all, run_cli, run_quotawrap, start_cli
from tests.integration.gateway_process import chat_body, gateway
from tests.redis_server import session_url
from tests.webhook_receiver import Receiver, webhook

MODEL = "deepseek-v4-flash"
LIMITS = ["--daily-cap", "3000", "--usage-wall", "3000", "--wait", "0"]
ALERT_AT = "20,40,60"
EXPECTED = [("daily limit", MODEL, percent) for percent in (20.0, 40.0, 60.0)]
PROMPT = "say something long"  # swarm.py's prompt: no alert may carry it


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest, store: str) -> Iterator[str]:
    if request.param == "sqlite":
        yield store
        return
    with session_url() as url:
        yield url


def _wrapper_args(store: str, sim: ArkSimulator, receiver: Receiver, team: str) -> list[str]:
    return [
        "--store", store, "--base-url", sim.url, "--tag", f"team={team}", *LIMITS,
        "--alert-webhook", receiver.url, "--alert-at", ALERT_AT,
    ]  # fmt: skip


def _swarm() -> list[str]:
    return child("swarm.py", "--threads", "2", "--max-calls", "6", "--max-tokens", "200", "--model", MODEL)


def _no_secret_nor_prompt(receiver: Receiver) -> None:
    for body in receiver.bodies:
        text = json.dumps(body)
        assert "sk-test" not in text and PROMPT not in text and "secret-part" not in text


def test_two_wrappers_on_one_store_post_each_threshold_once(sim: ArkSimulator, store_url: str) -> None:
    """Two runs at once spend one model's day on one store: 20%, 40% and 60% are each announced by one of them."""
    sim.configure(reply_tokens=300)
    with webhook() as receiver:
        runs = [
            start_cli(*_wrapper_args(store_url, sim, receiver, team), "--", *_swarm(), env={"SIM_URL": sim.url})
            for team in ("alpha", "beta")
        ]
        outputs = communicate_all(runs, timeout=180)
    assert [run.returncode for run in runs] == [0, 0], outputs
    (row,) = cli_json("status", "--store", store_url, "--json", *LIMITS[:4])
    assert row["usage"] >= 0.6 * row["effective_limit"]  # the day went past every threshold
    assert sorted(receiver.thresholds()) == EXPECTED
    _no_secret_nor_prompt(receiver)
    assert all("session " in body["text"] and "Beijing day" in body["text"] for body in receiver.bodies)


def test_a_receiver_that_fails_first_still_gets_each_once(sim: ArkSimulator, store: str) -> None:
    """The receiver answers 500 to its first two posts: retried, each threshold still arrives exactly once."""
    sim.configure(reply_tokens=300)
    with webhook(fail_first=2) as receiver:
        result = run_quotawrap(_wrapper_args(store, sim, receiver, "alpha"), _swarm(), env={"SIM_URL": sim.url})
    assert result.returncode == 0, result.stderr
    assert receiver.refused == 2
    assert sorted(receiver.thresholds()) == EXPECTED
    assert "alerts:" not in result.stderr  # nothing was given up


def test_a_later_run_does_not_repeat_them(sim: ArkSimulator, store: str) -> None:
    """The store remembers what was sent: a second run the same day crosses nothing new and posts nothing."""
    sim.configure(reply_tokens=300)
    with webhook() as receiver:
        first = run_quotawrap(_wrapper_args(store, sim, receiver, "alpha"), _swarm(), env={"SIM_URL": sim.url})
        sent = len(receiver.bodies)
        second = run_quotawrap(_wrapper_args(store, sim, receiver, "beta"), _swarm(), env={"SIM_URL": sim.url})
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert sent >= 1 and len(receiver.bodies) == sent
    assert sorted(receiver.thresholds()) == EXPECTED


def test_the_gateway_alerts_too(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """quotawrap serve with --alert-webhook: calls through it cross the thresholds; each is posted once."""
    sim.configure(reply_tokens=300)
    headers = {"content-type": "application/json", "authorization": "Bearer sk-test"}
    with webhook() as receiver:
        args = [
            "--store",
            store,
            "--base-url",
            sim.url,
            *LIMITS,
            "--alert-webhook",
            receiver.url,
            "--alert-at",
            ALERT_AT,
        ]
        with gateway(args) as gw:
            codes = [
                httpx.post(
                    f"{gw.url}/chat/completions", content=chat_body(max_tokens=200), headers=headers, timeout=60
                ).status_code
                for _ in range(16)  # ~220 tokens each: past the 3,000 cap
            ]
            code, err = gw.terminate()
    assert code == 0, err
    assert 200 in codes and 429 in codes
    assert sorted(receiver.thresholds()) == EXPECTED
    _no_secret_nor_prompt(receiver)


def test_a_soft_budget_posts_each_threshold_once_from_two_quiet_wrappers(sim: ArkSimulator, store_url: str) -> None:
    """A soft budget set with `budget set` never refuses: two `--quiet` runs on one store spend past it, and each of
    50%, 80% and 100% of it is posted once, by one of them (the model's day stays far from its thresholds)."""
    sim.configure(reply_tokens=300)
    done = run_cli("budget", "set", "*:4000/day,soft", "--store", store_url)
    assert done.returncode == 0, done.stderr
    with webhook() as receiver:
        args = ["--store", store_url, "--base-url", sim.url, "--quiet", "--alert-webhook", receiver.url]
        runs = [
            start_cli(*args, "--tag", f"team={team}", "--", *_swarm(), env={"SIM_URL": sim.url})
            for team in ("alpha", "beta")
        ]
        outputs = communicate_all(runs, timeout=180)
    assert [run.returncode for run in runs] == [0, 0], outputs
    for out, err in outputs:
        answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert answers and all(answer["outcome"] == "ok" for answer in answers), out  # soft: nothing refused
        assert "budget" not in err and "%" not in err, err  # quiet: the webhook is where it is heard
    (use,) = cli_json("budget", "list", "--json", "--store", store_url)
    assert use["used"] > use["amount"] and use["in_flight"] == 0
    assert sorted(receiver.thresholds()) == [("budget", use["id"], percent) for percent in (50.0, 80.0, 100.0)]
    sessions = {row["session"] for row in cli_json("sessions", "--json", "--store", store_url)}
    for body in receiver.bodies:
        fields = body["quotawrap"]
        assert fields["session"] in sessions and fields["limit_amount"] == use["amount"]
        assert fields["period"] == use["period_key"] and fields["unit"] == "tokens"
        assert body["text"].startswith(f"quotawrap: budget {use['id']} reached {fields['threshold_percent']:g}%")
    _no_secret_nor_prompt(receiver)


def test_a_runs_own_soft_budget_and_a_per_run_one_are_posted_too(sim: ArkSimulator, store_url: str) -> None:
    """``--budget`` (a budget for the run alone, gone from the ledger when it ends) and a budget of the store counted
    per run are watched in this run: a run that spends past both posts each threshold of each once."""
    sim.configure(reply_tokens=300)
    assert run_cli("budget", "set", "*:2000/run,soft", "--store", store_url).returncode == 0
    with webhook() as receiver:
        args = ["--store", store_url, "--base-url", sim.url, "--quiet", "--alert-webhook", receiver.url]
        done = run_quotawrap([*args, "--budget", "*:1500/run,soft"], _swarm(), env={"SIM_URL": sim.url})
    assert done.returncode == 0, done.stderr
    (per_run,) = cli_json("budget", "list", "--json", "--store", store_url)  # the run's own ended with it
    (session,) = [row["session"] for row in cli_json("sessions", "--json", "--store", store_url)]
    (report,) = cli_json("report", "--by", "session", "--format", "json", "--store", store_url)["rows"]
    assert report["settled_tokens"] > 2000 and report["blocked_calls"] == 0
    own = f"*/run/tokens@run={session}"
    assert sorted(receiver.thresholds()) == [
        ("budget", name, percent) for name in (per_run["id"], own) for percent in (50.0, 80.0, 100.0)
    ]
    assert all(body["quotawrap"]["period"] == session for body in receiver.bodies)
