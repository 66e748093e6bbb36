"""The dashboard in a real browser: headless Chromium (the system's, driven by Playwright) loads the page that
`quotawrap dashboard` and `quotawrap serve` serve after real guarded runs against the simulator, on SQLite and
on Redis. The page shows each model's settled and in-flight tokens as `status --json` does, with no console
error, and follows a call that settles."""

from __future__ import annotations

import contextlib
import json
import re
import selectors
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, cli_json, run_cli, run_quotawrap, start_cli
from tests.integration.gateway_process import GatewayProcess
from tests.redis_server import private_server, session_url

MODEL = "deepseek-v4-flash"
# What each model's card shows as numbers, each under the name `status --json` gives it.
FIELDS = ("usage", "in_flight", "effective_limit", "headroom", "waiting", "refused")
_SHOWN = """([model, fields]) => {
  const card = document.querySelector(`article.model[data-model="${CSS.escape(model)}"]`);
  if (!card) return null;
  const number = (f) => Number(card.querySelector(`[data-field="${f}"]`).textContent.replace(/,/g, ""));
  return Object.fromEntries(fields.map((f) => [f, number(f)]));
}"""
_SHOWS = """([model, want]) => {
  const card = document.querySelector(`article.model[data-model="${CSS.escape(model)}"]`);
  return !!card && Object.entries(want).every(
    ([f, v]) => Number(card.querySelector(`[data-field="${f}"]`).textContent.replace(/,/g, "")) === v);
}"""


@pytest.fixture(autouse=True)
def _own_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits and processes outside the guard that status and the page count come from this host's events
    logs, in the state directory: each test has its own, so runs of other suites on the machine stay out."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: `make test` installs it (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=path, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        return
    with session_url() as url:
        yield url


def _line(proc: subprocess.Popen[str], pattern: str, *, stream: str = "stdout", timeout: float = 60) -> re.Match[str]:
    """The first line of the process's ``stream`` that matches ``pattern``; fails the test if it ends first."""
    pipe = getattr(proc, stream)
    selector = selectors.DefaultSelector()
    selector.register(pipe, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not selector.select(timeout=0.5):
            continue
        line = pipe.readline()
        if not line:
            break
        found = re.search(pattern, line)
        if found:
            return found
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"no line matching {pattern!r}:\n{out}\n{err}")


class _Served:
    """A ``quotawrap dashboard`` process: its URL once it listens, its stderr once it ended."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.url = _line(proc, r"quotawrap dashboard on (\S+)").group(1)
        self.stderr = ""


@contextlib.contextmanager
def _dashboard(*args: str) -> Iterator[_Served]:
    served = _Served(start_cli("dashboard", "--port", "0", *args))
    try:
        yield served
    finally:
        served.proc.terminate()
        served.stderr = served.proc.communicate(timeout=30)[1]


class _Page:
    """A tab on the page that keeps every console error and uncaught exception."""

    def __init__(self, browser: Any, url: str) -> None:
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": 1200, "height": 900})
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.goto(url)
        self.page.wait_for_selector("#freshness[data-state=ok]")

    def shown(self, model: str) -> dict[str, int]:
        figures = self.page.evaluate(_SHOWN, [model, list(FIELDS)])
        assert figures is not None, f"the page has no card for {model}"
        return dict(figures)

    def wait_until_shown(self, model: str, want: dict[str, int]) -> None:
        from playwright.sync_api import TimeoutError as Timeout

        try:
            self.page.wait_for_function(_SHOWS, arg=[model, want], timeout=60_000)
        except Timeout:
            shown = self.page.evaluate(_SHOWN, [model, list(FIELDS)])
            said = self.page.inner_text("#freshness")
            raise AssertionError(f"the page shows {shown} ({said}), not {want}; errors: {self.errors}") from None

    def cell(self, selector: str, column: int) -> str:
        return str(self.page.locator(selector).locator("td").nth(column).inner_text())


def _status(store: str) -> dict[str, dict[str, int]]:
    """``status --json``'s figures of each model."""
    return {
        row["model"]: {field: row[field] for field in FIELDS} for row in cli_json("status", "--json", "--store", store)
    }


def test_the_page_shows_the_ledgers_figures_and_follows_calls_that_settle(
    browser: Any, sim: ArkSimulator, store_url: str, tmp_path: Path
) -> None:
    env = {"SIM_URL": sim.url}
    run = ["--store", store_url, "--base-url", sim.url]
    settled = run_quotawrap([*run, "--tag", "user=alice", "--tag", "team=infra"], child("one_call.py"), env=env)
    assert "TOTAL" in settled.stdout, settled.stderr
    refused = run_quotawrap([*run, "--cap-tokens", "10"], child("one_call.py"), env=env)
    assert "BLOCKED" in refused.stdout, refused.stderr
    release = tmp_path / "release"
    held = start_cli(*run, "--", *child("held_stream.py"), env={**env, "RELEASE_FILE": str(release)})
    try:
        _line(held, "STREAMING")
        with _dashboard("--store", store_url) as served:
            tab = _Page(browser, served.url)
            status = _status(store_url)
            assert status[MODEL]["in_flight"] > 0 and status[MODEL]["usage"] > 0 and status[MODEL]["refused"] == 1
            for model, figures in status.items():
                assert tab.shown(model) == figures

            by_user = cli_json("report", "--by", "tag:user", "--format", "json", "--store", store_url)["rows"]
            alice = next(row for row in by_user if row["key"] == "alice")
            assert tab.cell('table[data-tag="user"] tr[data-tag-value="alice"]', 2) == f"{alice['settled_tokens']:,}"
            sessions = cli_json("sessions", "--json", "--store", store_url)
            shown = tab.page.eval_on_selector_all(
                "#sessions tr[data-session]", "rows => rows.map(r => r.dataset.session)"
            )
            assert sorted(shown) == sorted(row["session"] for row in sessions)

            again = run_quotawrap([*run, "--tag", "user=bob"], child("one_call.py"), env=env)
            assert "TOTAL" in again.stdout, again.stderr
            after = _status(store_url)
            assert after[MODEL]["usage"] > status[MODEL]["usage"]
            tab.wait_until_shown(MODEL, after[MODEL])

            release.touch()
            out, err = held.communicate(timeout=120)
            assert held.returncode == 0 and "DONE" in out, err
            final = _status(store_url)
            assert final[MODEL]["in_flight"] == 0 and final[MODEL]["usage"] > after[MODEL]["usage"]
            tab.wait_until_shown(MODEL, final[MODEL])
            assert tab.errors == []
    finally:
        release.touch()
        if held.poll() is None:
            held.kill()
            held.communicate()


def test_the_gateway_serves_the_page_and_forwards_nothing_under_its_own_prefix(
    browser: Any, sim: ArkSimulator, store: str
) -> None:
    gateway = GatewayProcess(["--store", store, "--base-url", sim.url])
    try:
        tab = _Page(browser, gateway.url + "/_quotawrap/dashboard/")
        assert tab.page.locator("article.model").count() == 0  # nothing guarded yet
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}).encode()
        call = urllib.request.Request(
            gateway.url + "/chat/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": "Bearer sk-test"},
        )
        with urllib.request.urlopen(call, timeout=60) as answer:
            assert answer.status == 200
        status = _status(store)
        assert status[MODEL]["usage"] > 0
        tab.wait_until_shown(MODEL, status[MODEL])

        with urllib.request.urlopen(gateway.url + "/_quotawrap/dashboard", timeout=30) as answer:  # redirected
            assert answer.url.endswith("/_quotawrap/dashboard/") and b"dashboard.js" in answer.read()
        for path in ("/_quotawrap/metrics-of-nobody", "/_quotawrap/dashboard/../../v1/models"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(gateway.url + path, timeout=30)
            assert refused.value.code == 404
        assert not any("_quotawrap" in path for path in sim.requests_by_path())
        assert tab.errors == []
    finally:
        gateway.stop()


def test_it_binds_loopback_and_warns_once_when_told_otherwise(store: str) -> None:
    with _dashboard("--store", store) as served:
        assert served.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(served.url + "data.json", timeout=30) as answer:
            data = json.loads(answer.read())
        assert data["models"] == [] and data["store"].startswith("sqlite:")
        rebound = urllib.request.Request(served.url + "data.json", headers={"Host": "attacker.example"})
        with pytest.raises(urllib.error.HTTPError) as elsewhere:  # a page of another site, by DNS rebinding
            urllib.request.urlopen(rebound, timeout=30)
        assert elsewhere.value.code == 403
        taken = served.url.rsplit(":", 1)[1].strip("/")
        busy = run_cli("dashboard", "--store", store, "--port", taken)
        assert busy.returncode == 2
        assert busy.stderr.count("\n") == 1 and "cannot listen" in busy.stderr and "--port" in busy.stderr
    assert served.stderr == ""
    with _dashboard("--store", store, "--host", "0.0.0.0") as served:
        assert served.url.startswith("http://0.0.0.0:")
    lines = served.stderr.splitlines()
    assert len(lines) == 1 and "not loopback" in lines[0]


# Budgets of every kind: a hard one in tokens, a soft one, and one in CNY; the run's tag matches all three.
BUDGETS = ("team=infra:200k/day", "*:100k/week,soft", "team=infra:cny5/month")
_BUDGET_ROWS = """() => Object.fromEntries([...document.querySelectorAll("#budgets tr[data-budget]")].map(
  (row) => [row.dataset.budget, [...row.querySelectorAll("td")].map((cell) => cell.innerText)]))"""


def _budget_cells(budgets: list[dict[str, Any]]) -> dict[str, list[str]]:
    """What the page's budget rows should say, from `status --json`'s budgets: name, the bar (no text), used, in
    flight, left, limit (tokens, or CNY from micro-CNY) and the reset in Beijing time."""
    from datetime import datetime

    from quotawrap.core.quota import BEIJING

    def amount(value: int, unit: str) -> str:
        return f"¥{value / 1e6:.6f}" if unit == "cny" else f"{value:,} tokens"

    return {
        b["name"]: [
            b["name"],
            "",
            *(amount(b[field], b["unit"]) for field in ("used", "in_flight", "left", "limit")),
            datetime.fromtimestamp(b["resets_at"], BEIJING).strftime("%m-%d %H:%M"),
        ]
        for b in budgets
    }


def _status_budgets(store: str) -> list[dict[str, Any]]:
    """``status --json``'s budgets (every model row carries the same list)."""
    rows = cli_json("status", "--json", "--store", store)
    assert rows and all(row["budgets"] == rows[0]["budgets"] for row in rows)
    return list(rows[0]["budgets"])


def _budget_remaining(url: str) -> dict[tuple[str, str], float]:
    """``quotawrap_budget_remaining`` of a scrape of the dashboard's ``/metrics``, by (budget, unit)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {
        (sample.labels["budget"], sample.labels["unit"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "quotawrap_budget_remaining"
    }


def _wait_until_budgets_shown(tab: _Page, want: dict[str, list[str]]) -> None:
    from playwright.sync_api import TimeoutError as Timeout

    try:
        tab.page.wait_for_function(f"(want) => JSON.stringify(({_BUDGET_ROWS})()) === JSON.stringify(want)", arg=want)
    except Timeout:
        shown = tab.page.evaluate(_BUDGET_ROWS)
        raise AssertionError(f"the page shows {shown}, not {want}; errors: {tab.errors}") from None


def test_budgets_set_on_the_ledger_show_as_status_and_metrics_say(
    browser: Any, sim: ArkSimulator, store_url: str, tmp_path: Path
) -> None:
    """Budgets set with `quotawrap budget set`, spent by a guarded run and held by a stream in flight: the page's
    rows show `status --json`'s used, in flight, left, limit and reset, `/metrics` says each one's left, and both
    follow the stream when it settles."""
    env = {"SIM_URL": sim.url}
    # cut: a call that sets max_tokens reserves it, not the model's reasoning ceiling besides (over the budgets)
    run = ["--store", store_url, "--base-url", sim.url, "--tag", "team=infra", "--reasoning-reserve", "cut"]
    with _dashboard("--store", store_url) as served:
        tab = _Page(browser, served.url)
        assert tab.page.locator("#budgets-section").is_hidden()  # no budget yet
        for spec in BUDGETS:
            done = run_cli("budget", "set", spec, "--store", store_url)
            assert done.returncode == 0, done.stderr
        settled = run_quotawrap(run, child("one_call.py"), env=env)
        assert "TOTAL" in settled.stdout, settled.stderr
        release = tmp_path / "release"
        held = start_cli(*run, "--", *child("held_stream.py"), env={**env, "RELEASE_FILE": str(release)})
        try:
            _line(held, "STREAMING")
            during = _status_budgets(store_url)
            assert len(during) == len(BUDGETS)
            assert all(b["used"] > 0 and b["in_flight"] > 0 and b["left"] < b["limit"] for b in during), during
            _wait_until_budgets_shown(tab, _budget_cells(during))
            assert tab.page.locator("#budgets-section").is_visible()
            assert _budget_remaining(served.url) == {(b["name"], b["unit"]): b["left"] for b in during}

            release.touch()
            out, err = held.communicate(timeout=120)
            assert held.returncode == 0 and "DONE" in out, err
        finally:
            release.touch()
            if held.poll() is None:
                held.kill()
                held.communicate()
        after = _status_budgets(store_url)
        for before, now in zip(during, after, strict=True):
            assert now["name"] == before["name"] and now["in_flight"] == 0 and now["used"] > before["used"]
        _wait_until_budgets_shown(tab, _budget_cells(after))
        assert _budget_remaining(served.url) == {(b["name"], b["unit"]): b["left"] for b in after}
        assert tab.errors == []


@pytest.mark.redis
def test_the_page_says_when_the_store_is_down_and_recovers_by_itself(browser: Any, sim: ArkSimulator) -> None:
    """A Redis server that stops and comes back: the page says so, then shows the ledger again, unreloaded."""
    with private_server(appendonly=True) as server:
        run = ["--store", server.url, "--base-url", sim.url]
        done = run_quotawrap(run, child("one_call.py"), env={"SIM_URL": sim.url})
        assert "TOTAL" in done.stdout, done.stderr
        with _dashboard("--store", server.url) as served:
            tab = _Page(browser, served.url)
            status = _status(server.url)
            tab.wait_until_shown(MODEL, status[MODEL])
            server.stop()
            tab.page.wait_for_selector("#freshness[data-state=error]", timeout=60_000)
            assert "did not answer" in tab.page.inner_text("#freshness")
            server.start()
            tab.page.wait_for_selector("#freshness[data-state=ok]", timeout=60_000)
            tab.wait_until_shown(MODEL, status[MODEL])
        assert "Traceback" not in served.stderr
    # the 503s while the store was down are the only console errors
    assert tab.errors and all("503" in error for error in tab.errors)


def test_a_call_waiting_for_room_shows_while_it_waits(
    browser: Any, sim: ArkSimulator, store_url: str, tmp_path: Path
) -> None:
    """A call that does not fit only because of a stream in flight waits in the ledger's line: the page counts it
    as `status --json` does while it waits, and drops it once the stream settles and the call goes or is refused."""
    env = {"SIM_URL": sim.url}
    run = ["--store", store_url, "--base-url", sim.url]
    release = tmp_path / "release"
    held = start_cli(*run, "--", *child("held_stream.py"), env={**env, "RELEASE_FILE": str(release)})
    waiter: subprocess.Popen[str] | None = None
    try:
        _line(held, "STREAMING")
        before = _status(store_url)[MODEL]
        room = before["usage"] + before["in_flight"]  # the stream's hold fills the day's cap: the next call waits
        waiter = start_cli(*run, "--daily-cap", str(room), "--", *child("one_call.py"), env=env)
        with _dashboard("--store", store_url) as served:
            tab = _Page(browser, served.url)
            tab.wait_until_shown(MODEL, {"waiting": 1})
            assert _status(store_url)[MODEL]["waiting"] == 1
            calls = tab.page.locator(f'#calls tr[data-model="{MODEL}"] td').all_inner_texts()
            assert calls[1] == "1"
            release.touch()
            out, err = waiter.communicate(timeout=120)
            assert "TOTAL" in out or "BLOCKED" in out, err
            held.communicate(timeout=120)
            after = _status(store_url)[MODEL]
            assert after["waiting"] == 0 and after["in_flight"] == 0
            tab.wait_until_shown(MODEL, after)
            assert tab.errors == []
    finally:
        release.touch()
        for proc in (held, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
