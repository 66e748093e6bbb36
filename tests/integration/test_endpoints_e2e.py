"""Ark's endpoints beyond chat, redirects and retrying clients: the real CLI, real SDKs, the simulator."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from quotawrap.ledger import open_ledger
from quotawrap.simulator import ArkSimulator, SimConfig, serve
from tests.conftest import child, cli_json, ledger_rows, run_quotawrap
from tests.redis_server import session_url


def _steps(stdout: str) -> dict[str, dict[str, Any]]:
    return {line["step"]: line for line in (json.loads(raw) for raw in stdout.splitlines() if raw.startswith("{"))}


def _run(sim: ArkSimulator, store: str, tmp_path: Path, cap: int, *args: str, extra: tuple[str, ...] = ()) -> Any:
    report = tmp_path / "report.json"
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url, "--cap-tokens", str(cap), "--report-json", str(report), *extra],
        child("endpoints_agent.py", *args),
        env={"SIM_URL": sim.url},
    )
    assert result.returncode == 0, result.stderr
    return result, _steps(result.stdout), json.loads(report.read_text())["totals"]


class TestEveryEndpointUnderACap:
    def test_images_video_context_batch_bots_settle_at_the_bill(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """One agent: images (plain, streamed), a polled video task, context, batch, bots; settled is the bill."""
        sim.configure(task_s=0.3, bot_searches=2)
        cap = 90_000
        _, steps, totals = _run(sim, store, tmp_path, cap)
        assert [steps[name]["outcome"] for name in ("images", "video", "context", "batch", "bot")] == ["ok"] * 5
        assert steps["video"]["status"] == "succeeded"
        assert steps["images"]["images"] == 3  # one plain, two streamed
        assert sim.billed_total() <= cap
        assert totals["settled_tokens"] == sim.billed_total()
        assert totals["unresolved_calls"] == 0
        by_endpoint = dict(ledger_rows(store, "SELECT endpoint, SUM(charged) FROM calls GROUP BY endpoint"))
        assert by_endpoint["images"] == steps["images"]["tokens"]
        assert by_endpoint["video_task"] == steps["video"]["tokens"]
        assert by_endpoint["context"] == steps["context"]["tokens"]
        assert by_endpoint["context_chat"] == steps["context"]["chat_tokens"] > steps["context"]["tokens"]
        assert totals["overshoot_calls"] == 0  # the context chat reserved the cached context it reads
        assert by_endpoint["batch_chat"] == steps["batch"]["tokens"]
        assert by_endpoint["bot_chat"] == steps["bot"]["tokens"]

    def test_on_redis_too(self, sim: ArkSimulator, tmp_path: Path) -> None:
        """The same agent on the Redis ledger: the task's hold is handed over and settled; settled is the bill."""
        sim.configure(task_s=0.3, bot_searches=1)
        with session_url() as redis_url:
            _, steps, totals = _run(sim, redis_url, tmp_path, 90_000)
        assert steps["video"]["status"] == "succeeded"
        assert sim.billed_total() <= 90_000
        assert totals["settled_tokens"] == sim.billed_total()
        assert totals["unresolved_calls"] == 0

    def test_unknown_post_is_refused_naming_the_path_and_the_cure(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """A POST to a path quotawrap does not know never leaves: 403 naming it and --allow-path."""
        _, steps, _ = _run(sim, store, tmp_path, 70_000, "unknown")
        assert steps["unknown"]["status"] == 403
        assert "quotawrap refused POST /api/v3/audio/speech" in steps["unknown"]["message"]
        assert "--allow-path /api/v3/audio/speech" in steps["unknown"]["message"]
        assert sim.requests_by_path() == {}

    def test_allow_path_lets_it_through(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """With --allow-path the same POST reaches the provider (here the simulator's own 404)."""
        _, steps, _ = _run(sim, store, tmp_path, 70_000, "unknown", extra=("--allow-path", "/audio/speech"))
        assert steps["unknown"]["status"] == 404
        assert sim.requests_by_path() == {"/api/v3/audio/speech": 1}

    def test_a_video_task_beyond_the_cap_is_refused_at_create(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """The create reserves the whole video (resolution x fps x seconds): over the cap it never starts."""
        cap = 30_000
        _, steps, totals = _run(sim, store, tmp_path, cap, "images", "video", "context")
        assert steps["video"]["outcome"] == "refused"
        assert "would exceed the run_cap" in steps["video"]["message"]
        assert sim.billed_total() <= cap
        assert totals["settled_tokens"] == sim.billed_total()

    def test_a_task_nobody_polls_is_listed_then_charged_its_hold(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """`quotawrap status` lists the open task hold; at run end the wrapper charges the whole hold."""
        sim.configure(task_s=0.1)
        _, steps, totals = _run(sim, store, tmp_path, 70_000, "orphan")
        task = steps["orphan"]["task"]
        listed = [t for row in steps["orphan"]["status"] for t in row["open_video_tasks"]]
        assert [t["task_id"] for t in listed] == [task]
        ((state, reserved, charged),) = ledger_rows(
            store, "SELECT state, reserved, charged FROM calls WHERE id = ?", (f"task-{task}",)
        )
        assert state == "unresolved"
        assert charged == reserved >= sim.billed_total() > 0
        assert totals["unresolved_calls"] == 1


def _report(store: str, *args: str) -> list[dict[str, Any]]:
    """`quotawrap report --format json`'s rows."""
    rows: list[dict[str, Any]] = cli_json("report", "--store", store, "--format", "json", *args)["rows"]
    return rows


class TestAVideoTaskIsOneCall:
    """The create's hold goes on as the task's: the report, the sessions and the run summary count one call."""

    def _check(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        sim.configure(task_s=0.2)
        _, steps, totals = _run(sim, store, tmp_path, 70_000, "video")
        assert steps["video"]["status"] == "succeeded"
        assert (totals["calls"], totals["released_calls"], totals["settled_tokens"]) == (1, 0, sim.billed_total())
        [row] = _report(store)
        assert (row["calls"], row["released_calls"], row["settled_tokens"]) == (1, 0, sim.billed_total())
        [session] = _report(store, "--by", "session")
        assert session["calls"] == 1

    @staticmethod
    def _handed_over(store: str) -> tuple[list[str], list[str]]:
        """(the rows handed over to a task: whom to, the task rows), from the store itself."""
        records = open_ledger(store).call_records()
        handed = sorted(record.handed_to for record in records if record.handed_to is not None)
        return handed, sorted(record.id for record in records if record.id.startswith("task-"))

    def test_on_sqlite(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        self._check(sim, store, tmp_path)
        handed, tasks = self._handed_over(store)
        assert handed == tasks and len(tasks) == 1  # the create's row names the task row that carries its call

    def test_on_redis(self, sim: ArkSimulator, tmp_path: Path) -> None:
        with session_url() as redis_url:
            self._check(sim, redis_url, tmp_path)
            handed, tasks = self._handed_over(redis_url)
            assert handed == tasks and len(tasks) == 1


class TestRedirects:
    def test_a_307_to_an_unguarded_host_is_followed_under_guard(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """openai (httpx) and requests follow a 307 off the --base-url: the second hop is guarded and settled."""
        with serve(config=SimConfig(require_auth=False)) as target:
            sim.configure(redirect_to=target.url.replace("127.0.0.1", "localhost"))
            report = tmp_path / "report.json"
            result = run_quotawrap(
                ["--store", store, "--base-url", sim.url, "--report-json", str(report)],
                child("redirected.py"),
                env={"SIM_URL": sim.url},
            )
            assert result.returncode == 0, result.stderr
            billed = target.billed_total()
        assert billed > 0 and sim.billed_total() == 0
        totals = json.loads(report.read_text())["totals"]
        assert totals["settled_tokens"] == billed
        states = ledger_rows(store, "SELECT state, COUNT(*) FROM calls GROUP BY state ORDER BY state")
        assert states == [("released", 2), ("settled", 2)]  # each redirect hop freed, each answer settled


class TestRetryingClients:
    @pytest.fixture
    def refused(self, sim: ArkSimulator, store: str) -> dict[str, dict[str, Any]]:
        steps = ["batch", "litellm", "openai"]
        # find_spec of a submodule raises when its parent package is missing.
        if importlib.util.find_spec("llama_index") is not None and importlib.util.find_spec("llama_index.llms.openai"):
            steps.append("llamaindex")
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--cap-tokens", "100"],
            child("retry_clients.py", *steps),
            env={"SIM_URL": sim.url},
            timeout=180,
        )
        assert result.returncode == 0, result.stderr
        return _steps(result.stdout)

    def test_every_client_ends_with_quotawrap_s_message(self, refused: dict[str, dict[str, Any]]) -> None:
        """Each caller sees the block message itself, not a timeout or a generic retry error."""
        for step in refused.values():
            assert "quotawrap blocked this request" in step["message"], step
        assert refused["batch"]["error"] == "ArkPermissionDeniedError"
        assert refused["litellm"]["error"] == "RateLimitError"

    def test_clients_that_honour_the_answer_send_once(self, refused: dict[str, dict[str, Any]]) -> None:
        """The Ark batch client (403, which it never retries) and openai (x-should-retry) stop at once."""
        assert refused["batch"]["attempts"] == 1
        assert refused["openai"]["attempts"] == 1

    def test_identical_retries_count_as_one_blocked_call(
        self, sim: ArkSimulator, store: str, refused: dict[str, dict[str, Any]]
    ) -> None:
        """litellm re-sends 3 times (llama-index twice); the ledger holds one blocked row per request."""
        assert refused["litellm"]["attempts"] == 4
        if "llamaindex" in refused:
            assert refused["llamaindex"]["attempts"] == 3
        assert ledger_rows(store, "SELECT COUNT(*) FROM calls") == [(len(refused),)]
        assert ledger_rows(store, "SELECT DISTINCT state FROM calls") == [("blocked",)]
        assert sim.requests_by_path() == {}
