"""Stop strings over streamed text: never emit a stop string, even split across tokens.

Text that might be the start of a stop string is held back until the next token settles
it, so a stream never shows characters that later turn out to belong to a stop.
"""

from __future__ import annotations


class StopMatcher:
    __slots__ = ("_pending", "hit", "stops")

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.hit: str | None = None  # the stop string that ended the text, once one did

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        pending = self._pending + text
        cut = -1
        for s in self.stops:
            i = pending.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, self.hit = i, s
        if cut != -1:
            self._pending = ""
            return pending[:cut], True
        hold = self._holdback(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        """At the end of generation the held-back text was not a stop after all."""
        out, self._pending = self._pending, ""
        return out

    def _holdback(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
