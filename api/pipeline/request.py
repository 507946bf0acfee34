"""The one internal request every API route decodes into (api.pipeline.prepare prepares it).

A route speaks its API (OpenAI's chat, completions and Responses; Anthropic's
Messages): it reads its body, refuses what its
API asks and the server does not serve, and fills one `GenerationRequest`. From there on
nothing knows which API asked. So the fields say what is to be generated, not how a body
spelled it: messages or a prompt, the instructions apart from the messages, tools and an
output format, sampling, the lane, the limits, what logprobs to keep.

Values that only the server can check (a token id against the vocabulary, a lane name
against the lanes it has, a schema against the grammar compiler) stay as the client sent
them: the pipeline checks them, in one order for every API, and its errors name the
fields by the OpenAI names that this vocabulary follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EarlierCall:
    """A call an assistant made earlier in the conversation, its arguments checked to be
    a JSON object (templates read them as one)."""

    id: str
    name: str
    arguments: str  # the JSON text, as the client sent it
    value: dict[str, Any]  # the same, parsed


@dataclass(frozen=True, slots=True)
class Message:
    """One turn, text only, in the roles a chat template knows."""

    role: str  # system | user | assistant | tool
    text: str
    calls: tuple[EarlierCall, ...] = ()  # an assistant's calls
    call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None  # a tool result: the function's name, where given


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation, rendered by the server's chat template."""

    messages: tuple[Message, ...]
    # system text given apart from the messages (Responses' `instructions`, Anthropic's
    # `system`): rendered as a system message ahead of them
    instructions: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last assistant message goes on
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the template's own


@dataclass(frozen=True, slots=True)
class Prompts:
    """Raw prompts, tokenized as they are: a string, strings (one sequence set each), or
    one prompt's token ids (checked against the vocabulary)."""

    prompt: str | list[str | int]

    @property
    def count(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or isinstance(p[0], int) else len(p)


@dataclass(frozen=True, slots=True)
class Tools:
    """Functions the model may call, as the chat template takes them
    (`{"type": "function", "function": {"name", "description", "parameters", …}}`)."""

    functions: list[dict[str, Any]] | None = None
    choice: str | dict[str, Any] | None = None  # none | auto | required | a named function
    parallel: bool = True  # several calls in one answer


@dataclass(frozen=True, slots=True)
class Sampling:
    """How each token is drawn; None takes the sampler's neutral value."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None  # choice i samples with seed + i
    logit_bias: Any = None  # {token id: bias} as sent (checked against the vocabulary)
    min_tokens: Any = None  # no end of generation before this many, as sent
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)


@dataclass(frozen=True, slots=True)
class Logprobs:
    """What to keep beside each token."""

    sampled: bool = False  # the sampled token's logprob
    top: int = 0  # and this many most likely alternatives
    prompt: int | None = None  # the prompt's own tokens' too, with this many alternatives


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    id: str  # the response's id; the scheduler's sequences are named after it
    input: Chat | Prompts
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None  # per choice; None: as many as the context leaves
    # max_tokens as a bound only: where the prompt leaves less room, as many as it leaves
    # (Anthropic's Messages), instead of a 400 (OpenAI's)
    cap_max_tokens: bool = False
    stop: tuple[str, ...] = ()
    n: int = 1  # choices per prompt
    tools: Tools = field(default_factory=Tools)
    response_format: Any = (
        None  # OpenAI's `response_format` object, as sent (api.pipeline.structured)
    )
    lane: str | None = (
        None  # the lane asked for (`strata_reproducible`), as sent (api.pipeline.lanes)
    )
    logprobs: Logprobs = field(default_factory=Logprobs)
    cache_prompt: bool = True  # false: compute the whole prompt, keep none of it cached

    @property
    def sequences(self) -> int:
        """How many sequences it asks the scheduler for: prompts × choices."""
        prompts = self.input.count if isinstance(self.input, Prompts) else 1
        return prompts * self.n
