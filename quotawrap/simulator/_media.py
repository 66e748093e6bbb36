"""Ark's generation endpoints beyond chat: Seedream images, context create, Seedance video tasks.

Shapes follow the Ark SDK's types (``volcenginesdkarkruntime/types/images``, ``context``,
``content_generation``) and Ark's docs:

* images: ``data[]`` of ``{url | b64_json, size}`` and ``usage {generated_images, output_tokens,
  total_tokens}``; each image bills ``width x height / 256`` tokens; a stream sends one
  ``image_generation.partial_succeeded`` event per image, then ``image_generation.completed``
  with the usage, then ``[DONE]``;
* context create: ``{id, model, mode, ttl, truncation_strategy, usage}``, billing the prompt; a
  context chat on it bills the context's tokens as prompt too;
* video tasks: a create answers ``{id}`` and bills nothing yet; the task runs ``task_s`` seconds
  (simulator time), then succeeds and is billed ``width x height x fps x seconds / 1024`` tokens
  whether or not anyone looks; a GET shows ``usage {completion_tokens, total_tokens}`` once it
  has succeeded; DELETE cancels a task that has not finished (never billed).
"""

from __future__ import annotations

import base64
import re
import threading
from collections.abc import Mapping
from typing import Any

from ..core.records import Record
from . import _payloads as payloads
from ._api import API_PREFIX, ArkError, Generation, _invalid, _model, _opt_count, _required, _stream
from ._config import SimConfig
from ._contract import check_messages
from ._plan import Plan, chat_prompt_tokens

__all__ = ["MEDIA_ENDPOINTS", "TASKS_PATH", "TaskBook", "image_pixels"]

TASKS_PATH = f"{API_PREFIX}/contents/generations/tasks"
_SIZE = re.compile(r"^(\d+)x(\d+)$")
_NAMED_SIDES = {"1k": 1024, "2k": 2048, "4k": 4096}
_DEFAULT_SIZE = "2048x2048"
_AUTO_IMAGES = 2  # what "sequential_image_generation: auto" makes when max_images is not given
# (width, height) by resolution and ratio; Seedance's 720p and 1080p tables (16:9 when not given).
_VIDEO_SIZES = {
    "480p": {"16:9": (864, 480), "4:3": (736, 544), "1:1": (640, 640), "9:16": (480, 864), "21:9": (960, 416)},
    "720p": {"16:9": (1248, 704), "4:3": (1120, 832), "1:1": (960, 960), "9:16": (704, 1248), "21:9": (1504, 640)},
    "1080p": {
        "16:9": (1920, 1088),
        "4:3": (1664, 1248),
        "1:1": (1440, 1440),
        "9:16": (1088, 1920),
        "21:9": (2176, 928),
    },
}
_FPS = 24


def image_pixels(size: object) -> tuple[int, int]:
    """Width and height of a Seedream ``size``: ``WxH`` or ``1K``/``2K``/``4K``."""
    if size is None:
        size = _DEFAULT_SIZE
    if not isinstance(size, str):
        raise _invalid("size", "must be a string")
    named = _NAMED_SIDES.get(size.strip().lower())
    if named:
        return named, named
    found = _SIZE.match(size.strip())
    if not found:
        raise _invalid("size", "must be WxH or 1K, 2K, 4K")
    return int(found.group(1)), int(found.group(2))


def _images(body: dict[str, Any], cfg: SimConfig, ident: str, created: int) -> Generation:
    model = _model(body, cfg)
    _required(body, "prompt")
    width, height = image_pixels(body.get("size"))
    count = 1
    if body.get("sequential_image_generation") == "auto":
        options = body.get("sequential_image_generation_options") or {}
        asked = _opt_count(options, "max_images") if isinstance(options, dict) else None
        count = asked or _AUTO_IMAGES
    each = width * height // 256
    plan = Plan(0, 0, each * count, truncated=False)
    b64 = body.get("response_format") == "b64_json"
    usage = {"generated_images": count, "output_tokens": plan.completion_tokens, "total_tokens": plan.total_tokens}

    def image(index: int) -> dict[str, Any]:
        if b64:
            return {"b64_json": base64.b64encode(f"{ident}-{index}".encode()).decode(), "size": f"{width}x{height}"}
        return {"url": f"https://ark-sim.invalid/images/{ident}-{index}.jpeg", "size": f"{width}x{height}"}

    def render(with_usage: bool) -> dict[str, Any]:
        answer: dict[str, Any] = {"model": model, "created": created, "data": [image(i) for i in range(count)]}
        if with_usage:
            answer["usage"] = usage
        return answer

    def frames(with_usage: bool) -> list[bytes]:
        events = [
            {"type": "image_generation.partial_succeeded", "model": model, "created": created, "image_index": i}
            | image(i)
            for i in range(count)
        ]
        done: dict[str, Any] = {"type": "image_generation.completed", "model": model, "created": created}
        if with_usage:
            done["usage"] = usage
        return [payloads.sse_data(event) for event in [*events, done]] + [payloads.DONE_FRAME]

    return Generation(model=model, plan=plan, stream=_stream(body), body=render, frames=frames)


def _context_create(body: dict[str, Any], cfg: SimConfig, ident: str, created: int) -> Generation:
    model = _model(body, cfg)
    messages = check_messages(body, cfg)
    ttl = _opt_count(body, "ttl") or 86400
    mode = body.get("mode") or "session"
    prompt = chat_prompt_tokens(model, messages)
    plan = Plan(prompt, 0, 0, truncated=False)

    def render(with_usage: bool) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "id": f"ctx-{ident}-t{prompt}",  # the size rides in the id: context chats bill it
            "model": model,
            "mode": mode,
            "ttl": ttl,
            "truncation_strategy": body.get("truncation_strategy") or {"type": "last_history_tokens"},
        }
        if with_usage:
            answer["usage"] = payloads.chat_usage(prompt, 0, 0)
        return answer

    def no_stream(with_usage: bool) -> list[bytes]:
        raise AssertionError("context create never streams")

    return Generation(model=model, plan=plan, stream=False, body=render, frames=no_stream)


MEDIA_ENDPOINTS = {
    f"{API_PREFIX}/images/generations": _images,
    f"{API_PREFIX}/context/create": _context_create,
}


class _Task(Record):
    id: str
    model: str
    created_at: float
    ready_at: float
    tokens: int
    resolution: str
    ratio: str
    duration: int
    status: str = "queued"

    def view(self, now: float) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "id": self.id,
            "model": self.model,
            "status": self.status if self.status != "queued" or now < self.created_at + 0.05 else "running",
            "created_at": int(self.created_at),
            "updated_at": int(min(now, self.ready_at)),
            "resolution": self.resolution,
            "ratio": self.ratio,
            "duration": self.duration,
            "framespersecond": _FPS,
            "seed": 11,
        }
        if self.status == "succeeded":
            answer["content"] = {"video_url": f"https://ark-sim.invalid/videos/{self.id}.mp4"}
            answer["usage"] = {"completion_tokens": self.tokens, "total_tokens": self.tokens}
        return answer


def _text_commands(content: object) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in content if isinstance(content, list) else []:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            found.update(re.findall(r"--(\w+)\s+(\S+)", part["text"]))
    return found


class TaskBook:
    """The simulator's video tasks; thread-safe. ``due`` finishes (and hands over for billing) tasks whose time came."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[str, _Task] = {}

    def create(self, body: Mapping[str, Any], cfg: SimConfig, ident: str, now: float) -> dict[str, Any]:
        model = _model(dict(body), cfg)
        content = _required(dict(body), "content")
        if not isinstance(content, list) or not content:
            raise _invalid("content", "must be a non-empty list of content items")
        commands = _text_commands(content)
        resolution = str(body.get("resolution") or commands.get("rs") or commands.get("resolution") or "720p")
        ratio = str(body.get("ratio") or commands.get("rt") or commands.get("ratio") or "16:9")
        sizes = _VIDEO_SIZES.get(resolution.lower())
        if sizes is None or ratio not in sizes:
            raise _invalid("resolution", f"{resolution} {ratio} is not a supported resolution and ratio")
        duration = body.get("duration") or commands.get("dur") or commands.get("duration") or 5
        if isinstance(duration, bool) or not str(duration).isdigit() or not 1 <= int(duration) <= 15:
            raise _invalid("duration", "must be a whole number of seconds from 1 to 15")
        width, height = sizes[ratio]
        task = _Task(
            id=f"cgt-{ident}",
            model=model,
            created_at=now,
            ready_at=now + cfg.task_s,
            tokens=width * height * _FPS * int(duration) // 1024,
            resolution=resolution,
            ratio=ratio,
            duration=int(duration),
        )
        with self._lock:
            self._tasks[task.id] = task
        return {"id": task.id}

    def due(self, now: float) -> list[_Task]:
        """Tasks that finished by ``now`` since the last call: each is billed once, at its ready time."""
        with self._lock:
            finished = [t for t in self._tasks.values() if t.status == "queued" and t.ready_at <= now]
            for task in finished:
                task.status = "succeeded"
        return finished

    def view(self, task_id: str, now: float) -> dict[str, Any]:
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None:
                raise ArkError(404, "ResourceNotFound", f"The task {task_id} does not exist.")
            return task.view(now)

    def listing(self, now: float) -> dict[str, Any]:
        with self._lock:
            items = [task.view(now) for task in sorted(self._tasks.values(), key=lambda t: -t.created_at)]
        return {"total": len(items), "items": items}

    def cancel(self, task_id: str, now: float) -> dict[str, Any]:
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None:
                raise ArkError(404, "ResourceNotFound", f"The task {task_id} does not exist.")
            if task.status == "queued":
                task.status = "cancelled"
            return task.view(now)

    def reset(self) -> None:
        with self._lock:
            self._tasks.clear()
