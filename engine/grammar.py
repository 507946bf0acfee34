"""Constrained decoding: a grammar per sequence gives a token mask per step (llguidance).

Why llguidance: its masks are computed lazily over a token trie, tens of microseconds for
most steps on a 128K vocabulary where llama.cpp's GBNF sampler takes ~15 ms a full mask;
a JSON schema compiles in about a millisecond (xgrammar: ~0.5 s, and it needs torch); it
releases the GIL while it computes (so masks overlap `llama_decode`, see
`engine.sampling`); it has no dependencies of its own and reads llama.cpp's vocabulary
directly. `bench/mask_time.py` measures it on the served model.

A grammar is compiled once per request (`Grammars.compile`: a 400 naming the field when
it is not valid) and each sequence gets its own matcher (`Constraint`): it takes every
sampled token, and before each sampled step writes the set of allowed next tokens as a
bitmask row (token t allowed when bit t % 32 of word t // 32 is set). Once the grammar is
complete its mask allows only end-of-generation tokens, so the sequence ends as any other.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.errors import GrammarError

log = logging.getLogger(__name__)

# JSON as a model should write it: no unbounded runs of whitespace between tokens (the
# schema compiler's default allows any, and a small model can fill max_tokens with it).
_WHITESPACE_FLEXIBLE = False


def mask_words(n_vocab: int) -> int:
    """32-bit words in one mask row."""
    return (n_vocab + 31) // 32


class Grammars:
    """The model's grammar tokenizer and grammar compilation. Thread-safe.

    The tokenizer is built once, at server start (`tokenizer`): llguidance's build holds
    the GIL for most of a second on a 262K vocabulary, which while serving would freeze
    every stream; the token pieces are read here rather than by `llguidance.llamacpp`
    (a third of its time, and no deprecated llama.cpp calls)."""

    def __init__(
        self, vocab_ptr: int, tokenize_fn: int, pieces: Callable[[], list[bytes]],
        eog: Callable[[], list[int]],
    ) -> None:  # fmt: skip
        self._vocab_ptr = vocab_ptr
        self._tokenize_fn = tokenize_fn
        self._pieces = pieces
        self._eog = eog
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                self._tokenizer = LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
                    tokens=self._pieces(), vocab_ptr=self._vocab_ptr,
                    tokenize_fptr=self._tokenize_fn, eos_token=self._eog(), slices=None,
                )  # fmt: skip
            return self._tokenizer

    def json_schema(self, schema: dict[str, Any] | bool) -> str:
        """A grammar for JSON valid under `schema`; `GrammarError` if it cannot be one."""
        from llguidance import LLMatcher

        if schema is True:  # (JSON Schema's "anything")
            schema = {}
        elif not isinstance(schema, dict):
            raise GrammarError("the schema must be a JSON object")
        try:
            grammar = LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": _WHITESPACE_FLEXIBLE}
            )
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return self.validate(grammar)

    def json_object(self) -> str:
        """Any JSON object (OpenAI's `json_object` mode)."""
        return self.json_schema({"type": "object"})

    def validate(self, grammar: str) -> str:
        from llguidance import LLMatcher

        err = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise GrammarError(f"invalid schema: {err}")
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


class Constraint:
    """One sequence's matcher. Not thread-safe: its tokens and masks are strictly ordered
    (the engine consumes a step's token before the next step's mask is asked for)."""

    def __init__(self, grammars: Grammars, grammar: str) -> None:
        from llguidance import LLMatcher

        self._m = LLMatcher(grammars.tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())

    def consume(self, tokens: list[int]) -> None:
        """Tokens sampled (or replayed, for a restarted sequence) under this grammar. A
        token it refuses (an end token past the end, nothing else can be sampled) ends
        the constraint's use: the mask then allows end tokens only."""
        if tokens and not self._m.consume_tokens(tokens):
            log.debug("grammar refused a token: %s", self._m.get_error())

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (uint32/int32, `mask_words` long)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @property
    def done(self) -> bool:
        return bool(self._m.is_stopped() or self._m.is_error())
