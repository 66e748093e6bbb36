"""Throughput of quotawrap.core.usage and quotawrap.core.sse on the hot path. Prints numbers, asserts nothing.

    python bench/bench_usage.py [--rounds 15]

* CPU added per streamed chunk (issue 12: about 5-7 us, target <= 3 us): a 2,000-chunk stream
  read through httpx (MockTransport, one event per piece as servers write them), guarded
  against plain, interleaved; and the reader alone, one event per feed();
* SSEUsageReader.feed() on a realistic 2,000-chunk Ark chat stream fed in 1 KiB pieces,
  without hiding (the pass-through path) and with hiding (the include_usage injection path);
  also with Ark chunk_include_usage, where every chunk carries usage and must be parsed;
* microseconds per usage_from_body() on a typical chat completion body.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _machine import load_average, machine_line  # bench/ is the script's directory

from quotawrap.core.sse import SSEUsageReader
from quotawrap.core.usage import usage_from_body

__all__ = ["chat_stream", "main"]

CHUNKS = 2_000
PIECE = 1024
WORDS = ["你好", "，", "quota", " guard", "的", "token", "用量", " is", " fine", "。", "\n"]


def _chunk(index: int, text: str, usage: dict[str, int] | None) -> bytes:
    chunk = {
        "id": "021752345678901234567890abcdef0123456789abcdef",
        "object": "chat.completion.chunk",
        "created": 1752345678,
        "model": "doubao-seed-1-6-250615",
        "service_tier": "default",
        "choices": [
            {
                "index": 0,
                "delta": {"content": text, "role": "assistant"},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": usage,
    }
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def chat_stream(*, cumulative: bool = False) -> bytes:
    """A stream the way Ark sends it under include_usage (or chunk_include_usage when cumulative)."""
    parts = []
    for i in range(CHUNKS):
        usage = {"prompt_tokens": 812, "completion_tokens": i + 1, "total_tokens": 813 + i} if cumulative else None
        parts.append(_chunk(i, WORDS[i % len(WORDS)], usage))
    final = {
        "id": "021752345678901234567890abcdef0123456789abcdef",
        "object": "chat.completion.chunk",
        "created": 1752345678,
        "model": "doubao-seed-1-6-250615",
        "choices": [],
        "usage": {
            "prompt_tokens": 812,
            "completion_tokens": CHUNKS,
            "total_tokens": 812 + CHUNKS,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }
    parts.append(b"data: " + json.dumps(final, separators=(",", ":")).encode() + b"\n\n")
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts)


def _best_seconds(run: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _feed_mb_per_s(stream: bytes, *, hide: bool, repeat: int = 20) -> float:
    pieces = [stream[i : i + PIECE] for i in range(0, len(stream), PIECE)]

    def run() -> None:
        reader = SSEUsageReader(hide_usage_only_chunk=hide)
        for piece in pieces:
            reader.feed(piece)
        reader.finish()
        assert reader.usage is not None  # a broken reader must not look fast

    return len(stream) / _best_seconds(run, repeat) / 1e6


def _body_us(repeat: int = 5, loops: int = 10_000) -> tuple[float, int]:
    body = json.dumps(
        {
            "id": "021752345678901234567890abcdef0123456789abcdef",
            "object": "chat.completion",
            "created": 1752345678,
            "model": "deepseek-v3-2-251201",
            "service_tier": "default",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "logprobs": None,
                    "message": {
                        "role": "assistant",
                        "content": "你好，" * 150,
                        "reasoning_content": "嗯" * 200,
                    },
                }
            ],
            "usage": {
                "prompt_tokens": 812,
                "completion_tokens": 640,
                "total_tokens": 1452,
                "prompt_tokens_details": {"cached_tokens": 512},
                "completion_tokens_details": {"reasoning_tokens": 300},
            },
        },
        ensure_ascii=False,
    ).encode()

    def run() -> None:
        for _ in range(loops):
            usage_from_body(body)

    return _best_seconds(run, repeat) / loops * 1e6, len(body)


def _events(stream: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in stream.split(b"\n\n") if event]


def _reader_us_per_chunk(events: list[bytes], *, hide: bool, repeat: int = 30) -> float:
    def run() -> None:
        reader = SSEUsageReader(hide_usage_only_chunk=hide)
        for event in events:
            reader.feed(event)
        reader.finish()
        assert reader.usage is not None

    return _best_seconds(run, repeat) / len(events) * 1e6


def _httpx_added_us_per_chunk(events: list[bytes], rounds: int) -> tuple[float, float, float]:
    """Median CPU per chunk of a streamed httpx read, plain and guarded (usage injected and hidden)."""
    import httpx

    from quotawrap.admission.guard import Guard
    from quotawrap.config.settings import Settings
    from quotawrap.intercept import httpx_adapter, set_guard

    class Chunks(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield from events

    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Chunks())

    store = f"sqlite:///{tempfile.mkdtemp()}/ledger.sqlite3"
    set_guard(Guard(Settings(store=store, base_url=("http://bench.test/api/v3",))))
    body = {"model": "doubao-seed-1-6-250615", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    samples: dict[str, list[float]] = {"plain": [], "guarded": []}
    with httpx.Client(transport=httpx.MockTransport(reply)) as client:
        for round_ in range(rounds + 2):
            for variant in ("plain", "guarded") if round_ % 2 else ("guarded", "plain"):
                (httpx_adapter.patch if variant == "guarded" else httpx_adapter.unpatch)(httpx)
                start = time.process_time()
                with client.stream("POST", "http://bench.test/api/v3/chat/completions", json=body) as response:
                    for _ in response.iter_raw():
                        pass
                if round_ >= 2:  # the first two rounds warm up (imports, the ledger's first open)
                    samples[variant].append((time.process_time() - start) / len(events) * 1e6)
    httpx_adapter.unpatch(httpx)
    set_guard(None)
    plain, guarded = statistics.median(samples["plain"]), statistics.median(samples["guarded"])
    return plain, guarded, guarded - plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the httpx stream")
    args = parser.parse_args()
    print(f"Usage reading — {machine_line()}; load average at the start: {load_average()}")
    events = _events(chat_stream())
    print(f"\nCPU per streamed chunk, {len(events)} events, one per piece")
    plain, guarded, added = _httpx_added_us_per_chunk(events, args.rounds)
    print(f"  httpx iter_raw, plain:             {plain:8.2f} µs/chunk (median of {args.rounds} streams)")
    print(f"  httpx iter_raw, guarded:           {guarded:8.2f} µs/chunk")
    print(f"  added by the guard:                {added:8.2f} µs/chunk (target <= 3; reserve+settle included)")
    print(f"  SSEUsageReader.feed, watching:     {_reader_us_per_chunk(events, hide=False):8.2f} µs/chunk (best)")
    print(f"  SSEUsageReader.feed, hiding:       {_reader_us_per_chunk(events, hide=True):8.2f} µs/chunk (best)")
    print()
    stream = chat_stream()
    cumulative = chat_stream(cumulative=True)
    print(f"chat stream: {CHUNKS} chunks, {len(stream) / 1e3:.0f} kB, fed in {PIECE} B pieces")
    print(f"  feed() without hiding:            {_feed_mb_per_s(stream, hide=False):8.1f} MB/s")
    print(f"  feed() with hiding:               {_feed_mb_per_s(stream, hide=True):8.1f} MB/s")
    print(f"  feed() chunk_include_usage:       {_feed_mb_per_s(cumulative, hide=False):8.1f} MB/s")
    micros, size = _body_us()
    print(f"usage_from_body() on a {size} B chat completion: {micros:6.1f} µs")
    print(f"\nload average at the end: {load_average()}")


if __name__ == "__main__":
    main()
