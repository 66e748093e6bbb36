"""A parallel LLM client program, run under quotawrap by the integration tests.

Each worker calls the simulator until it is blocked (HTTP 429) or hits --max-calls, and
prints one JSON line per call. `--processes N` fans out over multiprocessing (fork and spawn
alternately) with a different client library per process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import threading

CLIENTS = ("openai", "ark", "requests", "httpx-async")
URL = os.environ["SIM_URL"]


def emit(**record: object) -> None:
    # One write(2) per line: atomic on a pipe, so lines of several processes never interleave.
    os.write(1, (json.dumps(record) + "\n").encode())


def body(args: argparse.Namespace, i: int) -> dict:
    return {
        "model": args.model,
        "messages": [{"role": "user", "content": f"call {i}: say something long"}],
        "max_tokens": args.max_tokens,
        "thinking": {"type": "disabled"},
    }


def worker_sync(client: str, args: argparse.Namespace, wid: int) -> None:
    if client == "openai":
        import openai

        sdk = openai.OpenAI(base_url=URL, api_key="sk-test", max_retries=0)
        blocked_error = openai.RateLimitError
    elif client == "ark":
        import volcenginesdkarkruntime as ark

        sdk = ark.Ark(base_url=URL, api_key="sk-test", max_retries=0)
        from volcenginesdkarkruntime._exceptions import ArkRateLimitError as blocked_error
    else:
        import requests

        session = requests.Session()
    for i in range(args.max_calls):
        stream = (i + wid) % 2 == 1
        request = body(args, i)
        if client in ("openai", "ark"):
            try:
                extra = {"extra_body": {"thinking": request.pop("thinking")}}
                if stream:
                    chunks = list(sdk.chat.completions.create(stream=True, **request, **extra))
                    emit(client=client, outcome="ok", stream=True, chunks=len(chunks))
                else:
                    answer = sdk.chat.completions.create(**request, **extra)
                    emit(client=client, outcome="ok", stream=False, total=answer.usage.total_tokens)
            except blocked_error as exc:
                emit(client=client, outcome="blocked", status=exc.status_code)
                return
        else:
            response = session.post(
                f"{URL}/chat/completions",
                json={**request, "stream": stream},
                headers={"Authorization": "Bearer sk-test"},
                stream=stream,
            )
            if response.status_code == 429:
                emit(client=client, outcome="blocked", status=429)
                return
            response.raise_for_status()
            lines = [line for line in response.iter_lines() if line] if stream else [response.content]
            emit(client=client, outcome="ok", stream=stream, chunks=len(lines))


async def worker_async(args: argparse.Namespace, wid: int, http: object) -> None:
    for i in range(args.max_calls):
        stream = (i + wid) % 2 == 1
        payload = {**body(args, i), "stream": stream}
        headers = {"Authorization": "Bearer sk-test"}
        if stream:
            async with http.stream("POST", f"{URL}/chat/completions", json=payload, headers=headers) as response:
                if response.status_code == 429:
                    await response.aread()
                    emit(client="httpx-async", outcome="blocked", status=429)
                    return
                lines = [line async for line in response.aiter_lines() if line]
                emit(client="httpx-async", outcome="ok", stream=True, chunks=len(lines))
        else:
            response = await http.post(f"{URL}/chat/completions", json=payload, headers=headers)
            if response.status_code == 429:
                emit(client="httpx-async", outcome="blocked", status=429)
                return
            emit(
                client="httpx-async",
                outcome="ok",
                stream=False,
                total=response.json()["usage"]["total_tokens"],
            )


def report_advances() -> None:
    """With SWARM_DRAWN set, one line per process: how many of its calls were drawn from an advance."""
    if os.environ.get("SWARM_DRAWN"):
        from quotawrap.intercept import get_guard

        guard = get_guard()
        emit(drawn=guard.advances.drawn if guard is not None and guard.advances is not None else 0, pid=os.getpid())


def run_client(client: str, args: argparse.Namespace) -> None:
    try:
        run_calls(client, args)
    finally:
        report_advances()


def run_calls(client: str, args: argparse.Namespace) -> None:
    if client == "httpx-async":
        import httpx

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                await asyncio.gather(*(worker_async(args, wid, http) for wid in range(args.threads)))

        asyncio.run(main())
        return
    threads = [threading.Thread(target=worker_sync, args=(client, args, wid)) for wid in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--client", choices=CLIENTS, default="openai")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--processes", type=int, default=0)
    parser.add_argument("--max-calls", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=500)
    parser.add_argument("--model", default="deepseek-v4-flash")
    args = parser.parse_args()
    if not args.processes:
        run_client(args.client, args)
        return
    procs = []
    for n in range(args.processes):
        context = multiprocessing.get_context("fork" if n % 2 else "spawn")
        proc = context.Process(target=run_client, args=(CLIENTS[n % len(CLIENTS)], args))
        proc.start()
        procs.append(proc)
    for proc in procs:
        proc.join()
    sys.exit(max((proc.exitcode or 0) for proc in procs))


if __name__ == "__main__":
    main()
