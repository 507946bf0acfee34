"""Do constrained users slow the others? 16 streaming users on one server: all free, then
half of them answering under a JSON schema (token masks each step), alternating, repeated.
The free users' decode speed (tokens after the first over the time they took, median over
users) in the mixed run over the all-free run is the figure; the target is >= 0.95.
Also reported: per step, how long the masks took on the mask thread and how long the
step waited for them after decoding (from /metrics).

    python -m bench.constrained                          # CPU, embedded model
    python -m bench.constrained --gpu --model M.gguf
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
from typing import Any

import httpx
from openai import AsyncOpenAI

from bench.kv_pressure import MetricKey, scrape
from bench.server_proc import on_gpu, served_model, start_server

log = logging.getLogger("bench.constrained")
NAME = "bench-model"
# An answer that never has to end: a list of strings as long as max_tokens allows.
SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
    "additionalProperties": False,
}
ASK = "Write notes about the sea, as many as you can."


@dataclass
class User:
    constrained: bool
    tokens: int = 0
    first: float | None = None
    last: float | None = None

    @property
    def tok_per_s(self) -> float:
        if self.first is None or self.last is None or self.last <= self.first:
            return float("nan")
        return (self.tokens - 1) / (self.last - self.first)


async def one_user(c: AsyncOpenAI, u: User, osl: int, seed: int) -> None:
    extra: dict[str, Any] = {"ignore_eos": True}
    kw: dict[str, Any] = {}
    if u.constrained:
        kw["response_format"] = {"type": "json_schema",
                                 "json_schema": {"name": "notes", "schema": SCHEMA}}  # fmt: skip
    stream = await c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": ASK}], max_tokens=osl,
        temperature=0.8, seed=seed, stream=True, extra_body=extra, **kw,
    )  # fmt: skip
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            now = time.monotonic()
            u.first = u.first or now
            u.last = now
            u.tokens += 1


async def run(base_url: str, users: int, constrained: int, osl: int, seed: int) -> list[User]:
    group = [User(i < constrained) for i in range(users)]
    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as c:
        await asyncio.gather(*(one_user(c, u, osl, seed + i) for i, u in enumerate(group)))
    return group


def free_speed(group: list[User]) -> float:
    return statistics.median(u.tok_per_s for u in group if not u.constrained)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF (default: the embedded model)")
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--osl", type=int, default=96, help="tokens per answer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ours-args", default="--repro-slots 0")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = served_model(args.model)
    gpu = on_gpu(args.gpu)
    cmd = ["--model", str(model), "--served-model-name", NAME, "--n-seq-max", str(args.users),
           "--n-ctx", str(args.users * (args.osl + 256)), "--n-gpu-layers",
           "-1" if gpu else "0", *args.ours_args.split()]  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="onegpu-constrained-"))
    srv = start_server(cmd, logs / "ours.log")
    free: list[float] = []
    mixed: list[float] = []
    masks = mask_s = wait_s = steps = 0.0
    try:
        asyncio.run(run(srv.base_url, 2, 1, 8, 0))  # warm-up: graphs, the mask path
        for r in range(args.repeats):
            log.info("repeat %d/%d", r + 1, args.repeats)
            free.append(free_speed(asyncio.run(run(srv.base_url, args.users, 0, args.osl, r))))
            before = scrape_sync(srv.url)
            half = args.users // 2
            mixed.append(free_speed(asyncio.run(run(srv.base_url, args.users, half, args.osl, r))))
            after = scrape_sync(srv.url)

            masks += grew(before, after, "onegpu_grammar_masks_total")
            mask_s += grew(before, after, "onegpu_grammar_mask_seconds_total")
            wait_s += grew(before, after, "onegpu_step_phase_seconds_total", phase="mask_wait")
            steps += grew(before, after, "onegpu_step_duration_seconds_count")
    finally:
        srv.stop()
    f, m = statistics.median(free), statistics.median(mixed)
    print(f"model {model.name}, gpu {gpu}, {args.users} users, {args.osl} tokens each, "
          f"{args.repeats} repeats (median)")  # fmt: skip
    print("\n| run | free users' decode tok/s (median user) |")
    print("|---|---:|")
    print(f"| all {args.users} free | {f:.1f} |")
    print(f"| {args.users // 2} free + {args.users // 2} under a JSON schema | {m:.1f} |")
    print(f"\nmixed / all free: {m / f:.3f} (each repeat: "
          f"{', '.join(f'{b / a:.3f}' for a, b in zip(free, mixed, strict=True))})")  # fmt: skip
    if masks:
        print(f"masks: {masks:.0f}, {mask_s / masks * 1e6:.0f} us each on the mask thread; "
              f"per mixed step {mask_s / steps * 1e3:.2f} ms computing them, "
              f"{wait_s / steps * 1e3:.3f} ms waited for after decoding")  # fmt: skip
    print(f"server log: {logs}")


def grew(
    before: dict[MetricKey, float], after: dict[MetricKey, float], name: str, **labels: str
) -> float:
    key: MetricKey = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def scrape_sync(url: str) -> dict[MetricKey, float]:
    async def go() -> dict[MetricKey, float]:
        async with httpx.AsyncClient(timeout=30) as h:
            return await scrape(h, url)

    return asyncio.run(go())


if __name__ == "__main__":
    main()
