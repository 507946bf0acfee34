"""End to end on a deliberately small server: queue bound (429), API key, SIGTERM drain."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from bench.server_proc import Server, start_server
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e
KEY = "s3cret-key"
MSG = [{"role": "user", "content": "Tell me a long story."}]
SMALL = ["--n-ctx", "4096", "--n-seq-max", "1", "--max-waiting", "1", "--api-key", KEY]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(SMALL, tmp_path_factory.mktemp("small") / "server.log")
    yield srv
    srv.stop()


def _waiting(server: Server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith('onegpu_requests_waiting{lane="fast"} '):
            return float(line.split()[1])
    raise AssertionError("no onegpu_requests_waiting")


def test_api_key_is_required_on_v1_routes(small: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=small.base_url, api_key="wrong", max_retries=0).models.list()
    r = httpx.post(small.base_url + "/completions", json={"model": MODEL, "prompt": "a"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ok = OpenAI(base_url=small.base_url, api_key=KEY, _strict_response_validation=True)
    assert MODEL in [m.id for m in ok.models.list()]
    assert httpx.get(small.url + "/health").status_code == 200  # not behind the key
    assert httpx.get(small.url + "/metrics").status_code == 200


def test_full_queue_answers_429_with_retry_after(small: Server) -> None:
    async def run(c: AsyncOpenAI) -> tuple[httpx.Response, str]:
        first = await c.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=300, temperature=0, stream=True
        )
        await anext(aiter(first))  # running: holds the only sequence
        waiting = asyncio.create_task(
            c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
        )
        deadline = time.monotonic() + 10
        while _waiting(small) < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # polling a condition, bounded by the deadline
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as h:
            refused = await h.post(
                small.base_url + "/chat/completions",
                json={"model": MODEL, "messages": MSG, "max_tokens": 3},
            )
        await first.close()  # frees the sequence: the waiting one runs and completes
        done = await waiting
        return refused, done.choices[0].message.content or ""

    async def main() -> tuple[httpx.Response, str]:
        async with AsyncOpenAI(
            base_url=small.base_url, api_key=KEY, _strict_response_validation=True, max_retries=0
        ) as c:
            return await run(c)

    refused, text = asyncio.run(main())
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    err: dict[str, Any] = refused.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    assert text


def test_sigterm_drains_running_requests(tmp_path: Any) -> None:
    srv = start_server(["--n-ctx", "4096", "--n-seq-max", "4"], tmp_path / "server.log")
    try:
        c = OpenAI(base_url=srv.base_url, api_key="x", _strict_response_validation=True)
        stream = c.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=60, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 60
        # uvicorn re-raises SIGTERM after its graceful shutdown: exit by the signal, by itself
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)
        assert "drain timed out" not in srv.log()
    finally:
        srv.stop()
