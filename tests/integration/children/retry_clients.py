"""Clients that retry refused calls on their own, each making one call quotawrap refuses.

Steps (argv, default all): ``batch`` (the Ark SDK's batch client, which retries 429s and 5xx
until its timeout, here 60 s), ``litellm`` (``num_retries=3``), ``llamaindex`` (its OpenAI LLM,
``max_retries=3``; skipped when not installed), ``openai`` (``max_retries=5``). Each step sends
its own prompt, so each is a distinct request. Prints one JSON line per step: the exception the
caller saw, its message, and how many attempts left the client (counted by an httpx event hook
where the client lets us give it one).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_OFFLINE_MODE"] = "true"

import httpx

URL = os.environ["SIM_URL"]
MODEL = "doubao-seed-1-6-250615"


def report(step: str, exc: BaseException | None, **fields: Any) -> None:
    print(
        json.dumps({"step": step, "error": type(exc).__name__ if exc else None, "message": str(exc), **fields}),
        flush=True,
    )


def counting_client() -> tuple[httpx.Client, list[int]]:
    attempts: list[int] = []
    return httpx.Client(event_hooks={"request": [lambda request: attempts.append(1)]}), attempts


def batch() -> None:
    from volcenginesdkarkruntime import Ark

    client, attempts = counting_client()
    ark = Ark(base_url=URL, api_key="sim-key", timeout=60, http_client=client)
    try:
        ark.batch.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "batch: kites?"}])
    except Exception as exc:
        report("batch", exc, attempts=len(attempts))
    else:
        report("batch", None, attempts=len(attempts))


def use_litellm() -> None:
    import litellm
    import openai

    client, attempts = counting_client()
    try:
        litellm.completion(
            model=f"openai/{MODEL}",
            api_base=URL,
            api_key="sim-key",
            messages=[{"role": "user", "content": "litellm: kites?"}],
            num_retries=3,
            client=openai.OpenAI(base_url=URL, api_key="sim-key", http_client=client),
        )
    except Exception as exc:
        report("litellm", exc, attempts=len(attempts))
    else:
        report("litellm", None, attempts=len(attempts))


def llamaindex() -> None:
    try:
        from llama_index.core.llms import ChatMessage
        from llama_index.llms.openai import OpenAI
    except ImportError:
        report("llamaindex", None, skipped=True)
        return
    client, attempts = counting_client()
    # llama-index checks model names against OpenAI's list: a gpt name, sent to the simulator under --base-url
    llm = OpenAI(model="gpt-4o-mini", api_base=URL, api_key="sim-key", max_retries=3, http_client=client)
    try:
        llm.chat([ChatMessage(role="user", content="llama-index: kites?")])
    except Exception as exc:
        report("llamaindex", exc, attempts=len(attempts))
    else:
        report("llamaindex", None, attempts=len(attempts))


def use_openai() -> None:
    import openai

    client, attempts = counting_client()
    oai = openai.OpenAI(base_url=URL, api_key="sim-key", max_retries=5, http_client=client)
    try:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "openai: kites?"}])
    except Exception as exc:
        report("openai", exc, attempts=len(attempts))
    else:
        report("openai", None, attempts=len(attempts))


STEPS = {"batch": batch, "litellm": use_litellm, "llamaindex": llamaindex, "openai": use_openai}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(STEPS):
        STEPS[name]()
