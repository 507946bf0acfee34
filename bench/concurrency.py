"""Aggregate decode throughput at several concurrencies against one server (ours).

Starts `one-gpu serve` (unless --url is given), warms it up, then for each concurrency N
runs N users in a closed loop with `bench/loadgen.py` — every request the same prompt
length and exactly --max-tokens generated tokens — and reports generated tokens per second
over the wall time, the slowest user's rate, and the aggregate's ratio to N=1. Repeats and
reports medians: the machines are noisy. `make bench` (bench/compare.py) is the full
comparison with llama.cpp; this is the quick look at batching alone.

    python -m bench.concurrency --concurrency 1 8 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
from pathlib import Path

from bench.aiperf_run import Cell
from bench.compare import warm_up
from bench.loadgen import run_load
from bench.server_proc import start_server

NAME = "bench-model"


async def bench(args: argparse.Namespace, base_url: str) -> dict[int, list[Cell]]:
    runs: dict[int, list[Cell]] = {n: [] for n in args.concurrency}
    for rep in range(args.repeats):  # alternate concurrencies inside each repeat
        for n in args.concurrency:
            runs[n].append(
                await run_load(
                    base_url, model=args.model, concurrency=n, requests=n * 2, isl=128,
                    osl=args.max_tokens, sampling={"temperature": 0}, seed=rep,
                )
            )  # fmt: skip
    return runs


def report(runs: dict[int, list[Cell]]) -> str:
    base = statistics.median(r.output_tok_s for r in runs[min(runs)])
    lines = ["| clients | aggregate tok/s (median) | runs | slowest client tok/s | vs 1 client |",
             "|---|---|---|---|---|"]  # fmt: skip
    for n, rs in runs.items():
        med = statistics.median(r.output_tok_s for r in rs)
        slow = statistics.median(r.slowest_user_tok_s for r in rs)
        each = ", ".join(f"{r.output_tok_s:.1f}" for r in rs)
        lines.append(f"| {n} | {med:.1f} | {each} | {slow:.1f} | {med / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--model", default=NAME, help="model id the server answers to")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server-args", default="--n-ctx 16384 --n-seq-max 32")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.url:
        runs = asyncio.run(bench(args, args.url.rstrip("/") + "/v1"))
    else:
        logdir = Path(tempfile.mkdtemp(prefix="onegpu-bench-"))
        srv = start_server(
            ["--served-model-name", args.model, *args.server_args.split()], logdir / "server.log"
        )
        try:
            warm_up(srv, args.model)
            runs = asyncio.run(bench(args, srv.base_url))
        finally:
            srv.stop()
    print(report(runs))


if __name__ == "__main__":
    main()
