"""Starts one slow stream, announces its pid once the first chunk arrived, keeps reading."""

from __future__ import annotations

import os
import sys

import openai

sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
stream = sdk.chat.completions.create(
    model="deepseek-v4-flash",
    messages=[{"role": "user", "content": "tell a long story"}],
    max_tokens=2000,
    stream=True,
    extra_headers={"x-sim-chunk-delay-s": os.environ.get("CHUNK_DELAY", "0.2"), "x-sim-reply-tokens": "2000"},
)
for n, _chunk in enumerate(stream):
    if n == 0:
        print(f"STREAMING {os.getpid()}", flush=True)
sys.exit(0)
