"""Checks a decoded request must pass before any work is done for it.

What the server does not implement is refused by name with a 400 — tools, vLLM's and
llama.cpp's constrained-output fields, logit bias, images … — because a client that sent
them relies on them, and an answer that silently ignored them would look right and be
wrong. Sizes are bounded here too, before rendering or tokenizing: the number of
messages, stop strings.
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import InvalidRequest, Unsupported
from api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    ToolCall,
)
from api.state import ServerState
from engine.chat_template import RESERVED, ChatTemplate
from engine.native_step import MAX_BIAS

# role -> the role the chat template sees ("developer" is OpenAI's newer name for system)
ROLES = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant",
    "tool": "tool",
}  # fmt: skip
MAX_STOP_CHARS = 1000  # one stop string: matched against every streamed token's text


def _asks_nothing(value: Any) -> bool:
    """The values that leave the output as it is without the field."""
    return value is None or value == [] or value == {} or value == 0 or value is False


def _refuse(field: str, what: str) -> Unsupported:
    return Unsupported(f"`{field}` is not supported by this server yet ({what})", param=field)


def refuse_unsupported(req: SamplingFields) -> None:
    """A 400 naming the first field that asks for something not served yet."""
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar",
                 "json_schema"):  # fmt: skip
        if not _asks_nothing(getattr(req, name)):
            raise _refuse(name, "constrained output")
    if isinstance(req, ChatCompletionRequest):
        _refuse_chat_only(req)
    elif isinstance(req, CompletionRequest) and req.best_of not in (None, 1, req.n):
        raise _refuse("best_of", "best-of sampling; ask for `n` choices instead")


def _refuse_chat_only(req: ChatCompletionRequest) -> None:
    if not _asks_nothing(req.functions):
        raise _refuse("functions", "function calls")
    if req.function_call not in (None, "none"):
        raise _refuse("function_call", "function calls")
    if not _asks_nothing(req.audio):
        raise _refuse("audio", "audio output")
    if req.modalities not in (None, ["text"]):
        raise _refuse("modalities", "only text is served")
    if not _asks_nothing(req.prediction):
        raise _refuse("prediction", "predicted outputs")


def chat_messages(messages: list[ChatMessage], max_messages: int) -> list[dict[str, Any]]:
    """The messages as the chat template takes them, text only; a 400 for a role, part or
    field that cannot be served, naming where it is."""
    if len(messages) > max_messages:
        raise InvalidRequest(
            f"{len(messages)} messages; this server accepts at most {max_messages} per request "
            "(--max-messages)",
            param="messages",
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = ROLES.get(m.role)
        if role is None:
            if m.role == "function":
                raise _refuse(f"{where}.role", "role 'function' (use 'tool')")
            raise InvalidRequest(
                f"role {m.role!r} is not one of {', '.join(ROLES)}", param=f"{where}.role"
            )
        msg: dict[str, Any] = {"role": role, "content": _text(m, where)}
        if m.tool_calls:
            if role != "assistant":
                raise InvalidRequest("only assistant messages have tool_calls",
                                     param=f"{where}.tool_calls")  # fmt: skip
            msg["tool_calls"] = [_call_for_template(c, f"{where}.tool_calls[{j}]")
                                 for j, c in enumerate(m.tool_calls)]  # fmt: skip
        if role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequest("a tool message needs tool_call_id",
                                     param=f"{where}.tool_call_id")  # fmt: skip
            msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        out.append(msg)
    return out


class TemplateArguments(dict[str, Any]):
    """A call's arguments as templates read them: an object for those that write it with
    `tojson` (transformers' convention; Qwen's), its JSON text for those that add it to a
    string or print it (DeepSeek's)."""

    def __init__(self, text: str, value: dict[str, Any]) -> None:
        super().__init__(value)
        self._text = text

    def __str__(self) -> str:
        return self._text

    def __add__(self, other: object) -> str:
        return self._text + str(other)

    def __radd__(self, other: object) -> str:
        return str(other) + self._text


def _call_for_template(c: ToolCall, where: str) -> dict[str, Any]:
    """A call as templates read it; arguments as `TemplateArguments`."""
    param = f"{where}.function.arguments"
    try:
        args = json.loads(c.function.arguments)
    except ValueError:
        raise InvalidRequest("arguments are not JSON", param=param) from None
    if not isinstance(args, dict):
        raise InvalidRequest("arguments are not a JSON object", param=param)
    return {"id": c.id, "type": "function",
            "function": {"name": c.function.name,
                         "arguments": TemplateArguments(c.function.arguments, args)}}  # fmt: skip


def _text(m: ChatMessage, where: str) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise _refuse(f"{where}.content[{j}].type", f"{part.type!r} parts: text only")
        if part.text is None:
            raise InvalidRequest("a text part needs `text`", param=f"{where}.content[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def check_stops(stops: tuple[str, ...]) -> None:
    for i, s in enumerate(stops):
        if not s:
            raise InvalidRequest("a stop string cannot be empty", param=f"stop[{i}]")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"a stop string may have at most {MAX_STOP_CHARS} characters", param=f"stop[{i}]"
            )


def logit_bias(req: SamplingFields, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token, bias) pairs: keys are token ids of this model's vocabulary
    (as strings, JSON's object keys), values are clamped to [-100, 100] as OpenAI does."""
    raw = req.logit_bias
    if _asks_nothing(raw):
        return ()
    if not isinstance(raw, dict):
        raise InvalidRequest("logit_bias must map token ids to numbers", param="logit_bias")
    if len(raw) > MAX_BIAS:
        raise InvalidRequest(f"logit_bias: at most {MAX_BIAS} tokens", param="logit_bias")
    out = []
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id", param="logit_bias"
            ) from None
        if not 0 <= token < n_vocab:
            raise InvalidRequest(
                f"logit_bias token {token} is not in the vocabulary (0..{n_vocab - 1})",
                param="logit_bias",
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise InvalidRequest(f"logit_bias value for {key!r} must be a number",
                                 param="logit_bias")  # fmt: skip
        out.append((token, float(min(100.0, max(-100.0, value)))))
    return tuple(out)


def min_tokens(req: SamplingFields, max_tokens: int | None) -> int:
    """`min_tokens` (vLLM's): end-of-generation tokens are not sampled before this many."""
    n = req.min_tokens
    if _asks_nothing(n):
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidRequest("min_tokens must be a non-negative integer", param="min_tokens")
    if max_tokens is not None and n > max_tokens:
        raise InvalidRequest(f"min_tokens ({n}) is more than max_tokens ({max_tokens})",
                             param="min_tokens")  # fmt: skip
    return n


def chat_rendering(
    state: ServerState, req: ChatCompletionRequest, messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> ChatTemplate:  # fmt: skip
    """The server's template bound to this request's rendering options (vLLM's fields)."""
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt: false",
                param="continue_final_message",
            )
        if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
            raise InvalidRequest(
                "continue_final_message needs a last assistant message with text to continue",
                param="continue_final_message",
            )
    kwargs = req.chat_template_kwargs or {}
    for name in kwargs:
        if name in RESERVED:
            raise InvalidRequest(
                f"chat_template_kwargs cannot set {name!r}: the server sets it",
                param="chat_template_kwargs",
            )
    return state.template.bind(
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        variables=kwargs,
        tools=tools,
    )
