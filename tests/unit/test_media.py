"""Tests for quotawrap.core.media: the most an image or video request may be billed."""

from __future__ import annotations

from typing import Any

import pytest

from quotawrap.core.media import MAX_IMAGES, image_count, image_tokens_each, video_tokens


class TestImageTokensEach:
    @pytest.mark.parametrize(
        ("size", "tokens"),
        [("1024x1024", 4096), ("2048X1152", 9216), ("1K", 4096), ("2k", 16384), ("4K", 65536), (None, 16384)],
    )
    def test_width_times_height_over_256(self, size: str | None, tokens: int) -> None:
        """WxH and the named sizes bill w*h/256 each; no size is Seedream 4's default 2048x2048."""
        body = {} if size is None else {"size": size}
        assert image_tokens_each(body) == tokens

    def test_an_unreadable_size_is_assumed_4k(self) -> None:
        """A size we cannot read (adaptive, a future name) is priced as the largest."""
        assert image_tokens_each({"size": "adaptive"}) == 4096 * 4096 // 256

    def test_a_size_of_the_wrong_type_is_an_error(self) -> None:
        """A size that is not a string is refused with its name."""
        with pytest.raises(ValueError, match="size"):
            image_tokens_each({"size": 1024})


class TestImageCount:
    @pytest.mark.parametrize(
        ("body", "count"),
        [
            ({}, 1),
            ({"n": 3}, 3),
            ({"sequential_image_generation": "disabled"}, 1),
            ({"sequential_image_generation": "auto"}, MAX_IMAGES),
            ({"sequential_image_generation": "auto", "sequential_image_generation_options": {"max_images": 4}}, 4),
            ({"sequential_image_generation": "auto", "sequential_image_generation_options": None}, MAX_IMAGES),
        ],
    )
    def test_every_image_the_request_may_make(self, body: dict[str, Any], count: int) -> None:
        """One image, n images, or up to max_images (Ark's bound 15 when not given) in sequential mode."""
        assert image_count(body) == count

    def test_bad_options_are_an_error(self) -> None:
        """Options that are not an object are refused with their name."""
        with pytest.raises(ValueError, match="sequential_image_generation_options"):
            image_count({"sequential_image_generation": "auto", "sequential_image_generation_options": [4]})


class TestVideoTokens:
    def test_fields_give_pixels_fps_and_seconds(self) -> None:
        """720p for 5 s at 24 fps: the 720p pixel budget x 120 frames / 1024."""
        assert video_tokens({"resolution": "720p", "duration": 5}) == -(-(1280 * 720 + 4000) * 120 // 1024)

    def test_prompt_commands_stand_in_for_null_fields(self) -> None:
        """The SDK sends resolution/duration as null; Seedance 1.0's --rs/--dur commands then count."""
        body = {
            "resolution": None,
            "duration": None,
            "content": [{"type": "text", "text": "a kite --rs 480p --dur 4"}],
        }
        assert video_tokens(body) == -(-864 * 496 * 96 // 1024)

    def test_fields_win_over_commands(self) -> None:
        """When both are given, the body field is what Ark uses."""
        body = {"resolution": "480p", "content": [{"type": "text", "text": "x --rs 1080p --dur 5"}]}
        assert video_tokens(body) == video_tokens({"resolution": "480p", "duration": 5})

    def test_frames_replace_duration(self) -> None:
        """A frame count bounds the video directly."""
        assert video_tokens({"resolution": "480p", "frames": 48}) == video_tokens({"resolution": "480p", "duration": 2})

    def test_nothing_given_is_the_dearest_common_case(self) -> None:
        """No resolution or duration: 1080p for 15 s (Seedance's longest), never less than a 5 s request."""
        assert video_tokens({}) == video_tokens({"resolution": "1080p", "duration": 15})
        assert video_tokens({"duration": -1}) == video_tokens({})
        assert video_tokens({}) > video_tokens({"resolution": "1080p", "duration": 5})

    def test_an_unknown_resolution_is_assumed_4k(self) -> None:
        """A resolution we do not know is priced as 4K."""
        assert video_tokens({"resolution": "8k", "duration": 5}) == video_tokens({"resolution": "4k", "duration": 5})

    def test_draft_is_480p(self) -> None:
        """Draft mode renders at 480p unless told otherwise."""
        assert video_tokens({"draft": True, "duration": 5}) == video_tokens({"resolution": "480p", "duration": 5})

    @pytest.mark.parametrize(
        "body",
        [{"duration": "5"}, {"resolution": 720}, {"content": [{"type": "text", "text": "x --dur five"}]}],
    )
    def test_bad_values_are_errors(self, body: dict[str, Any]) -> None:
        """Values of the wrong type are refused, never silently read as the default."""
        with pytest.raises(ValueError):
            video_tokens(body)
