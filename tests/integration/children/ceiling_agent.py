"""An agent that never retries a 429, run under quotawrap by tests/integration/test_ceiling.py.

Workers (threads, optionally in several processes) call chat completions through the openai SDK
with ``max_retries=0`` and print one JSON line per call. ``--until-refused`` keeps a worker calling
until its first 429; otherwise it makes ``--calls`` calls. ``--thinking`` makes the simulated model
reason a different amount per call (up to ``--max-reasoning``) and varies ``max_tokens`` (small,
large, absent) and streaming. ``--abandon`` opens streams and walks away after three chunks in one
of the ways a program abandons them, then reports the run's tokens in flight from the ledger.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import threading

import openai

URL = os.environ["SIM_URL"]
MODEL = "deepseek-v4-flash"


def emit(**record: object) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


def request(args: argparse.Namespace, i: int) -> tuple[dict, dict[str, str], bool]:
    kwargs: dict = {"model": MODEL, "messages": [{"role": "user", "content": f"call {i}: think about it"}]}
    headers: dict[str, str] = {}
    stream = False
    if args.thinking:
        # a spread of reasoning lengths, the longest ones at --max-reasoning
        headers["x-sim-reasoning-tokens"] = str(args.max_reasoning * (1 + (i * 7) % 10) // 10)
        choice = i % 3
        if choice == 0:
            kwargs["max_tokens"] = 64
        elif choice == 1:
            kwargs["max_tokens"] = 8_000
        stream = i % 2 == 1
    # otherwise no bound at all: the guard adds its own (the learned allowance), which each call holds
    return kwargs, headers, stream


def one_call(client: openai.OpenAI, args: argparse.Namespace, i: int) -> bool:
    kwargs, headers, stream = request(args, i)
    try:
        if stream:
            chunks = client.chat.completions.create(**kwargs, stream=True, extra_headers=headers)
            for _ in chunks:
                pass
        else:
            client.chat.completions.create(**kwargs, extra_headers=headers)
    except openai.RateLimitError as exc:
        emit(outcome="blocked", i=i, message=str(exc.body))
        return False
    emit(outcome="ok", i=i, stream=stream)
    return True


def worker(args: argparse.Namespace, wid: int) -> None:
    client = openai.OpenAI(base_url=URL, api_key="sk-test", max_retries=0)
    for n in range(args.calls):
        if not one_call(client, args, wid * 1000 + n) and args.until_refused:
            return


def process_main(args: argparse.Namespace, pid_index: int) -> None:
    threads = [threading.Thread(target=worker, args=(args, pid_index * args.threads + t)) for t in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def in_flight() -> int:
    """The run's tokens in flight, as the ledger holds them once the settles already submitted have landed
    (the guard settles on a background thread; flush waits for what abandoning the stream queued)."""
    from quotawrap.intercept import get_guard
    from quotawrap.ledger import open_ledger, run_key

    guard = get_guard()
    if guard is not None:
        guard.flush(timeout=10)

    ledger = open_ledger(os.environ["QUOTAWRAP_STORE"])
    key = run_key(os.environ["QUOTAWRAP_RUN_ID"])
    try:
        return ledger.counters([key])[key].in_flight
    finally:
        ledger.close()


def abandon(how: str) -> None:
    client = openai.OpenAI(base_url=URL, api_key="sk-test", max_retries=0)
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": f"abandon by {how}"}], "stream": True}
    headers = {"x-sim-reasoning-tokens": "3000"}
    if how == "close":
        stream = client.chat.completions.create(**kwargs, extra_headers=headers)
        for n, _ in enumerate(stream):
            if n == 2:
                break
        stream.close()
    elif how == "break-and-drop":
        stream = client.chat.completions.create(**kwargs, extra_headers=headers)
        for n, _ in enumerate(stream):
            if n == 2:
                break
        del stream
        gc.collect()
    elif how == "exception":
        try:
            with client.chat.completions.create(**kwargs, extra_headers=headers) as stream:
                for n, _ in enumerate(stream):
                    if n == 2:
                        raise ValueError("the consumer failed")
        except ValueError:
            pass
    elif how == "cancel":
        asyncio.run(_cancelled(kwargs, headers))
    elif how in ("break-and-keep", "break-keep-resume"):
        # the commonest abandon: `stream` stays referenced while the program makes its next call
        stream = client.chat.completions.create(**kwargs, extra_headers=headers)
        seen = []
        for n, chunk in enumerate(stream):
            seen.append(chunk)
            if n == 2:
                break
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "next"}])
        record: dict[str, object] = {"abandoned": how}
        if how == "break-keep-resume":
            # the next call had room: nothing waited for the read-ahead, which may still be under way
            seen.extend(stream)  # the rest, from the read-ahead's buffer (and the upstream if it is not done)
            control = list(client.chat.completions.create(**kwargs, extra_headers=headers))
            record["identical"] = [_text(c) for c in seen] == [_text(c) for c in control]
            record["chunks"] = len(seen)
        emit(**record, in_flight=in_flight())
        return
    elif how == "break-and-keep-async":
        asyncio.run(_kept_async(kwargs, headers))
        return
    elif how == "left-by-thread":
        _left_by_thread(client, kwargs, headers)
        return
    emit(abandoned=how, in_flight=in_flight())


def _text(chunk: object) -> str:
    """A chunk as the program sees it, less what differs between two generations (id, time)."""
    data = chunk.model_dump()  # type: ignore[attr-defined]
    data.pop("id", None)
    data.pop("created", None)
    return json.dumps(data, sort_keys=True)


async def _kept_async(kwargs: dict, headers: dict[str, str]) -> None:
    client = openai.AsyncOpenAI(base_url=URL, api_key="sk-test", max_retries=0)
    stream = await client.chat.completions.create(**kwargs, extra_headers=headers)
    n = 0
    async for _ in stream:
        n += 1
        if n == 3:
            break
    # the same task calls again while `stream` is still referenced
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "next"}])
    emit(abandoned="break-and-keep-async", in_flight=await asyncio.to_thread(in_flight))
    del stream
    await client.close()


def _left_by_thread(client: openai.OpenAI, kwargs: dict, headers: dict[str, str]) -> None:
    """Another thread leaves a stream (still referenced, the thread alive); this one must wait for its room."""
    left, done = threading.Event(), threading.Event()

    def leaver() -> None:
        stream = client.chat.completions.create(**kwargs, extra_headers=headers)
        for n, _ in enumerate(stream):
            if n == 2:
                break
        left.set()
        done.wait()
        del stream

    thread = threading.Thread(target=leaver)
    thread.start()
    left.wait()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "next"}])
    emit(abandoned="left-by-thread", in_flight=in_flight())
    done.set()
    thread.join()


async def _cancelled(kwargs: dict, headers: dict[str, str]) -> None:
    client = openai.AsyncOpenAI(base_url=URL, api_key="sk-test", max_retries=0)
    three = asyncio.Event()

    async def consume() -> None:
        stream = await client.chat.completions.create(**kwargs, extra_headers=headers)
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                three.set()
                await asyncio.sleep(3600)

    task = asyncio.create_task(consume())
    await three.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await client.close()


async def async_burst(args: argparse.Namespace) -> None:
    """--async: all calls as tasks of one event loop; a ticker proves the loop runs while calls wait."""
    client = openai.AsyncOpenAI(base_url=URL, api_key="sk-test", max_retries=0)
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    async def call(i: int) -> None:
        kwargs, headers, _ = request(args, i)
        try:
            await client.chat.completions.create(**kwargs, extra_headers=headers)
        except openai.RateLimitError as exc:
            emit(outcome="blocked", i=i, message=str(exc.body))
            return
        emit(outcome="ok", i=i, stream=False)

    tick_task = asyncio.create_task(ticker())
    await asyncio.gather(*(call(i) for i in range(args.threads)))
    done.set()
    await tick_task
    await client.close()
    emit(ticks=ticks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--until-refused", action="store_true")
    parser.add_argument("--thinking", action="store_true")
    parser.add_argument("--max-reasoning", type=int, default=30_000)
    parser.add_argument("--abandon", nargs="*", default=None)
    parser.add_argument("--async", dest="use_async", action="store_true")
    args = parser.parse_args()
    if args.abandon is not None:
        for how in args.abandon:
            abandon(how)
        return
    if args.use_async:
        asyncio.run(async_burst(args))
        return
    if args.processes == 1:
        process_main(args, 0)
        return
    processes = [multiprocessing.Process(target=process_main, args=(args, p)) for p in range(args.processes)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()


if __name__ == "__main__":
    main()
