"""Property tests of the claims quotawrap.core.tokens rests on, against the real bundled tokenizers.

* the UTF-8 byte count is an upper bound of the token count (the estimate uses it for short
  inputs without loading a tokenizer, so an undercount there would let a call through unpaid);
* a text cut by ``pieces`` counts exactly as the whole (long inputs are counted piece by piece).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotawrap.core.tokens import CL100K_OFFLINE, DEEPSEEK_TOKENIZER, TokenCounter, count_tokens, pieces, utf8_bound
from quotawrap.core.tokens import _default_cache as cache

TOKENIZERS = [CL100K_OFFLINE, DEEPSEEK_TOKENIZER]
MODELS = {CL100K_OFFLINE: "doubao-seed-1-6-250615", DEEPSEEK_TOKENIZER: "deepseek-v3-2-251201"}
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text made of what decides where pre-tokens end: letters, digits, spaces, line breaks, CJK and its
# punctuation, other scripts, marks, symbols, emoji, special-token look-alikes, lone surrogates.
_ATOMS = st.sampled_from(
    [
        "a", "Z", "word", " ", "  ", "\n", "\r\n", "\n\n", "\t", "7", "2024", "'s", "'t", ".", ",", "!?", "-",
        "天", "空", "彩虹", "，", "。", "、", "！", "ひら", "カタ", "한국", "мир", "é", "e\u0301", "ـ", "٣",
        "😀", "👍🏽", "\u200b", "<|endoftext|>", "<｜end▁of▁sentence｜>", "\ud800", "{\"k\":", "1.5e3",
    ]
)  # fmt: skip
TEXTS = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(_ATOMS, st.text(max_size=3)), max_size=120).map("".join),
)


def _counter(name: str) -> TokenCounter:
    try:
        return cache.counter(name)
    except Exception as exc:  # pragma: no cover - a broken install is its own test's failure
        pytest.skip(f"{name} unavailable: {exc}")


@pytest.mark.parametrize("name", TOKENIZERS)
@FUZZ
@given(text=TEXTS)
def test_utf8_bytes_bound_the_token_count(name: str, text: str) -> None:
    """No text has more tokens than UTF-8 bytes, in either tokenizer (lone surrogates included)."""
    assert _counter(name)(text) <= utf8_bound(text)


@pytest.mark.parametrize("name", TOKENIZERS)
@FUZZ
@given(text=TEXTS, size=st.integers(1, 40))
def test_pieces_count_as_the_whole(name: str, text: str, size: int) -> None:
    """Cut wherever ``pieces`` cuts (tiny pieces: many cuts), the counts add up to the whole's."""
    count = _counter(name)
    cut = list(pieces(text, size=size, largest=10**9))
    assert "".join(piece for piece, _ in cut) == text
    assert sum(count(piece) for piece, _ in cut) == count(text)


@pytest.mark.parametrize("name", TOKENIZERS)
@FUZZ
@given(text=TEXTS, size=st.integers(1, 40), largest=st.integers(1, 60))
def test_uncuttable_stretches_stay_an_upper_bound(name: str, text: str, size: int, largest: int) -> None:
    """Pieces too long to tokenize are bounded by their bytes: the sum never falls below the count."""
    count = _counter(name)
    total = sum(count(piece) if exact else utf8_bound(piece) for piece, exact in pieces(text, size, largest))
    assert total >= count(text)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_count_tokens_of_a_long_text_is_exact(name: str) -> None:
    """A text long enough to be counted in pieces gets the same count as one encode of it."""
    text = ("The sky is blue.\n彩虹有七种颜色，红橙黄绿蓝靛紫。\nline 42 ok\n" * 6_000)[:400_000]
    assert count_tokens(MODELS[name], text) == _counter(name)(text)
