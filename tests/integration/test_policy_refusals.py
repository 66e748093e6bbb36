"""A refusal by policy is a 4xx naming the rule: never a store outage, never sent unguarded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import run_quotawrap

# The real openai SDK, so the status and message are what a program would see.
CALL = """
import json, os, openai
sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
try:
    sdk.chat.completions.create(model="house-unpriced-model", messages=[{"role": "user", "content": "hi"}],
                                max_tokens=50)
    print(json.dumps({"status": 200}))
except openai.APIStatusError as exc:
    print(json.dumps({"status": exc.status_code, "message": exc.message}))
"""


class TestUnknownPriceIsAPolicy:
    @pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
    def test_unpriced_model_under_error_policy_is_refused_with_4xx(
        self, sim: ArkSimulator, store: str, tmp_path: Path, fail_open: bool
    ) -> None:
        """--unknown-price error: 400 naming the policy, never '503 cannot reach its ledger'; --fail-open
        changes nothing (a rule is not an outage), and the provider bills nothing."""
        unguarded = tmp_path / "unguarded.jsonl"
        args = ["--store", store, "--base-url", sim.url, "--unknown-price", "error"]
        if fail_open:
            args += ["--fail-open", "--unguarded-log", str(unguarded)]
        result = run_quotawrap(args, [sys.executable, "-c", CALL], env={"SIM_URL": sim.url})
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        assert answer["status"] == 400
        assert "--unknown-price" in answer["message"] and "house-unpriced-model" in answer["message"]
        assert "ledger" not in answer["message"]
        assert sim.billed_total() == 0
        assert "UNGUARDED" not in result.stderr and not unguarded.exists()


class TestBadSettingsInsideTheProgram:
    def test_a_bad_variable_set_by_the_program_refuses_its_calls_with_400(self, sim: ArkSimulator, store: str) -> None:
        """The program sets QUOTAWRAP_HOLD_TTL=nan before its first call: 400 naming it, no exception, nothing sent."""
        script = "import os\nos.environ['QUOTAWRAP_HOLD_TTL'] = 'nan'\n" + CALL.replace(
            "house-unpriced-model", "deepseek-v4-flash"
        )
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url], [sys.executable, "-c", script], env={"SIM_URL": sim.url}
        )
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        assert answer["status"] == 400 and "--hold-ttl" in answer["message"]
        assert sim.billed_total() == 0
