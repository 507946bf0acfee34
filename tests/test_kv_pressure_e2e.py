"""End to end: under KV pressure the server serves one after another, never thrashes.

A pool that holds about two prompts and ten concurrent requests whose prompts each take
30-45% of it: admission by the whole prompt (and the running requests' expected growth)
runs them about two at a time. Compared, in the same test, with the same requests sent
one after another.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.server_proc import Server, start_server
from tests.tiny_gguf import Shape, write_llama

pytestmark = pytest.mark.e2e
POOL = 1024
OUT = 48


@pytest.fixture(scope="module")
def pressed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("kv")
    # big enough that a step costs more than the HTTP around it (~40M weights)
    shape = Shape(n_layer=6, n_embd=768, n_head=12, n_head_kv=4, head_dim=64, n_ff=2048)
    model = write_llama(d / "tiny.gguf", seed=3, wtype="f16", shape=shape)
    srv = start_server(
        ["--model", str(model), "--served-model-name", "tiny", "--n-ctx", str(POOL),
         "--n-seq-max", "16", "--repro-slots", "0"],
        d / "server.log",
    )  # fmt: skip
    yield srv
    srv.stop()


def _preemptions(server: Server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("onegpu_preemptions_total "):
            return float(line.split()[1])
    raise AssertionError("no onegpu_preemptions_total")


async def _one(h: httpx.AsyncClient, server: Server, ids: list[int]) -> float:
    body = {"model": "tiny", "prompt": ids, "max_tokens": OUT, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = await h.post(server.base_url + "/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": OUT,
                            "total_tokens": len(ids) + OUT}  # fmt: skip
    return time.monotonic()


def test_ten_prompts_for_a_two_prompt_pool_run_without_thrashing(pressed: Server) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(int(0.30 * POOL),
                                                                  int(0.45 * POOL)))]
               for _ in range(10)]  # fmt: skip

    async def main() -> tuple[float, float, float, float]:
        async with httpx.AsyncClient(timeout=600) as h:
            await _one(h, pressed, prompts[0][:8])  # warm up
            t0 = time.monotonic()
            first_alone = await _one(h, pressed, prompts[0]) - t0
            for p in prompts[1:]:
                await _one(h, pressed, p)
            serial = time.monotonic() - t0
            t0 = time.monotonic()
            ends = await asyncio.gather(*(_one(h, pressed, p) for p in prompts))
            together = time.monotonic() - t0
            return first_alone, serial, ends[0] - t0, together

    before = _preemptions(pressed)
    first_alone, serial, first_together, together = asyncio.run(main())
    preempted = _preemptions(pressed) - before
    print(f"kv pressure: {together:.2f} s together, {serial:.2f} s one after another; first "
          f"request {first_together:.2f} s vs {first_alone:.2f} s alone; {preempted:g} "
          "preemptions")  # fmt: skip
    assert preempted <= 10
    assert together <= 1.3 * serial, (together, serial)
