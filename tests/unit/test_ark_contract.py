"""The simulator answers as Ark does: every row of its rule table, sent over HTTP, gets the row's answer.

The rows (quotawrap/simulator/_contract.py) are also what docs/ark-contract.md shows; a test keeps the
two equal. `python -m tests.unit.test_ark_contract` rewrites the document's table from the rows.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from quotawrap.simulator import ArkSimulator, SimConfig, SimConfigError
from quotawrap.simulator._config import THINKING_AUTO_MODELS, apply_headers, apply_patch
from quotawrap.simulator._contract import KNOWN_FAMILIES, RULES, Rule, render_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "ark-contract.md"
BEGIN, END = "<!-- rules:begin (generated from quotawrap/simulator/_contract.py) -->", "<!-- rules:end -->"
AUTH = {"Authorization": "Bearer test-key"}
HELLO = [{"role": "user", "content": "hi"}]
REQUEST_ID = re.compile(r"^02\d{13}[0-9a-f]{38}$")
ENFORCED = [rule for rule in RULES.values() if rule.enforced]
STRICT_ONLY = [rule for rule in ENFORCED if not rule.lenient]
FOUNDATION = "doubao-seed-1-6-250615"
ENDPOINT = "ep-20250601120000-kites"


@pytest.fixture
def sim() -> Iterator[ArkSimulator]:
    with ArkSimulator(SimConfig(endpoints=((ENDPOINT, FOUNDATION),))) as running:
        yield running


def send(sim: ArkSimulator, rule: Rule, headers: dict[str, str] | None = None) -> httpx.Response:
    assert rule.example is not None
    sent = {**(AUTH if rule.with_key else {}), **(headers or {})}
    return httpx.post(sim.url + rule.path, json=rule.example, headers=sent, timeout=10)


def chat(sim: ArkSimulator, **body: Any) -> httpx.Response:
    return httpx.post(sim.url + "/chat/completions", json={"messages": HELLO, **body}, headers=AUTH, timeout=10)


def doc_table() -> str:
    text = DOC.read_text(encoding="utf-8")
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n") + "\n"


class TestEveryRowOverHttp:
    @pytest.mark.parametrize("rule", ENFORCED, ids=[rule.key for rule in ENFORCED])
    def test_the_example_gets_arks_answer(self, sim: ArkSimulator, rule: Rule) -> None:
        """The row's request gets the row's status and Ark's four-field body, message ending in the request id."""
        response = send(sim, rule)
        expected = rule.expected()
        assert response.status_code == rule.status, response.text
        error = response.json()["error"]
        assert set(response.json()) == {"error"} and set(error) == {"code", "message", "param", "type"}
        assert (error["code"], error["param"], error["type"]) == (rule.code, expected.param, rule.type)
        request_id = response.headers["x-request-id"]
        assert REQUEST_ID.match(request_id), request_id
        assert error["message"] == f"{expected.message} Request id: {request_id}"
        assert (sim.calls(), sim.billed_total()) == (0, 0)

    @pytest.mark.parametrize("rule", STRICT_ONLY, ids=[rule.key for rule in STRICT_ONLY])
    def test_lenient_mode_serves_what_strict_refuses(self, sim: ArkSimulator, rule: Rule) -> None:
        """x-sim-strict: false answers the strict-only rows' requests with 200 and bills them."""
        response = send(sim, rule, {"x-sim-strict": "false"})
        assert response.status_code == 200, response.text
        assert sim.calls() == 1

    @pytest.mark.parametrize("rule", [r for r in ENFORCED if r.lenient], ids=lambda rule: rule.key)
    def test_lenient_mode_keeps_what_it_needs(self, sim: ArkSimulator, rule: Rule) -> None:
        """Rows marked lenient answer the same in lenient mode: the simulator cannot plan those requests."""
        response = send(sim, rule, {"x-sim-strict": "false"})
        assert (response.status_code, response.json()["error"]["code"]) == (rule.status, rule.code)


class TestTheTable:
    def test_every_row_says_where_it_comes_from(self) -> None:
        """Each row has a label, a source, and (when enforced) an example; the known-only ones say why."""
        for rule in RULES.values():
            assert rule.label in ("SEEN", "DOC", "inferred"), rule.key
            assert rule.source, rule.key
            assert rule.enforced == (rule.example is not None), rule.key
            assert rule.enforced or rule.note, rule.key

    def test_the_doc_shows_the_table(self) -> None:
        """docs/ark-contract.md has the code's rows (python -m tests.unit.test_ark_contract rewrites it)."""
        assert doc_table() == render_markdown()

    def test_the_issue_rules_are_in_it(self) -> None:
        """The rules asked for: both bounds, max_completion_tokens range, stream_options, thinking, unknown ids."""
        assert {
            "both_bounds",
            "max_completion_tokens_above",
            "max_completion_tokens_below",
            "stream_options_without_stream",
            "thinking_type_unknown",
            "model_unknown",
            "endpoint_unknown",
        } <= {rule.key for rule in ENFORCED}


class TestWhatArkAccepts:
    @pytest.mark.parametrize(
        "body",
        [
            {"max_completion_tokens": 65536},
            {"max_completion_tokens": 0},
            {"max_tokens": 64, "thinking": {"type": "disabled"}},
            {"stream": True, "stream_options": {"include_usage": True}},
            {"stream": False, "stream_options": None},
            {"thinking": {"type": "auto"}},
            {"thinking": {"type": "enabled"}, "reasoning_effort": "max"},
            {"thinking": {"type": "disabled"}, "reasoning_effort": "minimal"},
            {"temperature": 2, "top_p": 0, "presence_penalty": -2, "frequency_penalty": 2},
            {"logprobs": True, "thinking": {"type": "disabled"}},
            {"messages": [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, *HELLO]},
        ],
    )
    def test_valid_requests_are_served(self, sim: ArkSimulator, body: dict[str, Any]) -> None:
        """Requests at the edges of Ark's rules (and two system messages, SEEN accepted) get 200."""
        assert chat(sim, model=FOUNDATION, **body).status_code == 200

    @pytest.mark.parametrize(
        "model",
        ["deepseek-v4-flash", "deepseek-v4-flash-ga-260731", "deepseek-v3-2-251201", "doubao-seed-1-6-flash-250828"],
    )
    def test_price_table_models_are_known(self, sim: ArkSimulator, model: str) -> None:
        """Every family the bundled price table knows is served, with or without its version."""
        assert chat(sim, model=model).status_code == 200

    @pytest.mark.parametrize("model", ["DeepSeek-V4-Flash", " deepseek-v4-flash", "doubao-seed-1.6", "deepseek-v4x"])
    def test_other_spellings_are_unknown(self, sim: ArkSimulator, model: str) -> None:
        """Ark's ids are exact: another case, a space or a dot is a 404, and a family matches only at a dash."""
        response = chat(sim, model=model)
        assert (response.status_code, response.json()["error"]["code"]) == (404, "InvalidEndpointOrModel.NotFound")

    def test_the_simulators_own_catalogue_has_the_test_suites_models(self) -> None:
        """The models the suite and the demo call are served in strict mode."""
        for model in ("deepseek-v4-flash", "doubao-seed-1-6-250615", "doubao-seedream-4-0-250828", "doubao-embedding"):
            assert any(model == family or model.startswith(family + "-") for family in KNOWN_FAMILIES), model

    def test_extra_models_are_served(self, sim: ArkSimulator) -> None:
        """`models` (--model) adds ids to the catalogue, each also as a family."""
        assert chat(sim, model="house-model").status_code == 404
        sim.configure(models=["house-model"])
        assert chat(sim, model="house-model").status_code == 200
        assert chat(sim, model="house-model-260101").status_code == 200

    def test_bot_ids_on_the_bots_path_only(self, sim: ArkSimulator) -> None:
        """bot-* ids are served on /bots/chat/completions, and are unknown models on plain chat."""
        body = {"model": "bot-20250101-kites", "messages": HELLO}
        assert httpx.post(sim.url + "/bots/chat/completions", json=body, headers=AUTH).status_code == 200
        assert chat(sim, model="bot-20250101-kites").status_code == 404

    def test_thinking_auto_models_are_configurable(self, sim: ArkSimulator) -> None:
        """Which models take thinking auto is a setting: by default the documented and seen ones."""
        assert FOUNDATION in THINKING_AUTO_MODELS
        assert chat(sim, model="deepseek-v4-flash", thinking={"type": "auto"}).status_code == 400
        sim.configure(thinking_auto_models=["deepseek-v4"])
        assert chat(sim, model="deepseek-v4-flash", thinking={"type": "auto"}).status_code == 200
        assert chat(sim, model=FOUNDATION, thinking={"type": "auto"}).status_code == 400

    def test_responses_refuse_unknown_models_and_thinking_types(self, sim: ArkSimulator) -> None:
        """The Responses API shares the model catalogue and the thinking rule."""
        url = sim.url + "/responses"
        assert httpx.post(url, json={"model": "gpt-5", "input": "hi"}, headers=AUTH).status_code == 404
        odd = {"model": FOUNDATION, "input": "hi", "thinking": {"type": "adaptive"}}
        assert (
            httpx.post(url, json=odd, headers=AUTH)
            .json()["error"]["message"]
            .startswith("Unsupported thinking type for the current model: adaptive")
        )


class TestEndpointIds:
    def test_an_endpoint_answers_and_bills_as_its_foundation_model(self, sim: ArkSimulator) -> None:
        """A call by endpoint id answers `model` "<name>-<version>" and is billed under that model."""
        answer = chat(sim, model=ENDPOINT).json()
        assert answer["model"] == FOUNDATION
        assert sim.billed_by_model() == {FOUNDATION: answer["usage"]["total_tokens"]}
        assert httpx.get(sim.base_url + "/_sim/stats").json()["billed_by_model"] == sim.billed_by_model()

    def test_a_streamed_endpoint_call_names_the_model_in_every_chunk(self, sim: ArkSimulator) -> None:
        """Every chunk of a stream by endpoint id names the foundation model, as Ark's captured streams do."""
        client = openai.OpenAI(base_url=sim.url, api_key="x", max_retries=0)
        messages: Any = HELLO
        stream = client.chat.completions.create(
            model=ENDPOINT, messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert {chunk.model for chunk in chunks} == {FOUNDATION}

    def test_endpoints_and_model_ids_of_one_model_share_its_bill(self, sim: ArkSimulator) -> None:
        """Two endpoints and the model id of one model: one row in the bill."""
        sim.configure(endpoints={ENDPOINT: FOUNDATION, "ep-20250602-other": FOUNDATION})
        totals = [
            chat(sim, model=m).json()["usage"]["total_tokens"] for m in (ENDPOINT, "ep-20250602-other", FOUNDATION)
        ]
        assert sim.billed_by_model() == {FOUNDATION: sum(totals)}

    def test_lenient_mode_still_maps_endpoints(self, sim: ArkSimulator) -> None:
        """Lenient mode accepts unmapped endpoint ids as they are, and still maps the configured ones."""
        sim.configure(strict=False)
        assert chat(sim, model=ENDPOINT).json()["model"] == FOUNDATION
        assert chat(sim, model="ep-unmapped").json()["model"] == "ep-unmapped"


class TestSettings:
    @pytest.mark.parametrize(
        "value",
        [
            {ENDPOINT: FOUNDATION},
            [f"{ENDPOINT}={FOUNDATION}"],
            f" {ENDPOINT} = {FOUNDATION} ,",
            [(ENDPOINT, FOUNDATION)],
        ],
    )
    def test_endpoints_in_every_form(self, value: Any) -> None:
        """A mapping, 'ep=model' items, a comma-separated string (a header) or pairs all give one endpoint."""
        assert apply_patch(SimConfig(), {"endpoints": value}).endpoints == ((ENDPOINT, FOUNDATION),)

    @pytest.mark.parametrize("value", ["kites=doubao-seed-1-6-250615", ["ep-x"], [42], "ep-x=", 7])
    def test_malformed_endpoints_are_refused(self, value: Any) -> None:
        """An endpoint that is not ep-...=MODEL-VERSION is refused, naming the field."""
        with pytest.raises(SimConfigError) as caught:
            apply_patch(SimConfig(), {"endpoints": value})
        assert caught.value.param == "endpoints"

    def test_the_new_fields_round_trip_and_ride_headers(self) -> None:
        """strict, models, endpoints and thinking_auto_models survive to_json and come as x-sim-* headers."""
        config = SimConfig(strict=False, models=("a",), endpoints=((ENDPOINT, FOUNDATION),), thinking_auto_models=())
        assert apply_patch(SimConfig(), config.to_json()) == config
        headers = [("x-sim-strict", "false"), ("x-sim-endpoints", f"{ENDPOINT}={FOUNDATION}"), ("x-sim-models", "a")]
        assert apply_headers(SimConfig(thinking_auto_models=()), headers) == config


class TestCommandLine:
    def run_simulate(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "quotawrap", "simulate", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def served(self, proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("Ark simulator listening on "), line
        return line.rsplit(" ", 1)[-1]

    def test_endpoint_model_and_lenient_options(self, tmp_path: Path) -> None:
        """--endpoint maps an ep id, --model adds an id, --config reads settings; --lenient serves any model."""
        settings = tmp_path / "sim.json"
        settings.write_text('{"endpoints": {"ep-20250603-file": "deepseek-v3-2-251201"}, "reply_tokens": 3}')
        proc = self.run_simulate(
            "--endpoint", f"{ENDPOINT}={FOUNDATION}", "--model", "house-model", "--config", str(settings)
        )
        lenient = self.run_simulate("--lenient")
        try:
            url, lenient_url = self.served(proc), self.served(lenient)

            def post(base: str, model: str) -> httpx.Response:
                body = {"model": model, "messages": HELLO}
                return httpx.post(base + "/chat/completions", json=body, headers=AUTH, timeout=10)

            assert post(url, ENDPOINT).json()["model"] == FOUNDATION
            by_file = post(url, "ep-20250603-file").json()
            assert (by_file["model"], by_file["usage"]["completion_tokens"]) == ("deepseek-v3-2-251201", 3)
            assert post(url, "house-model").status_code == 200
            assert post(url, "gpt-4o").status_code == 404
            assert post(lenient_url, "gpt-4o").status_code == 200
        finally:
            for running in (proc, lenient):
                running.terminate()
                running.wait(timeout=30)

    def test_a_malformed_endpoint_is_a_usage_error(self) -> None:
        """--endpoint without an ep- id exits 2 with one line naming the form, no traceback."""
        proc = self.run_simulate("--endpoint", "kites=doubao-seed-1-6-250615")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2
        assert "ep-...=MODEL-VERSION" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def _rewrite_doc() -> None:
    text = DOC.read_text(encoding="utf-8")
    head, tail = text[: text.index(BEGIN) + len(BEGIN)], text[text.index(END) :]
    DOC.write_text(f"{head}\n{render_markdown()}{tail}", encoding="utf-8")


if __name__ == "__main__":
    _rewrite_doc()
