"""`POST /tokenize` and `/detokenize` in llama-server's and vLLM's shapes, one route each
(api.protocols.llama.routes), on the embedded model (the session `server`)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from bench.server_proc import Server
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e
TEXT = "Hello world, the sea is calm."
CHAT: Any = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip


def _post(server: Server, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    return r.json()


def test_llama_server_s_shape_round_trips(server: Server) -> None:
    plain = _post(server, "/tokenize", {"content": TEXT})["tokens"]
    special = _post(server, "/tokenize", {"content": TEXT, "add_special": True})["tokens"]
    assert all(isinstance(t, int) for t in plain) and special[1:] == plain  # (BOS first)
    pieces = _post(server, "/tokenize", {"content": TEXT, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == plain
    assert "".join(p["piece"] for p in pieces) == TEXT
    assert _post(server, "/detokenize", {"tokens": plain}) == {"content": TEXT}


def test_vllm_s_shapes_count_as_the_chat_route_reads(server: Server) -> None:
    """A prompt as completions tokenizes it; messages as chat completions renders them:
    the count is the prompt_tokens the same request is billed."""
    got = _post(server, "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert set(got) >= {"count", "max_model_len", "tokens"}
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    assert (
        got["tokens"]
        == _post(server, "/tokenize", {"content": TEXT, "add_special": True})["tokens"]
    )
    bare = _post(server, "/tokenize", {"model": MODEL, "prompt": TEXT,
                                       "add_special_tokens": False})  # fmt: skip
    assert bare["tokens"] == got["tokens"][1:]
    chat = _post(server, "/tokenize", {"model": MODEL, "messages": CHAT})
    with OpenAI(base_url=server.base_url, api_key="none") as c:
        billed = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert billed.usage is not None and chat["count"] == billed.usage.prompt_tokens
    strs = _post(server, "/tokenize", {"model": MODEL, "prompt": TEXT,
                                       "return_token_strs": True})["token_strs"]  # fmt: skip
    assert len(strs) == got["count"]
    back = _post(server, "/detokenize", {"model": MODEL, "tokens": bare["tokens"]})
    assert back == {"prompt": TEXT}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [("/tokenize", {}, 400, "content"),
     ("/tokenize", {"model": "no-such-model", "prompt": "a"}, 404, "model"),
     ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
     ("/tokenize", {"content": 5}, 400, "content"),
     ("/detokenize", {"tokens": [1, 999999999]}, 400, "tokens[1]"),
     ("/detokenize", {"tokens": "abc"}, 400, "tokens")],
)  # fmt: skip
def test_bad_bodies_are_openai_errors_naming_the_field(
    server: Server, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    err = _post(server, path, body, status)["error"]
    assert err["param"] == param, err
