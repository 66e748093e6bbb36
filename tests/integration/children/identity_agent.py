"""An agent that names one model several ways: endpoint ids, the model id, spellings of it (the openai SDK).

Threads call round-robin through the names given (``--names`` separated by commas), streamed and plain,
until a call is refused (HTTP 429) or ``--max-calls``; one JSON line per call: the name it used, the outcome,
the ``model`` the answer named. ``--processes N`` runs that many such processes at once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading

import openai

URL = os.environ["SIM_URL"]


def emit(**record: object) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())  # one write(2) per line: never interleaved


def worker(names: list[str], args: argparse.Namespace, wid: int) -> None:
    sdk = openai.OpenAI(base_url=URL, api_key="sk-test", max_retries=0)
    for i in range(args.max_calls):
        name = names[(i + wid) % len(names)]
        stream = (i + wid) % 3 == 1
        request = {
            "model": name,
            "messages": [{"role": "user", "content": f"call {i} of worker {wid}"}],
            "max_tokens": args.max_tokens,
            **({} if args.thinking else {"extra_body": {"thinking": {"type": "disabled"}}}),
        }
        try:
            if stream:
                chunks = list(sdk.chat.completions.create(stream=True, **request))
                emit(name=name, outcome="ok", stream=True, model=chunks[-1].model if chunks else None)
            else:
                answer = sdk.chat.completions.create(**request)
                emit(name=name, outcome="ok", stream=False, model=answer.model, total=answer.usage.total_tokens)
        except openai.RateLimitError as exc:
            emit(name=name, outcome="blocked", message=exc.message)
            if not args.keep_going:
                return


def run(args: argparse.Namespace) -> None:
    names = args.names.split(",")
    threads = [threading.Thread(target=worker, args=(names, args, wid)) for wid in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--names", required=True)
    parser.add_argument("--threads", type=int, default=6)
    parser.add_argument("--processes", type=int, default=0)
    parser.add_argument("--max-calls", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--keep-going", action="store_true", help="go on after a refusal")
    parser.add_argument("--thinking", action="store_true", help="leave thinking on (the model's default)")
    args = parser.parse_args()
    args.names = args.names.replace("\\n", "\n")  # a spelling with a newline, passed on a command line
    if not args.processes:
        run(args)
        return
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=run, args=(args,)) for _ in range(args.processes)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    sys.exit(max((proc.exitcode or 0) for proc in procs))


if __name__ == "__main__":
    main()
