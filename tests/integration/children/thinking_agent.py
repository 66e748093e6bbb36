"""A thinking agent run under quotawrap by tests/integration/test_output_bounds.py: what Ark would answer it.

``--threads`` workers make ``--calls`` chat calls each through the openai SDK (no retries), with ``max_tokens``
small, large or absent, streamed and not, the simulated model reasoning a different amount per call. One JSON
line per call: the HTTP status, the max_tokens it set, and the answer and reasoning tokens the usage reports
(a stream asks for its own usage, so the program sees it).
"""

from __future__ import annotations

import argparse
import json
import os
import threading

import openai

URL = os.environ["SIM_URL"]


def emit(**record: object) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


def one_call(client: openai.OpenAI, model: str, max_reasoning: int, i: int) -> None:
    kwargs: dict = {"model": model, "messages": [{"role": "user", "content": f"call {i}: think, then answer"}]}
    max_tokens = (64, 8_000, None)[i % 3]
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    stream = i % 2 == 1
    headers = {"x-sim-reasoning-tokens": str(max_reasoning * (1 + (i * 7) % 10) // 10)}
    try:
        if stream:
            usage = None
            chunks = client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}, extra_headers=headers
            )
            for chunk in chunks:
                usage = chunk.usage or usage
        else:
            usage = client.chat.completions.create(**kwargs, extra_headers=headers).usage
    except openai.APIStatusError as exc:
        emit(i=i, status=exc.status_code, max_tokens=max_tokens, stream=stream, error=str(exc.body))
        return
    assert usage is not None
    details = usage.completion_tokens_details
    reasoning = (details.reasoning_tokens if details is not None else 0) or 0
    emit(
        i=i,
        status=200,
        max_tokens=max_tokens,
        stream=stream,
        answer=usage.completion_tokens - reasoning,
        reasoning=reasoning,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="deepseek-v4-flash")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--max-reasoning", type=int, default=30_000)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=URL, api_key="sk-test", max_retries=0)

    def worker(w: int) -> None:
        for n in range(args.calls):
            one_call(client, args.model, args.max_reasoning, w * 100 + n)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
