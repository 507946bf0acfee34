"""The reproducible lane: does it hold under load, and what does it cost?

`check`: a greedy and a seeded-sampling request, each sent once alone on the idle server,
then `trials` times beside a random background of 2–8 fast-lane streams of random lengths
(the measured requests start after a random number of them has begun; the rest start
after). Token ids (vLLM's `return_tokens_as_token_ids`), text and logprobs must be
identical to alone in the reproducible lane; the same requests in the fast lane are the
control. `speed`: single-user decode tok/s in each lane, and the aggregate of 8 users when
0, 1 and 4 of them are reproducible — all in one run of one server.

    python -m bench.repro [--model M.gguf] [--ours-args "..."] [--trials 20]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from api.pipeline.lanes import FAST, REPRODUCIBLE
from bench.loadgen import prompt as random_prompt
from bench.server_proc import Server, start_server

log = logging.getLogger(__name__)
REQUESTS: dict[str, dict[str, Any]] = {
    "greedy": {"prompt": "The history of the printing press began", "temperature": 0.0},
    "sampled": {
        "prompt": "In the mountains north of the city there lived",
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 1234,
    },
}
Outcome = tuple[Any, ...]


def strict_client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=server.base_url, api_key="none", _strict_response_validation=True, max_retries=0
    )


def _body(kind: str, lane: str, max_tokens: int) -> dict[str, Any]:
    extra: dict[str, Any] = {"return_tokens_as_token_ids": True}
    if lane == REPRODUCIBLE:
        extra["strata_reproducible"] = "required"
    return {"max_tokens": max_tokens, "logprobs": 3, "extra_body": extra, **REQUESTS[kind]}


def _outcome(r: Any) -> Outcome:
    """Everything that must match: ids, text, chosen and top logprobs, finish reason."""
    c = r.choices[0]
    lp = c.logprobs
    return (c.text, tuple(lp.tokens), tuple(lp.token_logprobs),
            tuple(tuple(sorted(d.items())) for d in lp.top_logprobs), c.finish_reason)  # fmt: skip


async def measured(c: AsyncOpenAI, model: str, kind: str, lane: str, n: int) -> tuple[Outcome, str]:
    """One measured request: its outcome and the `system_fingerprint` that served it."""
    r = await c.completions.create(model=model, **_body(kind, lane, n))
    if r.choices[0].logprobs is None or not all(
        t.startswith("token_id:") for t in r.choices[0].logprobs.tokens
    ):
        raise AssertionError("logprobs with token ids expected")
    return _outcome(r), r.system_fingerprint or ""


async def _background(
    c: AsyncOpenAI, model: str, rng: random.Random, started: asyncio.Event
) -> None:
    """A fast-lane stream of random length; sets `started` at its first token."""
    stream = await c.completions.create(
        model=model, prompt=random_prompt(rng, rng.randrange(4, 160)),
        max_tokens=rng.randrange(4, 40), stream=True, temperature=rng.choice([0.0, 0.7]),
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for _ in stream:
        started.set()


async def alone(server: Server, model: str, n: int) -> dict[str, Outcome]:
    """Each measured request by itself, one at a time (the server otherwise idle)."""
    async with strict_client(server) as c:
        return {
            f"{kind}/{lane}": (await measured(c, model, kind, lane, n))[0]
            for kind in REQUESTS
            for lane in (REPRODUCIBLE, FAST)
        }


async def trial(
    server: Server, model: str, rng: random.Random, n: int
) -> tuple[dict[str, Outcome], int]:
    """The four measured requests (both kinds, both lanes) inside a random background;
    returns their outcomes and how many background streams ran."""
    # Load only: read with a default client (strict mode rejects every streamed legacy
    # completion chunk: `finish_reason` is null until the last, as in OpenAI's own API).
    bg = AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    async with strict_client(server) as c, bg:
        k = rng.randrange(2, 9)
        events = [asyncio.Event() for _ in range(k)]
        first = rng.randrange(0, k + 1)
        tasks = [asyncio.create_task(_background(bg, model, rng, e)) for e in events[:first]]
        await asyncio.gather(*(e.wait() for e in events[:first]))
        runs = {
            (kind, lane): asyncio.create_task(measured(c, model, kind, lane, n))
            for kind in REQUESTS
            for lane in (REPRODUCIBLE, FAST)
        }
        tasks += [asyncio.create_task(_background(bg, model, rng, e)) for e in events[first:]]
        await asyncio.gather(*tasks)
        out = {}
        for (kind, lane), task in runs.items():
            outcome, fp = await task
            if not fp.endswith(lane):
                raise AssertionError(f"{kind} in the {lane} lane came back as {fp!r}")
            out[f"{kind}/{lane}"] = outcome
        return out, k


def check(
    server: Server, model: str, trials: int, seed: int = 7, n: int = 20
) -> tuple[dict[str, int], dict[str, Outcome], int]:
    """(trials identical to alone, by "kind/lane"; the alone outcomes; background count)."""
    reference = asyncio.run(alone(server, model, n))
    rng = random.Random(seed)
    same = dict.fromkeys(reference, 0)
    backgrounds = 0
    for _ in range(trials):
        got, k = asyncio.run(trial(server, model, rng, n))
        backgrounds += k
        for key, outcome in got.items():
            same[key] += outcome == reference[key]
    return same, reference, backgrounds


# ---- speed ------------------------------------------------------------------------------
async def _user(
    c: AsyncOpenAI, model: str, lane: str, rng: random.Random, until: float, isl: int, osl: int
) -> tuple[int, float]:
    """Requests back to back until `until`: (tokens after the first, seconds after it)."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if lane == REPRODUCIBLE:
        extra["strata_reproducible"] = "required"
    tokens, seconds = 0, 0.0
    while time.monotonic() < until:
        stream = await c.completions.create(
            model=model, prompt=random_prompt(rng, isl), max_tokens=osl, temperature=0.0,
            stream=True, extra_body=extra,
        )  # fmt: skip
        stamps = [time.monotonic() async for ch in stream if ch.choices and ch.choices[0].text]
        tokens += len(stamps) - 1
        seconds += stamps[-1] - stamps[0]
    return tokens, seconds


async def _mix(
    server: Server, model: str, lanes: list[str], duration_s: float, isl: int, osl: int
) -> dict[str, float]:
    rng = random.Random(len(lanes) * 10 + lanes.count(REPRODUCIBLE))
    async with AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0) as c:
        until = time.monotonic() + duration_s
        t0 = time.monotonic()
        res = await asyncio.gather(*(_user(c, model, ln, rng, until, isl, osl) for ln in lanes))
        wall = time.monotonic() - t0
    out = {"aggregate": sum(t for t, _ in res) / wall}
    for lane in (FAST, REPRODUCIBLE):
        rates = [t / s for (t, s), ln in zip(res, lanes, strict=True) if ln == lane and s > 0]
        if rates:
            out[lane] = statistics.mean(rates)
    return out


def speed(server: Server, model: str, duration_s: float, isl: int, osl: int) -> list[str]:
    rows = ["| users | reproducible | aggregate tok/s | per fast user | per reproducible user |",
            "|---|---|---|---|---|"]  # fmt: skip
    for n, r in ((1, 0), (1, 1), (8, 0), (8, 1), (8, 4)):
        lanes = [REPRODUCIBLE] * r + [FAST] * (n - r)
        m = asyncio.run(_mix(server, model, lanes, duration_s, isl, osl))
        rows.append(
            f"| {n} | {r} | {m['aggregate']:.1f} | {m.get(FAST, 0.0):.1f} | "
            f"{m.get(REPRODUCIBLE, 0.0):.1f} |"
        )
        log.info(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the embedded model)")
    p.add_argument("--ours-args", default="", help="extra `one-gpu serve` options, quoted")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per speed cell")
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=64)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    server_args = ["--n-ctx", "16384", "--n-seq-max", "16", "--repro-slots", "4"]
    if args.model:
        server_args += ["--model", args.model, "--served-model-name", "bench-model"]
    server_args += args.ours_args.split()
    name = "bench-model" if args.model else "gemma-3-270m"
    log_path = Path(tempfile.mkdtemp(prefix="repro-")) / "server.log"
    server = start_server(server_args, log_path)
    try:
        same, _, backgrounds = check(server, name, args.trials)
        print(f"server: one-gpu serve {' '.join(server_args)}")
        print(f"\n{args.trials} trials, {backgrounds} background streams in all; "
              "trials identical to the request alone:\n")  # fmt: skip
        print("| request | reproducible lane | fast lane (control) |\n|---|---|---|")
        for kind in REQUESTS:
            print(f"| {kind} | {same[f'{kind}/{REPRODUCIBLE}']}/{args.trials} | "
                  f"{same[f'{kind}/{FAST}']}/{args.trials} |")  # fmt: skip
        print(f"\nSpeed, greedy, {args.isl}-token prompts, {args.osl} tokens each, "
              f"{args.duration:.0f} s per row (per user: tokens after the first):\n")  # fmt: skip
        print("\n".join(speed(server, name, args.duration, args.isl, args.osl)))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
