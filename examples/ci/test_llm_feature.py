"""A project's test suite that calls an LLM — the kind of suite a CI cost guard protects.

Guarded in CI:
    quotawrap --cap-tokens 50000 --fail-on-block --report-json llm-cost.json -- pytest examples/ci
Against Ark it needs ARK_API_KEY; without one it talks to `quotawrap simulate` at ARK_BASE_URL.
"""

from __future__ import annotations

import os

import openai
import pytest

MODEL = os.environ.get("LLM_MODEL", "deepseek-v4-flash")


@pytest.fixture(scope="module")
def llm() -> openai.OpenAI:
    return openai.OpenAI(
        base_url=os.environ.get("ARK_BASE_URL", "https://ark.cn-beijing.volces.com/api/v3"),
        api_key=os.environ.get("ARK_API_KEY", "simulated"),
        max_retries=0,
    )


@pytest.mark.parametrize("topic", ["rainbows", "tides", "volcanoes", "glaciers", "comets", "deserts"])
def test_summary_is_not_empty(llm: openai.OpenAI, topic: str) -> None:
    answer = llm.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"One sentence about {topic}."}],
        max_tokens=200,
        extra_body={"thinking": {"type": "disabled"}},
    )
    assert answer.choices[0].message.content
