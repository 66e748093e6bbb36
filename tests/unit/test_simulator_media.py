"""The simulator's images, context create, video tasks, batch and bots: Ark's shapes and an honest bill."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from quotawrap.simulator import ArkSimulator, SimConfig
from tests.unit.conftest import FakeClock

AUTH = {"Authorization": "Bearer sim-key"}
TASKS = "/contents/generations/tasks"
VIDEO = "doubao-seedance-1-0-pro-250528"
IMAGE = "doubao-seedream-4-0-250828"
CHAT = "doubao-seed-1-6-250615"


@pytest.fixture
def sim(clock: FakeClock) -> Iterator[ArkSimulator]:
    with ArkSimulator(SimConfig(task_s=30), clock=clock) as running:
        yield running


@pytest.fixture
def client(sim: ArkSimulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.url, headers=AUTH, timeout=10) as http:
        yield http


def create_task(client: httpx.Client, text: str = "a kite --rs 480p --dur 5") -> str:
    response = client.post(TASKS, json={"model": VIDEO, "content": [{"type": "text", "text": text}]})
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


class TestImages:
    def test_each_image_bills_width_times_height_over_256(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """A 1024x1024 image: usage generated_images 1, 4096 output tokens, billed exactly that."""
        answer = client.post("/images/generations", json={"model": IMAGE, "prompt": "kite", "size": "1024x1024"}).json()
        assert answer["usage"] == {"generated_images": 1, "output_tokens": 4096, "total_tokens": 4096}
        assert answer["data"][0]["size"] == "1024x1024"
        assert sim.billed_total() == 4096

    def test_sequential_generation_makes_max_images(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """sequential_image_generation auto with max_images 3 makes (and bills) three 2K images."""
        body = {
            "model": IMAGE,
            "prompt": "kites",
            "size": "2K",
            "sequential_image_generation": "auto",
            "sequential_image_generation_options": {"max_images": 3},
        }
        answer = client.post("/images/generations", json=body).json()
        assert answer["usage"]["generated_images"] == 3 == len(answer["data"])
        assert sim.billed_total() == 3 * 2048 * 2048 // 256

    def test_a_stream_ends_with_the_usage_and_done(self, client: httpx.Client) -> None:
        """Streamed images: one partial_succeeded per image, then completed with usage, then [DONE]."""
        response = client.post("/images/generations", json={"model": IMAGE, "prompt": "kite", "stream": True})
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        completed = json.loads(events[-2])
        assert completed["type"] == "image_generation.completed"
        assert completed["usage"]["generated_images"] == 1
        assert json.loads(events[0])["type"] == "image_generation.partial_succeeded"

    def test_a_bad_size_is_a_400_and_never_billed(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """An unreadable size is refused before anything is generated."""
        response = client.post("/images/generations", json={"model": IMAGE, "prompt": "kite", "size": "huge"})
        assert response.status_code == 400
        assert sim.billed_total() == 0


class TestContextCreate:
    def test_bills_the_prompt_and_echoes_the_context(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """context/create answers id, mode and ttl, with usage of the prompt alone."""
        body = {"model": CHAT, "messages": [{"role": "system", "content": "You know kites."}], "ttl": 3600}
        answer = client.post("/context/create", json=body).json()
        assert answer["id"].startswith("ctx-") and answer["mode"] == "session" and answer["ttl"] == 3600
        assert answer["usage"]["completion_tokens"] == 0
        assert sim.billed_total() == answer["usage"]["total_tokens"] > 0


class TestVideoTasks:
    def test_a_task_bills_nothing_until_it_finishes(
        self, sim: ArkSimulator, client: httpx.Client, clock: FakeClock
    ) -> None:
        """Created: only an id; running: no usage; after task_s: succeeded, usage, and billed once."""
        task = create_task(client)
        assert sim.billed_total() == 0
        clock.now += 10
        running = client.get(f"{TASKS}/{task}").json()
        assert running["status"] == "running" and "usage" not in running
        clock.now += 20
        done = client.get(f"{TASKS}/{task}").json()
        assert done["status"] == "succeeded"
        assert done["usage"] == {"completion_tokens": 864 * 480 * 24 * 5 // 1024, "total_tokens": 48600}
        client.get(f"{TASKS}/{task}")
        assert sim.billed_total() == 48600

    def test_an_unwatched_task_is_billed_all_the_same(
        self, sim: ArkSimulator, client: httpx.Client, clock: FakeClock
    ) -> None:
        """The provider bills a finished video whether or not anyone polls it."""
        create_task(client)
        clock.now += 31
        assert sim.billed_total() == 48600
        assert sim.bills()[0].t == clock.now - 1

    def test_the_list_shows_every_task(self, client: httpx.Client, clock: FakeClock) -> None:
        """GET of the task list gives total and items, newest first, with usage once succeeded."""
        first = create_task(client)
        clock.now += 31
        second = create_task(client)
        listing = client.get(TASKS).json()
        assert listing["total"] == 2
        assert [item["id"] for item in listing["items"]] == [second, first]
        assert "usage" in listing["items"][1] and "usage" not in listing["items"][0]

    def test_a_cancelled_task_is_never_billed(self, sim: ArkSimulator, client: httpx.Client, clock: FakeClock) -> None:
        """DELETE before the task ends cancels it: it never succeeds and bills nothing."""
        task = create_task(client)
        assert client.delete(f"{TASKS}/{task}").json()["status"] == "cancelled"
        clock.now += 60
        assert client.get(f"{TASKS}/{task}").json()["status"] == "cancelled"
        assert sim.billed_total() == 0

    def test_an_unknown_task_is_a_404(self, client: httpx.Client) -> None:
        """Ark answers a task id it does not know with 404."""
        assert client.get(f"{TASKS}/cgt-nope").status_code == 404

    @pytest.mark.parametrize("text", ["x --rs 8k", "x --dur 99", "x --rt 5:4"])
    def test_unsupported_settings_are_a_400(self, client: httpx.Client, text: str) -> None:
        """Resolutions, ratios and durations Seedance does not offer are refused at create."""
        response = client.post(TASKS, json={"model": VIDEO, "content": [{"type": "text", "text": text}]})
        assert response.status_code == 400


class TestBatchAndBots:
    def test_batch_chat_answers_and_bills_like_chat(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """/batch/chat/completions has chat's shape and bill."""
        answer = client.post(
            "/batch/chat/completions", json={"model": CHAT, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert answer.json()["object"] == "chat.completion"
        assert sim.billed_total() == answer.json()["usage"]["total_tokens"]

    def test_bots_report_model_and_plugin_usage(self, sim: ArkSimulator, client: httpx.Client) -> None:
        """bot_usage lists the model call and bot_searches web_search calls."""
        sim.configure(bot_searches=2)
        answer = client.post(
            "/bots/chat/completions", json={"model": "bot-1", "messages": [{"role": "user", "content": "hi"}]}
        )
        bot_usage = answer.json()["bot_usage"]
        assert bot_usage["action_usage"] == [{"name": "web_search", "search_count": 2}]
        assert bot_usage["model_usage"][0]["total_tokens"] == answer.json()["usage"]["total_tokens"]


class TestRedirectAndAuth:
    def test_redirect_mode_answers_307_to_the_same_path_and_bills_nothing(
        self, sim: ArkSimulator, client: httpx.Client
    ) -> None:
        """With redirect_to set, an inference POST gets a 307 to that base URL plus its path."""
        sim.configure(redirect_to="http://elsewhere.invalid/api/v3")
        response = client.post("/chat/completions", json={"model": CHAT, "messages": []})
        assert response.status_code == 307
        assert response.headers["location"] == "http://elsewhere.invalid/api/v3/chat/completions"
        assert sim.billed_total() == 0

    def test_require_auth_off_serves_without_a_key(self, sim: ArkSimulator) -> None:
        """A redirect target may serve requests whose key the client dropped on the way."""
        body = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(sim.url + "/chat/completions", json=body).status_code == 401
        sim.configure(require_auth=False)
        assert httpx.post(sim.url + "/chat/completions", json=body).status_code == 200

    def test_api_keys_accepts_only_the_keys_given_and_no_request_chooses_them(self, sim: ArkSimulator) -> None:
        """Another key gets Ark's 401 for a bad key, unbilled; an x-sim-api-keys header is refused."""
        from quotawrap.simulator._contract import RULES

        body = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}]}
        sim.configure(api_keys=["ark-right"])
        wrong = httpx.post(sim.url + "/chat/completions", json=body, headers={"authorization": "Bearer ark-wrong"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["message"].startswith(RULES["auth_missing"].message)
        right = httpx.post(sim.url + "/chat/completions", json=body, headers={"authorization": "Bearer ark-right"})
        assert right.status_code == 200
        chosen = httpx.post(
            sim.url + "/chat/completions",
            json=body,
            headers={"authorization": "Bearer ark-right", "x-sim-api-keys": "ark-wrong"},
        )
        assert chosen.status_code == 400 and "x-sim-api-keys" in chosen.text
        assert sim.calls() == 1
