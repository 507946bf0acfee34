"""msgspec schemas for the OpenAI chat and completions requests and responses this server
speaks (the chat messages and tools they share with /tokenize: api.pipeline.chat_messages;
the Responses API's: api.protocols.openai.responses_wire).

Value ranges live in the types (`Meta`), so a wrong value is a 400 naming its field,
produced by the same decoder that parses the JSON.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from api.pipeline.chat_messages import ChatMessage, FunctionCall, Tool, ToolCall

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Prob = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PosInt = Annotated[int, Meta(ge=1)]
NumChoices = Annotated[int, Meta(ge=1, le=16)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
Stop = str | list[str] | None


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """Fields shared by both endpoints (OpenAI's plus llama.cpp's usual extras)."""

    model: str
    max_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    min_p: Prob | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    n: NumChoices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False  # llama.cpp/vLLM extension: generate max_tokens (benchmarks)
    # llama-server's name: false = compute the whole prompt, and keep none of it cached
    cache_prompt: bool = True
    # "required": serve in the reproducible lane; "off"/absent: the server's default lane.
    # Checked by api.pipeline.lanes (a wrong value is a 400 that lists the allowed ones).
    strata_reproducible: str | None = None
    # Fields that would change the output and are not served yet: present here so that
    # api.pipeline.validation can refuse them by name (a 400), where a decoder that ignores unknown
    # fields would drop them silently. A value that asks for nothing ([] tools, {}
    # logit_bias, min_tokens 0 …) is accepted.
    logit_bias: Any = None
    min_tokens: Any = None
    response_format: Any = None
    guided_json: Any = None  # vLLM's and llama.cpp's constrained-output extensions
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    grammar: Any = None
    json_schema: Any = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    # How the chat template renders (vLLM's names; engine.chat_template)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | Annotated[list[str | int], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=0)] | None = None  # 0: the prompt only (with echo)
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Any = None
    # vLLM's extension: logprobs name each token "token_id:<id>" (exact ids, for tests/evals)
    return_tokens_as_token_ids: bool = False


# ---- responses ----------------------------------------------------------------------
class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens read from the prefix cache, not computed


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class ResponseMessage(Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    # a reasoning model's thinking (api.pipeline.reasoning); absent for other models
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET  # (api.pipeline.tool_calls)


class ChatChoice(Struct):
    index: int
    message: ResponseMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None  # names the numerics lane (api.pipeline.lanes)
    object: Literal["chat.completion"] = "chat.completion"


class ToolCallDelta(Struct, kw_only=True):
    index: int
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str | None = None  # names the numerics lane (api.pipeline.lanes)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None = None


class CompletionLogprobs(Struct):
    """OpenAI's legacy shape. With echo the prompt's tokens come first, the first of them
    with null (nothing precedes it), as OpenAI's legacy API and vLLM send it."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None  # names the numerics lane (api.pipeline.lanes)
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None = None


class SamplingDefaultsCard(Struct):
    """What a request's unset sampling fields become, and where each value comes from
    (`source`: field → "flag", "gguf" or "llama-server default")."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    source: dict[str, str]


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "deepseek-one-gpu"
    object: Literal["model"] = "model"
    max_model_len: int = 0
    sampling_defaults: SamplingDefaultsCard | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
