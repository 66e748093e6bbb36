"""Starts one stream, announces it once the first chunk arrived, and reads the rest only once the file
named by RELEASE_FILE exists: its hold stays in flight exactly as long as the test wants."""

from __future__ import annotations

import os
import time

import openai

sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
stream = sdk.chat.completions.create(
    model="deepseek-v4-flash",
    messages=[{"role": "user", "content": "tell a story"}],
    max_tokens=400,
    stream=True,
    stream_options={"include_usage": True},
)
next(iter(stream))
print("STREAMING", flush=True)
while not os.path.exists(os.environ["RELEASE_FILE"]):
    time.sleep(0.05)
for _chunk in stream:
    pass
print("DONE", flush=True)
