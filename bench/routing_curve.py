"""The routing model's hit-rate curve: how many of a layer's picks the routed-expert cache
serves, by its size, under uniform routing and under `bench.skew_router`'s.

Each point is a real server (`--cpu-moe --expert-cache-slots S`) decoding for several
users at once (prompts of random words, sampled output, no early stop); the hit rate is
read from its cache counters, over decode steps only (prompts are larger batches than the
cache takes). Two upload caps: unlimited (every miss uploaded: the routing's own LRU
curve) and the server's default of one expert a layer a step. Beside them, what a cache
pinned to the most picked experts would serve (the planner's estimate, from the same
run's pick counts) and the uniform line S / n_expert. Each point also gives the output
rate of its traffic (tokens over the rounds' wall time, prompts included); size 0 is the
server without a cache, the rate to compare with.

    python -m bench.routing_curve            # a generated 6-layer, 64-expert model
    python -m bench.routing_curve --model M  # any MoE GGUF whose router is F32
    python -m bench.routing_curve --model M --slots 0,32,64 --routings skewed --uploads 1
    python -m bench.routing_curve --experts 256 --used 4 --users 1 --routings measured \\
        --slots 32,64 --uploads all      # the `measured` preset against its real-model points

Routings are `bench.skew_router`'s presets (`uniform`: as written; `skewed`; `measured`),
and `custom` (`--skew`, `--locality`: for matching a curve).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.server_proc import Server, start_server
from bench.skew_router import PRESETS, Routing, preset, skew_router
from engine.expert_split import load_picks
from engine.gguf_meta import read_meta

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Point:
    routing: str
    slots: int
    uploads: int
    hit_rate: float
    pinned: float  # the S most picked experts' share (same run's counts)
    picks: int
    tok_s: float  # output tokens a second over the traffic (prompts included)
    uploads_per_step: float = 0.0  # experts uploaded a decode step, all layers


def _counter(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    raise KeyError(name)


async def _traffic(url: str, users: int, prompt: int, out: int, seed: int) -> int:
    """One round: `users` requests at once; the output tokens they got."""
    rng = random.Random(seed)

    async def one(h: httpx.AsyncClient, i: int) -> int:
        # each user's prompt on a topic of its own: words from a block of the vocabulary
        lo = 300 + 60 * (i + users * seed) % 420  # (a vocabulary of 836 tokens)
        body = {"model": "m", "prompt": [rng.randrange(lo, lo + 60) for _ in range(prompt)],
                "max_tokens": out, "temperature": 1.0, "seed": seed * 100 + i,
                "ignore_eos": True}  # fmt: skip
        r = await h.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600) as h:
        return sum(await asyncio.gather(*(one(h, i) for i in range(users))))


def measure(
    model: Path, routing: str, slots: int, uploads: int, args: argparse.Namespace, work: Path
) -> Point:
    srv: Server = start_server(
        ["--model", str(model), "--served-model-name", "m", "--cpu-moe", "--n-ctx", "8192",
         "--n-seq-max", str(args.users), "--expert-cache-slots", str(slots),
         "--expert-cache-uploads", str(uploads), "--expert-sample-rate", "1",
         "--expert-cache-admission", str(args.admission), "--state-dir", "none",
         "--no-prefix-cache", "--repro-slots", "0"],
        work / f"{routing}-{slots}-{uploads}.log",
    )  # fmt: skip
    try:
        t0, tokens = time.perf_counter(), 0
        for rnd in range(args.rounds):
            tokens += asyncio.run(
                _traffic(srv.url, args.users, args.prompt, args.out, seed=rnd + 1)
            )
        wall = time.perf_counter() - t0
        hits = misses = loaded = 0.0
        if slots > 0:
            text = httpx.get(srv.url + "/metrics").text
            hits = _counter(text, "onegpu_expert_cache_picks_total", result="hit")
            misses = _counter(text, "onegpu_expert_cache_picks_total", result="miss")
            loaded = _counter(text, "onegpu_expert_cache_uploads_total")
        pinned = load_picks(httpx.get(srv.url + "/experts/counts").content).hit(slots)
    finally:
        srv.stop()
    total = hits + misses
    meta = read_meta(str(model))
    steps = total / max(1, meta.n_expert_used * meta.n_layer * args.users)  # ~ decode steps
    return Point(routing, slots, uploads, hits / total if total else 0.0, pinned, int(total),
                 tokens / wall, loaded / steps if steps else 0.0)  # fmt: skip


def _generated(path: Path, n_expert: int, n_used: int) -> Path:
    from tests.tiny_gguf import Shape, write_qwen3moe  # the test suite's model writer

    shape = Shape(n_layer=6, n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_ff=512,
                  n_expert=n_expert, n_expert_used=n_used, n_ff_exp=64)  # fmt: skip
    return write_qwen3moe(path, shape=shape, seed=7, wtype="f16")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="an MoE GGUF (default: a generated one)")
    p.add_argument("--slots", default="4,8,16,32", help="cache sizes to measure")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens a user")
    p.add_argument("--out", type=int, default=96, help="tokens a user decodes")
    p.add_argument("--rounds", type=int, default=2, help="rounds of users, new prompts each")
    p.add_argument("--skew", type=float, default=1.0, help="the custom routing's")
    p.add_argument("--locality", type=float, default=0.5, help="the custom routing's")
    p.add_argument("--routings", default="uniform,skewed",
                   help=f"which routings to measure: {', '.join(PRESETS)}, custom")  # fmt: skip
    p.add_argument("--experts", type=int, default=64, help="the generated model's")
    p.add_argument("--used", type=int, default=8, help="the generated model's")
    p.add_argument(
        "--uploads", default="all,1", help="upload caps (experts a layer a step; all = every miss)"
    )
    p.add_argument("--admission", type=float, default=0.0,
                   help="the server's --expert-cache-admission (0 = LRU)")  # fmt: skip
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = Path(tempfile.mkdtemp(prefix="routing-"))
    base = a.model or _generated(work / "moe.gguf", a.experts, a.used)
    routings = a.routings.split(",")
    settings = {**{n: preset(n, base) for n in PRESETS}, "custom": Routing(a.skew, a.locality)}
    models = {}
    for routing in routings:  # a copy of the model for each rewritten routing
        r = settings[routing]
        if r.skew == 0 and r.locality == 0:
            models[routing] = base
            continue
        models[routing] = work / f"{routing}.gguf"
        shutil.copyfile(base, models[routing])
        skew_router(models[routing], skew=r.skew, locality=r.locality, context=r.context,
                    boost=r.boost)  # fmt: skip
    n_expert = read_meta(str(base)).n_expert
    slots = [int(x) for x in a.slots.split(",")]
    caps = [n_expert if u == "all" else int(u) for u in a.uploads.split(",")]
    points = {
        (routing, s, cap): measure(models[routing], routing, s, cap, a, work)
        for routing in routings
        for s in slots
        for cap in (caps if s > 0 else caps[:1])
    }
    head = " | ".join(
        f"uploads {'all' if c == n_expert else c}: hit rate, tok/s, uploads/step" for c in caps
    )
    print(f"| routing | slots (of {n_expert}) | {head} | most picked S (pinned) | "
          "S / n_expert | picks |")  # fmt: skip
    print("|---|---:|" + "---:|" * len(caps) + "---:|---:|---:|")
    for routing in routings:
        for s in slots:
            got = [points.get((routing, s, c)) for c in caps]
            first = got[0]
            assert first is not None
            cells = " | ".join(
                f"{pt.hit_rate:.1%}, {pt.tok_s:.1f}, {pt.uploads_per_step:.1f}"
                if pt is not None
                else ""
                for pt in got
            )
            print(f"| {routing} | {s} | {cells} | {first.pinned:.1%} | {s / n_expert:.1%} | "
                  f"{first.picks} |")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
