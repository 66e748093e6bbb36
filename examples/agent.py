"""A small parallel "agent": many chat calls at once through the official openai SDK.

Run it guarded:  quotawrap --model deepseek-v4-flash --cap-tokens 20000 -- python examples/agent.py
(`quotawrap demo` does that against the bundled Ark simulator when ARK_API_KEY is unset.)

The model may think. Half the calls set no output bound (quotawrap sends them with max_completion_tokens
at the model's learned allowance); the streamed half set max_tokens=1024, which bounds only the answer on
Ark. Every request that goes out is one Ark accepts: never max_tokens beside max_completion_tokens.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import openai

BASE_URL = os.environ.get("ARK_BASE_URL", "https://ark.cn-beijing.volces.com/api/v3")
MODEL = os.environ.get("DEMO_MODEL", "deepseek-v4-flash")
CALLS = int(os.environ.get("DEMO_CALLS", "24"))

client = openai.OpenAI(base_url=BASE_URL, api_key=os.environ["ARK_API_KEY"], max_retries=0)


def ask(i: int) -> str:
    question = f"第 {i} 个问题：彩虹有几种颜色？"
    try:
        if i % 2:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=1024, stream=True
            )
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        else:
            answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}])
            text = answer.choices[0].message.content or ""
        return f"call {i:2}: answered ({len(text)} chars)"
    except openai.RateLimitError as exc:
        reason = exc.body.get("message", "") if isinstance(exc.body, dict) else str(exc)
        return (
            f"call {i:2}: BLOCKED (HTTP {exc.status_code}): {reason.removeprefix('quotawrap blocked this request: ')}"
        )


with ThreadPoolExecutor(max_workers=CALLS) as pool:
    for line in pool.map(ask, range(CALLS)):
        print(line)
