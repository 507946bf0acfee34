"""A reasoning model's answer through the server: a tiny generated model whose chat
template opens a `<think>` block (as DeepSeek R1's does) is served twice, splitting its
reasoning off (the default) and not (`--reasoning-format none`); the official `openai`
client reads both in strict response validation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from api.pipeline.reasoning import ReasoningSplit
from bench.server_proc import Server, start_server
from tests.tiny_gguf import write_llama

pytestmark = pytest.mark.e2e

THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    where = tmp_path_factory.mktemp("reasoning")
    model = write_llama(where / "thinker.gguf", seed=3, chat_template=THINKING)
    base = ["--model", str(model), "--served-model-name", "thinker", "--n-ctx", "2048"]
    split = start_server(base, where / "split.log")
    try:
        raw = start_server([*base, "--reasoning-format", "none"], where / "raw.log")
    except Exception:
        split.stop()
        raise
    yield split, raw
    raw.stop()
    split.stop()


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="none", _strict_response_validation=True)


KW: dict[str, Any] = {
    "model": "thinker",
    "messages": [{"role": "user", "content": "hello world"}],
    "max_tokens": 12,
    "temperature": 0,
    "extra_body": {"cache_prompt": False},
}


def test_the_reasoning_goes_to_reasoning_content_streamed_or_not(
    servers: tuple[Server, Server],
) -> None:
    """What the model wrote after the template's `<think>` is reasoning until `</think>`:
    the split server's message is exactly the raw server's text split there, and its
    streamed `reasoning_content` / `content` deltas add up to the same."""
    split, raw = servers
    with _client(raw) as c:
        text = c.chat.completions.create(**KW).choices[0].message.content or ""
    want = ReasoningSplit("<think>\n")
    want.feed(text)
    want.flush()
    with _client(split) as c:
        msg = c.chat.completions.create(**KW).choices[0].message
        deltas = [ch.choices[0].delta for ch in c.chat.completions.create(**KW, stream=True)
                  if ch.choices]  # fmt: skip
    extra = msg.model_extra or {}
    assert (extra.get("reasoning_content"), msg.content) == (want.reasoning, want.content)
    assert want.reasoning  # (the model thought: the test compares something)
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == want.reasoning
    assert "".join(d.content or "" for d in deltas) == want.content


def test_reasoning_format_none_keeps_the_text_as_written(servers: tuple[Server, Server]) -> None:
    _, raw = servers
    with _client(raw) as c:
        msg = c.chat.completions.create(**KW).choices[0].message
    assert "reasoning_content" not in (msg.model_extra or {})
    assert msg.content


def test_a_model_without_a_thinking_template_has_no_reasoning_field(server: Server) -> None:
    with _client(server) as c:
        msg = (
            c.chat.completions.create(
                model="gemma-3-270m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            .choices[0]
            .message
        )
    assert "reasoning_content" not in (msg.model_extra or {})
