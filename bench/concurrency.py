"""Aggregate decode throughput at several concurrencies against a real server.

Starts `one-gpu serve` (unless --url is given), warms it up, then for each concurrency N
runs N streaming clients at once — the official `openai` client, same prompt and length
for every client (`ignore_eos`, so each generates exactly --max-tokens) — and reports
generated tokens per second over the wall time, the slowest client's rate, and each
figure's ratio to N=1. Repeats and reports medians: the machines are noisy.

    python -m bench.concurrency --concurrency 1 8 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from openai import AsyncOpenAI

from bench.server_proc import start_server

log = logging.getLogger("bench")
PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle. " * 6


@dataclass
class Run:
    concurrency: int
    tokens: int
    wall_s: float
    slowest_tok_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


async def one_client(c: AsyncOpenAI, model: str, max_tokens: int) -> tuple[int, float]:
    t0 = time.monotonic()
    stream = await c.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    n = 0
    async for ch in stream:
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    return n, time.monotonic() - t0


async def measure(base_url: str, model: str, n: int, max_tokens: int) -> Run:
    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as c:
        t0 = time.monotonic()
        results = await asyncio.gather(*[one_client(c, model, max_tokens) for _ in range(n)])
        wall = time.monotonic() - t0
    tokens = sum(r[0] for r in results)
    assert all(r[0] == max_tokens for r in results), results
    return Run(n, tokens, wall, min(r[0] / r[1] for r in results))


async def bench(args: argparse.Namespace, base_url: str) -> dict[int, list[Run]]:
    await measure(base_url, args.model, 2, 8)  # warm-up
    runs: dict[int, list[Run]] = {n: [] for n in args.concurrency}
    for _ in range(args.repeats):  # alternate concurrencies inside each repeat
        for n in args.concurrency:
            runs[n].append(await measure(base_url, args.model, n, args.max_tokens))
    return runs


def report(runs: dict[int, list[Run]]) -> str:
    base = statistics.median(r.tok_s for r in runs[min(runs)])
    lines = [
        "| clients | aggregate tok/s (median) | runs | slowest client tok/s | vs 1 client |",
        "|---|---|---|---|---|",
    ]
    for n, rs in runs.items():
        med = statistics.median(r.tok_s for r in rs)
        slow = statistics.median(r.slowest_tok_s for r in rs)
        each = ", ".join(f"{r.tok_s:.1f}" for r in rs)
        lines.append(f"| {n} | {med:.1f} | {each} | {slow:.1f} | {med / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server-args", default="--n-ctx 16384 --n-seq-max 32")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.url:
        runs = asyncio.run(bench(args, args.url.rstrip("/") + "/v1"))
    else:
        logdir = Path(tempfile.mkdtemp(prefix="onegpu-bench-"))
        srv = start_server(args.server_args.split(), logdir / "server.log")
        try:
            runs = asyncio.run(bench(args, srv.base_url))
        finally:
            srv.stop()
    print(report(runs))


if __name__ == "__main__":
    main()
