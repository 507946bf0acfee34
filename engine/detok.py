"""Incremental detokenization: token bytes in, text out, UTF-8 characters never split.

A character can span several tokens (byte-fallback pieces); the incremental decoder keeps
the incomplete tail until the rest arrives, so each streamed delta is valid text.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class IncrementalDetokenizer:
    """Turns a sequence's generated tokens into text deltas."""

    __slots__ = ("_decoder", "_piece")

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._piece = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        return self._decoder.decode(self._piece(token))

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
