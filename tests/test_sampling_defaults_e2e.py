"""Sampling defaults and model names through a real server: a tiny generated GGUF whose
metadata says greedy (`general.sampling.temp` 0), served with a flag given by hand
(`--top-p 0.5`) and `--accept-any-model`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from bench.server_proc import Server, start_server
from tests.tiny_gguf import write_llama

pytestmark = pytest.mark.e2e
NAME = "carrier"


@pytest.fixture(scope="module")
def carrier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("carrier")
    model = write_llama(where / "carrier.gguf", seed=5, metadata={
        "general.sampling.temp": 0.0, "general.sampling.top_k": 20})  # fmt: skip
    srv = start_server(
        ["--model", str(model), "--served-model-name", NAME, "--n-ctx", "2048", "--top-p", "0.5",
         "--accept-any-model"],
        where / "server.log",
    )  # fmt: skip
    yield srv
    srv.stop()


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="none", _strict_response_validation=True)


def test_the_model_card_says_which_defaults_apply_and_whence(carrier: Server) -> None:
    card = httpx.get(carrier.base_url + "/models").json()["data"][0]
    assert card["sampling_defaults"] == {
        "temperature": 0.0, "top_k": 20, "top_p": 0.5, "min_p": 0.05, "repetition_penalty": 1.0,
        "source": {"temperature": "gguf", "top_k": "gguf", "top_p": "flag",
                   "min_p": "llama-server default", "repetition_penalty": "llama-server default"},
    }  # fmt: skip
    assert "sampling defaults (a request's own fields win): temperature 0 (gguf)" in carrier.log()


def test_the_model_s_greedy_default_reaches_the_engine(carrier: Server) -> None:
    """Without a temperature the answer is the greedy one whatever the seed (the model's
    default); a request's own temperature wins: sampled, seeds give other answers."""
    kw: dict[str, Any] = {"model": NAME, "prompt": "the capital of", "max_tokens": 16,
                          "extra_body": {"cache_prompt": False}}  # fmt: skip
    with _client(carrier) as c:
        greedy = c.completions.create(**kw, temperature=0).choices[0].text
        unset = {c.completions.create(**kw, seed=s).choices[0].text for s in range(3)}
        sampled = {c.completions.create(**kw, temperature=1.5, top_p=1.0, seed=s).choices[0].text
                   for s in range(3)}  # fmt: skip
    assert unset == {greedy}
    assert sampled != {greedy}


def test_any_model_name_is_served_and_echoed(carrier: Server) -> None:
    """Agent clients ask for their own model names (Claude Code: `claude-…`)."""
    with _client(carrier) as c:
        got = c.chat.completions.create(
            model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
        )  # fmt: skip
    assert got.model == "claude-sonnet-4-5"


def test_without_the_flag_an_unknown_model_is_a_404(server: Server) -> None:
    with _client(server) as c, pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(
            model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert e.value.body["param"] == "model"  # type: ignore[index]
