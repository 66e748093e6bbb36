"""An agent using Ark's endpoints beyond chat through the real Ark and openai SDKs.

Steps (argv; default: all but ``orphan``): ``images``, ``video`` (a task polled until it ends),
``context`` (context create, then a chat on it), ``batch`` (batch chat), ``bot`` (bot chat), ``unknown`` (a POST to
a path quotawrap does not know), ``orphan`` (a task created and never polled; prints what
``quotawrap status --json`` says meanwhile). Prints one JSON line per step: {"step", "outcome", ...}.
SIM_URL is the Ark base URL; VIDEO_PROMPT (optional) the video task's text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import openai
from volcenginesdkarkruntime import Ark
from volcenginesdkarkruntime._exceptions import ArkAPIStatusError
from volcenginesdkarkruntime.types.images.images import SequentialImageGenerationOptions

URL = os.environ["SIM_URL"]
ark = Ark(base_url=URL, api_key="sim-key", max_retries=2)
oai = openai.OpenAI(base_url=URL, api_key="sim-key", max_retries=2)


def report(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


def attempt(step: str, call: Any) -> Any:
    started = time.monotonic()
    try:
        result = call()
    except (ArkAPIStatusError, openai.APIStatusError) as exc:
        report(step, outcome="refused", status=exc.status_code, message=str(exc), seconds=time.monotonic() - started)
        return None
    return result


def images() -> None:
    image = attempt(
        "images",
        lambda: ark.images.generate(model="doubao-seedream-4-0-250828", prompt="a red kite", size="1024x1024"),
    )
    if image is None:
        return
    # then a stream of up to two 1K images: the usage comes in its image_generation.completed event
    options = SequentialImageGenerationOptions(max_images=2)
    events = ark.images.generate(
        model="doubao-seedream-4-0-250828",
        prompt="two kites",
        size="1K",
        stream=True,
        sequential_image_generation="auto",
        sequential_image_generation_options=options,
    )
    completed = [event for event in events if event.type == "image_generation.completed"]
    usage = completed[-1].usage
    streamed = usage if isinstance(usage, dict) else usage.model_dump()
    report(
        "images",
        outcome="ok",
        tokens=image.usage.total_tokens + streamed["total_tokens"],
        images=image.usage.generated_images + streamed["generated_images"],
    )


def create_task() -> Any:
    prompt = os.environ.get("VIDEO_PROMPT", "a kite over the sea --rs 480p --dur 5")
    return attempt(
        "video",
        lambda: ark.content_generation.tasks.create(
            model="doubao-seedance-1-0-pro-250528", content=[{"type": "text", "text": prompt}]
        ),
    )


def video() -> None:
    task = create_task()
    if task is not None:
        while True:
            seen = ark.content_generation.tasks.get(task_id=task.id)
            if seen.status not in ("queued", "running"):
                break
            time.sleep(0.1)
        report("video", outcome="ok", status=seen.status, tokens=seen.usage.completion_tokens, task=task.id)


def orphan() -> None:
    task = create_task()
    if task is not None:
        status = subprocess.run(
            [sys.executable, "-m", "quotawrap", "status", "--json"], capture_output=True, text=True, check=True
        )
        report("orphan", outcome="ok", task=task.id, status=json.loads(status.stdout))


def context() -> None:
    context = attempt(
        "context",
        lambda: ark.context.create(
            model="doubao-seed-1-6-250615",
            messages=[{"role": "system", "content": "You are a kite expert. " + "Kites fly. " * 600}],
        ),
    )
    if context is not None:
        usage = context.usage if isinstance(context.usage, dict) else context.usage.model_dump()
        # a small answer, no thinking: without the cached context its reserve would be ~80 tokens
        chat = ark.context.completions.create(
            context_id=context.id,
            model="doubao-seed-1-6-250615",
            messages=[{"role": "user", "content": "best kite?"}],
            max_tokens=64,
            extra_body={"thinking": {"type": "disabled"}},
        )
        report("context", outcome="ok", tokens=usage["total_tokens"], chat_tokens=chat.usage.total_tokens)


def batch() -> None:
    batch = attempt(
        "batch",
        lambda: ark.batch.chat.completions.create(
            model="doubao-seed-1-6-250615", messages=[{"role": "user", "content": "kites?"}], max_tokens=64
        ),
    )
    if batch is not None:
        report("batch", outcome="ok", tokens=batch.usage.total_tokens)


def bot() -> None:
    bot = attempt(
        "bot",
        lambda: ark.bot_chat.completions.create(
            model="bot-20250101-kites", messages=[{"role": "user", "content": "news on kites"}], max_tokens=64
        ),
    )
    if bot is not None:
        report("bot", outcome="ok", tokens=bot.usage.total_tokens)


def unknown() -> None:
    unknown = attempt(
        "unknown",
        lambda: oai.post("/audio/speech", cast_to=openai.types.Completion, body={"model": "tts-1", "input": "hi"}),
    )
    if unknown is not None:
        report("unknown", outcome="ok")


STEPS = {
    "images": images,
    "video": video,
    "context": context,
    "batch": batch,
    "bot": bot,
    "unknown": unknown,
    "orphan": orphan,
}

if __name__ == "__main__":
    for name in sys.argv[1:] or [step for step in STEPS if step != "orphan"]:
        STEPS[name]()
