"""Makes the same calls with openai (httpx2) and Ark's SDK (httpx), stream and not, and prints
what the caller's code sees, so a test can compare it with and without quotawrap."""

from __future__ import annotations

import json
import os

import openai
import volcenginesdkarkruntime as ark

URL = os.environ["SIM_URL"]
VOLATILE = {"id", "created", "system_fingerprint"}


def scrub(obj: object) -> object:
    data = obj.model_dump() if hasattr(obj, "model_dump") else obj
    if isinstance(data, dict):
        return {k: scrub(v) for k, v in data.items() if k not in VOLATILE}
    if isinstance(data, list):
        return [scrub(v) for v in data]
    return data


messages = [{"role": "user", "content": "彩虹有几种颜色？"}]
seen = {}
for name, sdk in (
    ("openai", openai.OpenAI(base_url=URL, api_key="sk-test", max_retries=0)),
    ("ark", ark.Ark(base_url=URL, api_key="sk-test", max_retries=0)),
):
    seen[f"{name}.plain"] = scrub(sdk.chat.completions.create(model="deepseek-v4-flash", messages=messages))
    seen[f"{name}.stream"] = [
        scrub(chunk) for chunk in sdk.chat.completions.create(model="deepseek-v4-flash", messages=messages, stream=True)
    ]
    seen[f"{name}.stream_usage"] = [
        scrub(chunk)
        for chunk in sdk.chat.completions.create(
            model="deepseek-v4-flash", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    ]
    seen[f"{name}.type"] = type(sdk.chat.completions.create(model="deepseek-v4-flash", messages=messages)).__name__
print(json.dumps(seen, sort_keys=True, ensure_ascii=False))
