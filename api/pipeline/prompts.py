"""Prompts to token ids, off the event loop and bounded before the work starts.

Rendering a chat template and tokenizing take time in proportion to the request (a
700 KB chat body took seconds); on the event loop that time would freeze every stream
and /health. So the work runs in a worker thread (llama.cpp's tokenizer releases the GIL),
a few at a time, and a prompt that cannot fit is refused first by its length in
characters: no token renders to more than the vocabulary's longest token, so a prompt
of C characters has at least C / longest tokens.

This is also the whole of the tokenize-only path (token counting): it needs nothing
queued and nothing sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio

from api.pipeline.rendering import render
from api.pipeline.request import Chat, GenerationRequest
from api.pipeline.tool_calls import ToolSetup
from api.server.errors import ContextLengthExceeded, InvalidRequest
from api.server.state import ServerState
from engine.chat_template import ChatTemplate, ChatTemplateError
from engine.chat_tokens import chat_prompt_ids


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt's token ids. `system_end`: where a chat's system block ends, a point
    the prefix cache may offer to others (0: none; see `scheduler.core`)."""

    ids: list[int]
    system_end: int = 0


async def tokenize(
    state: ServerState, req: GenerationRequest, tools: ToolSetup, limit: int
) -> list[Prompt]:
    """The request's prompts as token ids, each refused (400) unless it could fit `limit`."""
    if isinstance(req.input, Chat):
        messages, template = render(
            state.template, req.input, tools, state.system_role, state.system_between
        )
        return [await _chat_prompt(state, messages, limit, template)]
    return await _completion_prompts(state, req.input.prompt, limit)


def _at_least(n_chars: int, state: ServerState) -> int:
    """A lower bound on the tokens of a text of `n_chars` characters (each at least a
    byte, every token at most the longest token's bytes)."""
    return -(-n_chars // state.longest_token_bytes)


def _refuse_if_too_long(n_chars: int, limit: int, state: ServerState, param: str) -> None:
    at_least = _at_least(n_chars, state)
    if at_least >= limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, the prompt "
            f"has {n_chars} characters, which is at least {at_least} tokens. Please reduce "
            "the prompt.",
            param=param,
        )


async def _chat_prompt(
    state: ServerState, messages: list[dict[str, Any]], limit: int, template: ChatTemplate
) -> Prompt:
    """The chat's token ids: template text with its special tokens, message content as
    plain text (engine.chat_tokens). On a sliding-window model, also where its system
    block ends: the prefix cache can let others read a prompt only at points it offers
    (scheduler.prefix), and that one is where prompts behind one system prompt part."""
    _refuse_if_too_long(sum(len(m["content"]) for m in messages), limit, state, "messages")
    model = state.model

    def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return model.tokenize(text, add_special=add_special, parse_special=parse_special)

    work = partial(
        chat_prompt_ids, template, messages, tokenize, model.is_control,
        add_bos=model.add_bos, bos_token=model.bos_token, find_system_end=model.n_swa > 0,
    )  # fmt: skip
    try:
        prompt = await anyio.to_thread.run_sync(work, limiter=state.prompt_workers)
    except ChatTemplateError as e:
        raise InvalidRequest(str(e), param="messages") from None
    return Prompt(prompt.ids, prompt.system_end)


async def _completion_prompts(
    state: ServerState, prompt: str | list[str | int], limit: int
) -> list[Prompt]:
    """Each prompt's token ids (a string, a list of strings, or one list of token ids)."""
    model = state.model
    if isinstance(prompt, str):
        texts = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        ids = [int(p) for p in prompt]
        if any(not 0 <= t < model.n_vocab for t in ids):
            raise InvalidRequest(f"token ids must be in [0, {model.n_vocab})", param="prompt")
        return [Prompt(ids)]
    elif all(isinstance(p, str) for p in prompt):
        texts = [str(p) for p in prompt]
    else:
        raise InvalidRequest(
            "prompt must be a string, a list of strings or of token ids", param="prompt"
        )
    for text in texts:
        _refuse_if_too_long(len(text), limit, state, "prompt")

    def tokenize_all() -> list[Prompt]:
        return [Prompt(model.tokenize(t, add_special=True, parse_special=True)) for t in texts]

    return await anyio.to_thread.run_sync(tokenize_all, limiter=state.prompt_workers)
