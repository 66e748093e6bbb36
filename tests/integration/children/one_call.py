"""One non-streamed call with the openai SDK (httpx2); prints its usage total or BLOCKED."""

from __future__ import annotations

import os
import sys

import openai

sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
try:
    answer = sdk.chat.completions.create(
        model=os.environ.get("MODEL", "deepseek-v4-flash"),
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=int(os.environ.get("MAX_TOKENS", "100")),
    )
    print(f"TOTAL {answer.usage.total_tokens}")
except openai.RateLimitError as exc:
    print(f"BLOCKED {exc.message}")
    sys.exit(int(os.environ.get("EXIT_ON_BLOCK", "0")))
if len(sys.argv) > 1 and sys.argv[1] == "--spawn-grandchild":
    import subprocess

    sys.exit(subprocess.call([sys.executable, __file__]))
