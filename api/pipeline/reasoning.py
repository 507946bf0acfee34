"""A chat answer's reasoning, split from its content: DeepSeek R1 style `<think>` … `</think>`.

Models whose chat template speaks of `<think>` (DeepSeek R1, Qwen3 …) write their reasoning
first; OpenAI-style clients (and vLLM, llama-server) expect it in
`message.reasoning_content` / `delta.reasoning_content` and only the answer in `content`.
The model either opens the block itself (`<think>` at the start of its output) or the
template already did (the prompt ends with it). `--reasoning-format none` keeps the text
as the model wrote it.

Streaming splits on the fly: text that could still be the start of `</think>` (or of a
leading `<think>`) is held back until the next piece settles it, so neither tag ever
reaches a client, whichever pieces the tokens cut it into.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(source: str) -> bool:
    """Whether a chat template is one of a reasoning model (it writes `<think>`)."""
    return OPEN in source


class ReasoningSplit:
    """One choice's text, fed in the pieces it is streamed in."""

    def __init__(self, prompt_tail: str) -> None:
        # the template opened the block: everything up to `</think>` is reasoning
        self._in_reasoning = prompt_tail.rstrip().endswith(OPEN)
        self._started = self._in_reasoning  # (else a leading `<think>` may still come)
        self._held = ""
        self._strip = False  # newlines right after a tag are the tag's, not the text's
        self.reasoning = ""  # all of it so far, for the whole response
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that `text` settles (either may be empty)."""
        buf = self._held + text
        self._held = ""
        reasoning = content = ""
        if not self._started:
            stripped = buf.lstrip()
            if OPEN.startswith(stripped) and len(stripped) < len(OPEN):
                self._held = buf  # maybe the start of `<think>`: wait
                return "", ""
            self._started = True
            if stripped.startswith(OPEN):
                self._in_reasoning, self._strip = True, True
                buf = stripped[len(OPEN) :]
        if self._strip:
            buf = buf.lstrip("\n")
            self._strip = not buf
        if self._in_reasoning:
            at = buf.find(CLOSE)
            if at < 0:
                keep = partial_suffix(buf, CLOSE)
                reasoning, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
            else:
                reasoning = buf[:at]
                self._in_reasoning = False
                content = buf[at + len(CLOSE) :].lstrip("\n")
                self._strip = not content
        else:
            content = buf
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """At the end of the answer: what was held back, as what it turned out to be."""
        held, self._held = self._held, ""
        if self._in_reasoning:
            self.reasoning += held
            return held, ""
        self.content += held
        return "", held


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
