"""How many tokens an image or video request may be billed, read from its body. Pure: no I/O.

Seedream (``/images/generations``) bills each generated image about ``width x height / 256``
tokens (and is priced per image); Seedance (``/contents/generations/tasks``) bills a video about
``width x height x fps x seconds / 1024`` tokens. Both formulas are the provider's rough rule
(notes: ark-and-tokenizers §5): the settle uses the usage the provider reports, so these only
have to lean high. Whatever the request leaves open is assumed at its dearest:

* an image size that is absent is Seedream 4's default 2048x2048; one we cannot read is 4K;
* ``sequential_image_generation: "auto"`` may make up to ``max_images`` images (Ark's bound 15);
* a video resolution that is absent is 1080p, one we cannot read is 4K; a duration that is
  absent (or -1, "let the model choose") is 15 s, Seedance's longest; fps is 24.

Seedance 1.0 also takes these as commands in the prompt text (``--rs 720p --dur 5 --fps 24``);
body fields win over commands.

A field of the wrong type raises ``ValueError`` naming it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_IMAGES",
    "image_count",
    "image_tokens_each",
    "video_tokens",
]

MAX_IMAGES = 15  # Ark: reference images + generated images <= 15
_DEFAULT_IMAGE_SIDE = 2048
_NAMED_SIZES = {"1k": 1024 * 1024, "2k": 2048 * 2048, "3k": 3072 * 3072, "4k": 4096 * 4096}
_SIZE = re.compile(r"^\s*(\d+)\s*[x*×]\s*(\d+)\s*$", re.IGNORECASE)

# Pixels per frame by resolution, the largest over Seedance's aspect ratios (4:3 at 1080p is
# 1664x1248, a little over 1920x1080).
_VIDEO_PIXELS = {
    "480p": 864 * 496,
    "720p": 1280 * 720 + 4000,
    "1080p": 1664 * 1248,
    "2k": 2560 * 1440,
    "4k": 3840 * 2160,
}
_DEFAULT_RESOLUTION = "1080p"
_LARGEST_RESOLUTION = "4k"
_DEFAULT_SECONDS = 15
_DEFAULT_FPS = 24
_COMMAND = re.compile(r"--(rs|resolution|dur|duration|fps|framepersecond|frames)\s+(\S+)")


def image_tokens_each(body: Mapping[str, Any]) -> int:
    """Most tokens one image of this request may be billed."""
    size = body.get("size")
    if size is None:
        pixels = _DEFAULT_IMAGE_SIDE * _DEFAULT_IMAGE_SIDE
    elif not isinstance(size, str):
        raise ValueError(f"'size' must be a string, got {type(size).__name__}")
    else:
        pixels = _image_pixels(size)
    return math.ceil(pixels / 256)


def _image_pixels(size: str) -> int:
    found = _SIZE.match(size)
    if found:
        return int(found.group(1)) * int(found.group(2))
    return _NAMED_SIZES.get(size.strip().lower(), _NAMED_SIZES["4k"])


def image_count(body: Mapping[str, Any]) -> int:
    """Most images the request may generate."""
    count = _whole(body.get("n"), "n") or 1
    if body.get("sequential_image_generation") == "auto":
        options = body.get("sequential_image_generation_options")
        if options is not None and not isinstance(options, Mapping):
            raise ValueError("'sequential_image_generation_options' must be a JSON object")
        asked = _whole((options or {}).get("max_images"), "sequential_image_generation_options.max_images")
        count = max(count, asked or MAX_IMAGES)
    return count


def video_tokens(body: Mapping[str, Any]) -> int:
    """Most tokens a video task may be billed."""
    commands = _prompt_commands(body.get("content"))
    # SDKs send every parameter, null when not given: a null field falls back to the prompt's command
    resolution = _given(body, "resolution", commands.get("rs") or commands.get("resolution"))
    if body.get("draft") is True and resolution is None:
        resolution = "480p"
    if resolution is not None and not isinstance(resolution, str):
        raise ValueError(f"'resolution' must be a string, got {type(resolution).__name__}")
    pixels = _VIDEO_PIXELS.get((resolution or _DEFAULT_RESOLUTION).strip().lower(), _VIDEO_PIXELS[_LARGEST_RESOLUTION])
    fps = _whole(_given(body, "framespersecond", _command_number(commands, "fps", "framepersecond")), "fps")
    fps = fps or _DEFAULT_FPS
    frames = _whole(_given(body, "frames", _command_number(commands, "frames")), "frames")
    if not frames or frames < 0:
        seconds = _whole(_given(body, "duration", _command_number(commands, "dur", "duration")), "duration")
        frames = (seconds if seconds and seconds > 0 else _DEFAULT_SECONDS) * fps
    return math.ceil(pixels * frames / 1024)


def _given(body: Mapping[str, Any], name: str, fallback: object) -> object:
    value = body.get(name)
    return fallback if value is None else value


def _prompt_commands(content: object) -> dict[str, str]:
    """``--rs 720p``-style commands in the text parts of a task's content, later ones winning."""
    commands: dict[str, str] = {}
    if not isinstance(content, list):
        return commands
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            for name, value in _COMMAND.findall(part["text"]):
                commands[name] = value
    return commands


def _command_number(commands: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = commands.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"prompt command --{name} must be a whole number, got {value!r}") from None
    return None


def _whole(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{name}' must be an integer, got {value!r}")
    return value
