"""Guard.begin for what is not plain chat: unknown paths, redirects, task holds, retried refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.ledger import open_ledger

ARK = "https://ark.cn-beijing.volces.com/api/v3"
CHAT = json.dumps({"model": "doubao-seed-1-6-250615", "messages": [{"role": "user", "content": "hi"}]}).encode()
AUTH = {"authorization": "Bearer k"}


_made: list[Guard] = []


def guard(tmp_path: Path, **settings: object) -> Guard:
    store = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    made = Guard(Settings(store=store, run_id="r", **settings), open_ledger(store))  # type: ignore[arg-type]
    _made.append(made)
    return made


@pytest.fixture(autouse=True)
def _close_the_guards() -> Iterator[None]:
    """A guard that answered retries from memory says how many when closed, not at the runner's exit."""
    yield
    while _made:
        _made.pop().retries.close()


def states(g: Guard) -> list[tuple[str, str]]:
    return sorted((record.id, record.state) for record in g.ledger.call_records(run_id="r"))


class TestUnknownPaths:
    def test_refused_with_403_naming_the_cure(self, tmp_path: Path) -> None:
        """An unknown POST gets a 403 that names the path and --allow-path; nothing is recorded."""
        g = guard(tmp_path)
        call = g.begin("POST", ARK + "/audio/speech", AUTH, b"{}")
        assert call is not None and call.blocked is not None and call.blocked.status == 403
        assert b"--allow-path /api/v3/audio/speech" in call.blocked.body
        assert states(g) == []

    def test_watch_sends_it_with_a_warning(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """--watch blocks nothing: the POST goes out, and stderr says it was not guarded."""
        assert guard(tmp_path, watch=True).begin("POST", ARK + "/audio/speech", AUTH, b"{}") is None
        assert "sent UNGUARDED POST /api/v3/audio/speech" in capsys.readouterr().err


class TestRedirects:
    def test_the_hop_is_released_and_the_next_one_guarded(self, tmp_path: Path) -> None:
        """A 307 releases the hop's hold; the client's re-sent POST to the Location is guarded too."""
        g = guard(tmp_path)
        target = "http://elsewhere.example:8080/v3/chat/completions"
        assert not g.wants("POST", target)
        call = g.begin("POST", ARK + "/chat/completions", AUTH, CHAT)
        assert call is not None and call.hold_id is not None
        call.response_started(307, {"location": target})
        call.finish()
        assert states(g) == [(call.hold_id, "released")]
        assert g.wants("POST", target)
        follow = g.begin("POST", target, AUTH, CHAT)
        assert follow is not None and follow.hold_id is not None and follow.blocked is None

    def test_a_303_turning_into_a_get_is_not_guarded(self, tmp_path: Path) -> None:
        """A client that follows with a GET sends nothing billable: it passes."""
        g = guard(tmp_path)
        call = g.begin("POST", ARK + "/chat/completions", AUTH, CHAT)
        assert call is not None
        call.response_started(303, {"location": "http://elsewhere.example/done"})
        call.finish()
        assert not g.wants("GET", "http://elsewhere.example/done")


class TestVideoTasks:
    BODY = json.dumps(
        {"model": "doubao-seedance-1-0-pro-250528", "content": [{"type": "text", "text": "x --rs 480p --dur 5"}]}
    ).encode()

    def create(self, g: Guard, answer: bytes, status: int = 200) -> str:
        call = g.begin("POST", ARK + "/contents/generations/tasks", AUTH, self.BODY)
        assert call is not None and call.hold_id is not None
        call.response_started(status, {"content-type": "application/json"})
        call.feed(answer)
        call.finish()
        return call.hold_id

    def poll(self, g: Guard, task: dict[str, object]) -> None:
        call = g.begin("GET", ARK + f"/contents/generations/tasks/{task['id']}", AUTH, None)
        assert call is not None and call.blocked is None and call.hold_id is None
        call.response_started(200, {"content-type": "application/json"})
        call.feed(json.dumps(task).encode())
        call.finish()

    def test_the_hold_moves_to_the_task_and_a_poll_settles_it(self, tmp_path: Path) -> None:
        """Create: the hold becomes task-<id> (long validity); running polls leave it; succeeded settles it."""
        g = guard(tmp_path, task_hold_ttl=7200.0)
        created = self.create(g, b'{"id": "cgt-1"}')
        assert states(g) == sorted([(created, "released"), ("task-cgt-1", "held")])
        (record,) = [r for r in g.ledger.call_records(run_id="r") if r.id == "task-cgt-1"]
        assert record.endpoint == "video_task" and record.reserved > 48_600
        self.poll(g, {"id": "cgt-1", "status": "running", "model": "doubao-seedance-1-0-pro-250528"})
        assert ("task-cgt-1", "held") in states(g)
        usage = {"completion_tokens": 48_600, "total_tokens": 48_600}
        self.poll(g, {"id": "cgt-1", "status": "succeeded", "model": "doubao-seedance-1-0-pro-250528", "usage": usage})
        (record,) = [r for r in g.ledger.call_records(run_id="r") if r.id == "task-cgt-1"]
        assert (record.state, record.charged, record.charged_cost) == ("settled", 48_600, 729_000)

    def test_an_implausible_task_usage_charges_the_hold_and_says_why(self, tmp_path: Path) -> None:
        """A succeeded task reporting a usage that cannot be true: charged its whole hold now, the record says
        why; a later poll with a believable usage corrects it."""
        g = guard(tmp_path)
        self.create(g, b'{"id": "cgt-5"}')
        absurd = {"completion_tokens": 2**63, "total_tokens": 2**63}
        self.poll(g, {"id": "cgt-5", "status": "succeeded", "model": "doubao-seedance-1-0-pro-250528", "usage": absurd})
        (record,) = [r for r in g.ledger.call_records(run_id="r") if r.id == "task-cgt-5"]
        assert (record.state, record.charged) == ("unresolved", record.reserved)
        assert record.usage_anomaly == f"completion_tokens {2**63} is not a plausible token count"
        assert g.ledger.run_totals("r").totals.anomalous_calls == 1
        usage = {"completion_tokens": 1000, "total_tokens": 1000}
        self.poll(g, {"id": "cgt-5", "status": "succeeded", "model": "doubao-seedance-1-0-pro-250528", "usage": usage})
        (record,) = [r for r in g.ledger.call_records(run_id="r") if r.id == "task-cgt-5"]
        assert (record.state, record.charged, record.usage_anomaly) == ("settled", 1000, None)
        assert g.ledger.run_totals("r").totals.anomalous_calls == 0

    def test_status_lists_the_open_task(self, tmp_path: Path) -> None:
        """`quotawrap status` shows each task still held under its model, JSON and text."""
        from quotawrap.books.status import model_status, render_status

        g = guard(tmp_path)
        self.create(g, b'{"id": "cgt-9"}')
        rows = model_status(g.ledger, g.settings, g.clock())
        (row,) = [row for row in rows if row["model"] == "doubao-seedance-1-0-pro-250528"]
        assert [task["task_id"] for task in row["open_video_tasks"]] == ["cgt-9"]
        assert "video task cgt-9 holds" in render_status(rows)

    def test_a_failed_task_frees_its_hold(self, tmp_path: Path) -> None:
        """A task that failed or was cancelled bills nothing: the poll releases its hold."""
        g = guard(tmp_path)
        self.create(g, b'{"id": "cgt-2"}')
        self.poll(g, {"id": "cgt-2", "status": "failed"})
        assert ("task-cgt-2", "released") in states(g)

    def test_the_task_list_settles_every_task_it_shows(self, tmp_path: Path) -> None:
        """A GET of the task list settles each listed task that has ended."""
        g = guard(tmp_path)
        self.create(g, b'{"id": "cgt-3"}')
        self.create(g, b'{"id": "cgt-4"}')
        usage = {"completion_tokens": 1000, "total_tokens": 1000}
        listing = {
            "total": 2,
            "items": [
                {"id": "cgt-3", "status": "succeeded", "model": "doubao-seedance-1-0-pro-250528", "usage": usage},
                {"id": "cgt-4", "status": "running", "model": "doubao-seedance-1-0-pro-250528"},
            ],
        }
        call = g.begin("GET", ARK + "/contents/generations/tasks?page_size=10", AUTH, None)
        assert call is not None
        call.response_started(200, {"content-type": "application/json"})
        call.feed(json.dumps(listing).encode())
        call.finish()
        found = dict(states(g))
        assert (found["task-cgt-3"], found["task-cgt-4"]) == ("settled", "held")

    def test_a_refused_create_is_released_as_any_error(self, tmp_path: Path) -> None:
        """A 4xx create made no task: its hold is released and no task hold appears."""
        g = guard(tmp_path)
        created = self.create(g, b'{"error": {"code": "InvalidParameter"}}', status=400)
        assert states(g) == [(created, "released")]


class TestRetriedRefusals:
    def test_an_identical_retry_is_answered_from_memory(self, tmp_path: Path) -> None:
        """The same refused request again: the same answer with a retry count, and no second ledger row."""
        g = guard(tmp_path, cap_tokens=10)
        first = g.begin("POST", ARK + "/chat/completions", AUTH, CHAT)
        again = g.begin("POST", ARK + "/chat/completions", AUTH, CHAT)
        assert first is not None and again is not None and first.blocked and again.blocked
        assert again.blocked.body == first.blocked.body
        assert ("x-quotawrap-retries", "1") in again.blocked.headers
        assert [state for _, state in states(g)] == ["blocked"]

    def test_a_different_request_is_checked_afresh(self, tmp_path: Path) -> None:
        """Another body is another call: it gets its own check and its own row."""
        g = guard(tmp_path, cap_tokens=10)
        g.begin("POST", ARK + "/chat/completions", AUTH, CHAT)
        g.begin("POST", ARK + "/chat/completions", AUTH, CHAT.replace(b"hi", b"ho"))
        assert [state for _, state in states(g)] == ["blocked", "blocked"]

    def test_batch_refusals_are_403(self, tmp_path: Path) -> None:
        """The batch client retries every 429 but no 403: batch refusals are 403s."""
        g = guard(tmp_path, cap_tokens=10)
        call = g.begin("POST", ARK + "/batch/chat/completions", AUTH, CHAT)
        assert call is not None and call.blocked is not None and call.blocked.status == 403
        assert ("retry-after", "0") not in call.blocked.headers
