"""Leaves an openai stream open and referenced when the interpreter exits (after 3 chunks)."""

import os

import openai

client = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
stream = client.chat.completions.create(
    model="deepseek-v4-flash",
    messages=[{"role": "user", "content": "hi"}],
    stream=True,
    extra_headers={"x-sim-chunk-delay-s": "0.05", "x-sim-reply-tokens": "200"},
)
for index, _chunk in enumerate(stream):
    if index == 2:
        break
print("LEFT OPEN", flush=True)
