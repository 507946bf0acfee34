"""`POST /tokenize` and `POST /detokenize` in both peers' shapes, one route each.

Clients count tokens before they send (agents fitting a context, eval harnesses) with
whichever server they were written for, so each route reads the body by the fields it
has:

    llama-server  {"content", "add_special"?, "parse_special"?, "with_pieces"?}
                  → {"tokens": [id, …]} (with pieces: [{"id", "piece"}, …])
                  {"tokens": [id, …]} → {"content": text}
    vLLM          {"model", "prompt", "add_special_tokens"?}  or
                  {"model", "messages", "add_generation_prompt"?, "tools"?, …}
                  → {"count", "max_model_len", "tokens", "token_strs"}
                  {"model", "tokens"} → {"prompt": text}

Messages are counted as the chat route reads them (`api.pipeline.prepare.count_tokens`: the same
template, tool prompt and limits), so the count is the prompt a completion would get.
Tokenizing runs in a worker thread, as every prompt does (api.pipeline.prompts).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from api.pipeline.chat_messages import ChatMessage, Tool, chat_messages
from api.pipeline.prepare import count_tokens
from api.pipeline.request import Chat, GenerationRequest, Tools
from api.pipeline.respond import json_response
from api.pipeline.validation import check_model
from api.server.body import read_json
from api.server.errors import InvalidRequest
from api.server.state import ServerState, server_state


class TokenizeRequest(Struct, kw_only=True):
    # llama-server's
    content: str | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    # vLLM's
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # (a prompt's; a chat's template writes its own)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None  # present: vLLM's shape


class Piece(Struct):
    id: int
    piece: str | list[int]  # the token's text; its bytes where they are not UTF-8 alone


class LlamaTokens(Struct):
    tokens: list[int | Piece]


class VllmTokens(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class LlamaText(Struct):
    content: str


class VllmText(Struct):
    prompt: str


TOKENIZE_DECODER = msgspec.json.Decoder(TokenizeRequest)
DETOKENIZE_DECODER = msgspec.json.Decoder(DetokenizeRequest)


async def tokenize(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request, TOKENIZE_DECODER, state.settings.limits)
    if body.model is not None:
        check_model(state, body.model)
    if body.messages is not None:
        ids = await _chat_ids(state, body, body.messages)
    elif body.prompt is not None:
        ids = await _off_loop(state, _ids, state, body.prompt, body.add_special_tokens, True)
    elif body.content is not None:
        ids = await _off_loop(state, _ids, state, body.content, body.add_special,
                              body.parse_special)  # fmt: skip
        if body.with_pieces:
            return json_response(LlamaTokens(await _off_loop(state, _pieces, state, ids)))
        plain: list[int | Piece] = list(ids)
        return json_response(LlamaTokens(plain))
    else:
        raise InvalidRequest(
            "tokenize needs `content` (llama-server's shape), or `prompt` or `messages` "
            "(vLLM's)", param="content",
        )  # fmt: skip
    strs = await _off_loop(state, _strs, state, ids) if body.return_token_strs else None
    return json_response(VllmTokens(len(ids), state.max_model_len, ids, strs))


async def detokenize(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request, DETOKENIZE_DECODER, state.settings.limits)
    if body.model is not None:
        check_model(state, body.model)
    n_vocab = state.model.n_vocab
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token ids must be in [0, {n_vocab})", param=f"tokens[{bad}]")
    text = await _off_loop(state, _text, state, body.tokens)
    return json_response(LlamaText(text) if body.model is None else VllmText(text))


async def _chat_ids(
    state: ServerState, body: TokenizeRequest, messages: list[ChatMessage]
) -> list[int]:
    if not messages:
        raise InvalidRequest("messages is empty", param="messages")
    chat = Chat(
        chat_messages(messages, state.settings.limits.max_messages),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs or {},
    )
    tools = Tools([msgspec.to_builtins(t) for t in body.tools] if body.tools else None)
    req = GenerationRequest(f"tokenize-{uuid.uuid4().hex}", chat, tools=tools)
    prompts = await count_tokens(state, req)
    return prompts[0].ids


T = TypeVar("T")


async def _off_loop(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """Work in proportion to the body (up to --max-request-bytes) in a worker thread, as
    every prompt's tokenizing is (api.pipeline.prompts): the event loop keeps streaming."""
    return await anyio.to_thread.run_sync(partial(fn, *args), limiter=state.prompt_workers)


def _ids(state: ServerState, text: str, add_special: bool, parse_special: bool) -> list[int]:
    return state.model.tokenize(text, add_special=add_special, parse_special=parse_special)


def _text(state: ServerState, tokens: list[int]) -> str:
    """The tokens' text, special tokens by name (as both peers detokenize by default)."""
    return b"".join(state.model.token_text(t) for t in tokens).decode("utf-8", "replace")


def _strs(state: ServerState, tokens: list[int]) -> list[str]:
    return [_text(state, [t]) for t in tokens]


def _pieces(state: ServerState, tokens: list[int]) -> list[int | Piece]:
    out: list[int | Piece] = []
    for t in tokens:
        raw = state.model.token_text(t)
        try:
            out.append(Piece(t, raw.decode("utf-8")))
        except UnicodeDecodeError:
            out.append(Piece(t, list(raw)))
    return out
