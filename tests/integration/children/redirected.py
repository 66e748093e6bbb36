"""One chat call through the openai SDK (httpx) and one through requests, to a base URL that redirects.

SIM_URL answers every POST with a 307 to another server; both clients follow it, re-sending the
request there. Prints one JSON line per client with the usage it got back.
"""

from __future__ import annotations

import json
import os

import openai
import requests

URL = os.environ["SIM_URL"]
MODEL = "doubao-seed-1-6-250615"
messages = [{"role": "user", "content": "where do kites go?"}]

answer = openai.OpenAI(base_url=URL, api_key="sim-key").chat.completions.create(
    model=MODEL, messages=messages, max_tokens=50
)
print(json.dumps({"client": "openai", "total_tokens": answer.usage.total_tokens}), flush=True)

response = requests.post(
    f"{URL}/chat/completions",
    json={"model": MODEL, "messages": messages, "max_tokens": 50},
    headers={"Authorization": "Bearer sim-key"},
    timeout=60,
)
response.raise_for_status()
print(json.dumps({"client": "requests", "total_tokens": response.json()["usage"]["total_tokens"]}), flush=True)
