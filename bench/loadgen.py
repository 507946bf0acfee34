"""A closed-loop load driver on the official `openai` client, for hosts where aiperf
cannot be installed (the offline GPU machine): N users, each sending its next request as
soon as the last one ends, every request a distinct prompt of exactly `isl` token ids and
exactly `osl` generated tokens (`ignore_eos`). It reports the same figures as an aiperf
cell, measured the same way (per-request decode rate = tokens after the first / time after
the first token).

`run_lockstep` measures what `llama-batched-bench` calls S_TG through the whole server: N
requests sent together, and the tokens all N streams receive between the moment the last
of them got its first token and the moment the first of them ended — the window in which
all N decode together with no prompt in the steps — divided by that window's length. The
closed loop's per-user rates instead include the steps that carry other users' prompts,
which the ceiling never has."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
from typing import Any

import httpx2
from openai import AsyncOpenAI, DefaultAsyncHttpx2Client

from bench.aiperf_run import Cell


def prompt(rng: random.Random, isl: int) -> list[int]:
    """Exactly `isl` random token ids (ids 1000-9999 exist in every real vocabulary), so
    both servers see the same prompt length whatever the tokenizer."""
    return [rng.randrange(1000, 10000) for _ in range(isl)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def _one(
    c: AsyncOpenAI, model: str, prompt_ids: list[int], osl: int, sampling: dict[str, Any]
) -> tuple[float, list[float], int, float, float]:
    """(ttft, chunk gaps, generated tokens, decode seconds, tail seconds: from the last
    text chunk to the stream's end) of one streamed request."""
    t0 = time.monotonic()
    stamps, n = await _stream(c, model, prompt_ids, osl, sampling)
    end = time.monotonic()
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - t0, gaps, n, stamps[-1] - stamps[0], end - stamps[-1]


async def _stream(
    c: AsyncOpenAI, model: str, prompt_ids: list[int], osl: int, sampling: dict[str, Any]
) -> tuple[list[float], int]:
    """Arrival time of each text chunk, and the usage's generated-token count."""
    stream = await c.completions.create(
        model=model, prompt=prompt_ids, max_tokens=osl, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "cache_prompt": False, **sampling},
    )  # fmt: skip
    stamps: list[float] = []
    n = 0
    async for ch in stream:
        if ch.choices and ch.choices[0].text:
            stamps.append(time.monotonic())
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    return stamps, n


def _client(base_url: str) -> AsyncOpenAI:
    # A new connection per request: llama-server closes kept-alive connections at times,
    # and a request sent on a closing one fails (aiperf runs into the same).
    http = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0))
    return AsyncOpenAI(
        base_url=base_url, api_key="none", max_retries=0, timeout=600, http_client=http
    )


async def run_load(
    base_url: str, *, model: str, concurrency: int, requests: int, isl: int, osl: int,
    sampling: dict[str, Any], seed: int = 1, osl_spread: float = 0.0,
) -> Cell:  # fmt: skip
    """`osl_spread` s: each request generates osl x (1 + s x u) tokens, u uniform in
    [-1, 1] and the same for every server (0: all `osl`, so a closed loop's users stay in
    step: every request of a wave starts and ends together)."""
    rng = random.Random(seed)
    prompts = [prompt(rng, isl) for _ in range(requests)]
    lengths = [max(1, round(osl * (1 + osl_spread * rng.uniform(-1, 1)))) for _ in prompts]
    results: list[tuple[float, list[float], int, float, float]] = []
    async with _client(base_url) as c:
        queue = list(reversed(list(zip(prompts, lengths, strict=True))))

        async def user() -> None:
            while queue:
                ids, n = queue.pop()
                results.append(await _one(c, model, ids, n, sampling))

        t0 = time.monotonic()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.monotonic() - t0
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    rates = [(r[2] - 1) / r[3] for r in results if r[3] > 0]
    total = sum(r[2] for r in results)
    return Cell(
        output_tok_s=total / wall,
        per_user_tok_s=statistics.mean(rates),
        slowest_user_tok_s=min(rates),
        ttft_p50=1000 * _pct(ttfts, 0.5),
        ttft_p99=1000 * _pct(ttfts, 0.99),
        itl_p50=1000 * _pct(gaps, 0.5),
        itl_p99=1000 * _pct(gaps, 0.99),
        requests=len(results),
        output_tokens=total,
        tail_p50=1000 * _pct([r[4] for r in results], 0.5),
    )


async def run_lockstep(
    base_url: str, *, model: str, concurrency: int, waves: int, isl: int, osl: int,
    sampling: dict[str, Any], seed: int = 1,
) -> float:  # fmt: skip
    """Decode tok/s summed over N while all N decode together (see the module's doc)."""
    rng = random.Random(seed)
    tokens = 0
    seconds = 0.0
    async with _client(base_url) as c:
        for _ in range(waves):
            runs = await asyncio.gather(
                *(_stream(c, model, prompt(rng, isl), osl, sampling) for _ in range(concurrency))
            )
            start = max(st[0] for st, _ in runs)
            end = min(st[-1] for st, _ in runs)
            if end <= start:
                continue  # a stream ended before the last one began: no common window
            tokens += sum(1 for st, _ in runs for t in st if start < t <= end)
            seconds += end - start
    return tokens / seconds if seconds else 0.0
