"""Calls of one size through the openai SDK (no retries), run under quotawrap by tests/integration/test_fcfs.py.

``--threads`` workers each make ``--calls`` calls whose whole output is bounded at ``--max-tokens``
(``max_completion_tokens``: what quotawrap reserves), answered after ``--latency`` seconds. Prints
{"pid": ...} first, then one JSON line per call: its outcome and when it was sent and answered.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import openai


def emit(**record: object) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


def worker(args: argparse.Namespace) -> None:
    client = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0, timeout=300)
    headers = {"x-sim-latency-s": str(args.latency), "x-sim-reply-tokens": "10"}
    for _ in range(args.calls):
        sent = time.time()
        try:
            client.chat.completions.create(
                model="deepseek-v4-flash",
                messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=args.max_tokens,
                extra_headers=headers,
            )
            outcome = "ok"
        except openai.RateLimitError:
            outcome = "blocked"
        emit(outcome=outcome, size=args.max_tokens, sent=sent, done=time.time())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    emit(pid=os.getpid())
    threads = [threading.Thread(target=worker, args=(args,)) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
