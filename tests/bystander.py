"""What every hardening test checks besides its own bad request: a user streaming beside
it is not disturbed, and the bad request's connection stays usable.

`Bystander.beside(bad)` streams a greedy chat completion (in a process of its own), runs
`bad` after its first token, and asserts the stream completes with exactly the text it gets alone
and that its longest pause between two tokens stays within 3x its longest pause alone, that
pause lengthened by the stall target where prompts are served beside it (a step of theirs may
come between two of its tokens: the server bounds that step, not its absence). The factor
covers the step with a prompt in it as much as the decode step alone: the server plans that
step to the target on its cost model, and a machine that runs slow runs both slow (a 2-core CI
host with the test's own clients on it: a 33 ms decode pause alone, 148 ms beside a flood).
The stream asks for the reproducible lane: in the shared lane its numerics would follow
whatever else shares its steps (a good request beside it is enough to change a token).
`Conn` is one keep-alive HTTP/1.1 connection (http.client) that tells whether the server
kept it open.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

from bench.server_proc import Server
from tests.conftest import MODEL

STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
GAP_FACTOR = 3.0
# Servers under these tests run llama.cpp on one thread of the machine's two cores: the
# tests measure whether a bad request freezes the event loop or takes the engine, and on
# a machine whose every core computes the model, the test client's own CPU (building a
# 4 MB body) would stretch each step as much as any server fault.
ENGINE_THREADS = ["--threads", "1"]
# Prompts that are served beside the stream (the good request after each bad one, forged
# markers that stay text) are prefilled in chunks that keep every step under the stall
# target; the default 250 ms is many decode steps on this model, so the target is tight.
TIGHT_STALL_MS = 30
TIGHT_STALL = ["--max-stall-ms", str(TIGHT_STALL_MS), "--min-prefill-chunk", "2"]


@dataclass
class Streamed:
    text: str
    max_gap_s: float
    finish_reason: str | None


async def stream_chat(base_url: str, key: str, max_tokens: int, first: Any = None) -> Streamed:
    """One greedy streamed chat in the reproducible lane; `first.set()` after its first
    token."""
    text, finish, last, max_gap = "", None, None, 0.0
    async with AsyncOpenAI(
        base_url=base_url, api_key=key, _strict_response_validation=True, max_retries=0
    ) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=STORY,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"strata_reproducible": "required"},
        )  # type: ignore[call-overload]
        async for chunk in stream:
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            if ch.delta.content:
                now = time.monotonic()
                if last is not None:
                    max_gap = max(max_gap, now - last)
                last = now
                text += ch.delta.content
                if first is not None and not first.is_set():
                    first.set()
            finish = ch.finish_reason or finish
    return Streamed(text, max_gap, finish)


def _stream_in_child(base_url: str, key: str, max_tokens: int, first: Any, out: Any) -> None:
    out.put(asyncio.run(stream_chat(base_url, key, max_tokens, first)))


def _stream(server: Server, key: str, max_tokens: int, during: Callable[[], None]) -> Streamed:
    """Stream in a process of its own (the bad requests' client work in this one must not
    delay its reading: its pauses are the server's), running `during()` here after the
    first token."""
    ctx = multiprocessing.get_context("spawn")  # this process has threads: never fork it
    first, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_stream_in_child,
                        args=(server.base_url, key, max_tokens, first, out))  # fmt: skip
    child.start()
    try:
        assert first.wait(120), "the stream never started"
        during()
        got: Streamed = out.get(timeout=300)
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    return got


def _nothing() -> None:
    pass


@dataclass
class Bystander:
    server: Server
    key: str = "none"
    max_tokens: int = 64
    stall_s: float = 0.0  # the server's stall target, where prompts are served beside it
    _alone: Streamed | None = field(default=None, repr=False)

    def alone(self) -> Streamed:
        """The stream alone (twice; the longer pause counts: the machine is shared)."""
        if self._alone is None:
            runs = [_stream(self.server, self.key, self.max_tokens, _nothing) for _ in range(2)]
            assert runs[0].text == runs[1].text and runs[0].finish_reason == "length"
            self._alone = Streamed(runs[0].text, max(r.max_gap_s for r in runs), "length")
        return self._alone

    def beside(self, bad: Callable[[], None]) -> Streamed:
        ref = self.alone()
        got = _stream(self.server, self.key, self.max_tokens, bad)
        print(f"bystander: longest pause {got.max_gap_s * 1000:.0f} ms beside, "
              f"{ref.max_gap_s * 1000:.0f} ms alone")  # fmt: skip
        assert got.text == ref.text, "the stream beside the bad request changed"
        assert got.finish_reason == "length"
        assert got.max_gap_s <= GAP_FACTOR * (ref.max_gap_s + self.stall_s), (
            f"longest pause {got.max_gap_s * 1000:.0f} ms beside the bad request, "
            f"{ref.max_gap_s * 1000:.0f} ms alone, stall target {self.stall_s * 1000:.0f} ms"
        )
        return got


class Conn:
    """One HTTP/1.1 keep-alive connection."""

    def __init__(self, server: Server, key: str = "none") -> None:
        self.h = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.sock: Any = None

    def send(
        self, method: str, path: str, body: bytes | None = None, **headers: str
    ) -> tuple[int, Any]:
        self.h.request(method, path, body=body, headers={**self.headers, **headers})
        r = self.h.getresponse()
        data = r.read()
        self.sock = None if r.will_close else self.h.sock
        ctype = r.getheader("content-type", "")
        return r.status, json.loads(data) if data and ctype.startswith("application/json") else data

    def post(self, path: str, obj: Any) -> tuple[int, Any]:
        return self.send("POST", path, json.dumps(obj).encode())

    def assert_still_serves(self) -> None:
        """The server kept this connection open, and a good request on it succeeds."""
        kept = self.sock
        assert kept is not None, "the server closed the connection after the bad request"
        status, body = self.post(
            "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        )
        assert status == 200, body
        assert self.h.sock is kept, "the good request needed a new connection"

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.h.close()


def error_of(status: int, body: Any, expect: int) -> dict[str, Any]:
    """The OpenAI error body of a response that must have status `expect`."""
    assert status == expect, (status, body)
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err
