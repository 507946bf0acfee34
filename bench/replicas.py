"""Replicas behind the router (vllm-router, bench.router_proc's command line): what the
router costs and where requests land, on bench.multiturn's multi-turn chat workload
(--users conversations of --turns turns, one system prompt shared by all, replies
streamed back into the history, think time between turns; the same text every time).

Configurations, each on fresh servers (no cache carried from one to the next):
  direct         the client straight to one replica
  round-robin-1  through the router (round_robin) to one replica: the proxy's own cost
  router-1       through the router (cache_aware) to one replica: that and its per-request
                 look-ups (/v1/chat/completions/render, 404 here, and /tokenize, on every
                 replica) that its prefix tree reads tokens from
  router-N       through the router (cache_aware) to --replicas replicas
  round-robin-N  through the router (round_robin) to as many, for contrast

Per configuration: requests (failed), wall time, output tok/s, hit rate (cached / prompt
tokens, from the responses' usage), "history kept" (the share of turns >= 2 whose cached
tokens cover the whole previous turn's prompt: the turn reached the replica holding its
conversation), TTFT p50 / p99 and turn >= 2 TTFT p50, and each replica's chat requests
(the growth of its `onegpu_http_responses_total`), medians over --repeats. Then the
one-replica configurations over direct: the router's cost in TTFT and throughput.
Replicas run --threads each (one by default: on a small machine they share its cores; the
figures then say what routing costs and where it sends work, not what more hardware
would buy).

    python -m bench.replicas                                  # CPU, embedded model, minutes
    python -m bench.replicas --users 8 --turns 6 --system-tokens 1500 --question-tokens 120 \\
        --osl 48 --threads 0 --replicas 3 --gpu --model $MODEL   # one GPU each: not here
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import math
import shlex
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.kv_pressure import MetricKey, scrape
from bench.multiturn import (
    NAME,
    ChatWork,
    Rec,
    Run,
    chat_work,
    client,
    fmt,
    hit_rate,
    med,
    ms,
    ratio,
    run_chat,
    table,
    throughput,
    turn_stats,
)
from bench.router_proc import ROUTER_OPTIONS, start_router
from bench.server_proc import Server, on_gpu, served_model, start_many, start_server

log = logging.getLogger("bench.replicas")
CHAT_OK = ("onegpu_http_responses_total", {"route": "/v1/chat/completions", "code": "200"})


@dataclass(frozen=True)
class Config:
    name: str
    replicas: int
    policy: str | None  # None: no router, the client to the one replica


@dataclass
class Result:
    config: Config
    runs: list[Run]  # one a repeat, each on fresh servers
    per_replica: list[list[float]]  # a repeat's chat requests by replica, most first


def configs(n: int) -> list[Config]:
    return [
        Config("direct", 1, None),
        Config("round-robin-1", 1, "round_robin"),
        Config("router-1", 1, "cache_aware"),
        Config(f"router-{n}", n, "cache_aware"),
        Config(f"round-robin-{n}", n, "round_robin"),
    ]


def replica_args(args: argparse.Namespace, model: Path, gpu: bool) -> list[str]:
    cmd = ["--model", str(model), "--served-model-name", NAME, "--n-ctx", str(args.n_ctx),
           "--n-seq-max", str(args.n_seq_max), "--threads", str(args.threads),
           "--n-gpu-layers", "-1" if gpu else "0", "--repro-slots", "0"]  # fmt: skip
    return [*cmd, *shlex.split(args.replica_args)]


def chat_requests(metrics: dict[MetricKey, float]) -> float:
    name, labels = CHAT_OK
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


def history_kept(records: Sequence[Rec]) -> float:
    """The share of answered turns >= 2 whose cached tokens cover the previous turn's whole
    prompt; NaN if there are none."""
    by_user: dict[int, dict[int, Rec]] = {}
    for r in records:
        by_user.setdefault(r.user, {})[r.turn] = r
    kept = total = 0
    for turns in by_user.values():
        for t, r in turns.items():
            prev = turns.get(t - 1)
            if t < 2 or prev is None or r.error is not None or prev.error is not None:
                continue
            total += 1
            kept += r.cached_tokens >= prev.prompt_tokens
    return kept / total if total else math.nan


async def measure(
    target: Server, replicas: list[Server], work: ChatWork, osl: int
) -> tuple[Run, list[float]]:
    """The chat workload through `target`; each replica's chat requests over it."""
    async with httpx.AsyncClient(timeout=60) as h:
        for r in replicas:  # graph allocation, page faults: not measured
            warm = {"model": NAME, "prompt": "Warm-up request.", "max_tokens": 4}
            await h.post(r.base_url + "/completions", json=warm)
        before = [await scrape(h, r.url) for r in replicas]
        async with client(target.base_url) as c:
            run = await run_chat(c, work, osl)
        after = [await scrape(h, r.url) for r in replicas]
    return run, [chat_requests(a) - chat_requests(b) for a, b in zip(after, before, strict=True)]


def run_config(
    config: Config, args: argparse.Namespace, work: ChatWork, serve: list[str], logdir: Path
) -> Result:
    out = Result(config, [], [])
    for rep in range(args.repeats):
        log.info("%s: %d replica(s), repeat %d/%d", config.name, config.replicas, rep + 1,
                 args.repeats)  # fmt: skip
        name = f"{config.name}-{rep}"
        logs = [logdir / f"{name}-replica-{i}.log" for i in range(config.replicas)]
        replicas = start_many([functools.partial(start_server, serve, path) for path in logs])
        router: Server | None = None
        try:
            if config.policy is not None:
                urls = [r.url for r in replicas]
                router = start_router(urls, logdir / f"{name}-router.log", config.policy)
            run, per_replica = asyncio.run(measure(router or replicas[0], replicas, work, args.osl))
        finally:
            for srv in [*([router] if router else []), *replicas]:
                srv.stop()
        out.runs.append(run)
        out.per_replica.append(sorted(per_replica, reverse=True))
    return out


def row(r: Result) -> list[str]:
    """A configuration's cells: medians over its repeats (requests summed)."""
    alls = [turn_stats(run.records) for run in r.runs]
    later = [turn_stats(run.records, 0) for run in r.runs]
    spread = [med(list(by_rank)) for by_rank in zip(*r.per_replica, strict=True)]
    return [
        r.config.name, str(r.config.replicas),
        f"{sum(s.requests for s in alls)} ({sum(s.failed for s in alls)})",
        fmt(med([run.wall_s for run in r.runs]), digits=1),
        fmt(med([throughput(run) for run in r.runs]), digits=1),
        fmt(med([hit_rate(run.records) for run in r.runs]), 100.0, 1) + "%",
        fmt(med([history_kept(run.records) for run in r.runs]), 100.0, 0) + "%",
        ms(med([s.ttft_p50 for s in alls])), ms(med([s.ttft_p99 for s in alls])),
        ms(med([s.ttft_p50 for s in later])),
        " / ".join(f"{n:.0f}" for n in spread),
    ]  # fmt: skip


def cost(over: Result, base: Result) -> list[str]:
    """TTFT p50 (all turns, turns >= 2) and output tok/s of `over` / `base`, medians."""

    def m(r: Result, f: Callable[[Run], float]) -> float:
        return med([f(run) for run in r.runs])

    def p50(turn: int | None) -> Callable[[Run], float]:
        return lambda run: turn_stats(run.records, turn).ttft_p50

    return [
        over.config.name,
        ratio(m(over, p50(None)), m(base, p50(None))),
        ratio(m(over, p50(0)), m(base, p50(0))),
        ratio(m(over, throughput), m(base, throughput)),
    ]


def report(results: Sequence[Result], args: argparse.Namespace) -> list[str]:
    head = ["configuration", "replicas", "requests (failed)", "wall s", "output tok/s",
            "hit rate", "history kept", "TTFT p50 ms", "TTFT p99 ms", "turn>=2 TTFT p50 ms",
            "chat requests per replica (most first)"]  # fmt: skip
    out = [
        f"\n## chat: {args.users} users x {args.turns} turns, system ~{args.system_tokens:,} "
        f"tokens (shared), questions ~{args.question_tokens}, {args.osl} out, think "
        f"{args.think_min}-{args.think_max} s; replicas --threads {args.threads}; median of "
        f"{args.repeats}\n",
        *table(head, [row(r) for r in results], left=1),
    ]
    by = {r.config.name: r for r in results}
    if "direct" in by:
        rows = [cost(by[n], by["direct"]) for n in ("round-robin-1", "router-1") if n in by]
        out += ["\n## The router's cost: through it to one replica / straight to it\n"]
        out += table(["configuration", "TTFT p50", "turn>=2 TTFT p50", "output tok/s"], rows)
    for r in results:
        errors = sorted({rec.error for run in r.runs for rec in run.records if rec.error})
        out += [f"  {r.config.name} error: {e}" for e in errors]
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--users", type=int, default=6, help="conversations at once")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--system-tokens", type=int, default=400, help="shared system prompt")
    p.add_argument("--question-tokens", type=int, default=40, help="each user message")
    p.add_argument("--think-min", type=float, default=0.5, help="pause between turns, s")
    p.add_argument("--think-max", type=float, default=1.5)
    p.add_argument("--stagger", type=float, default=0.25, help="user i starts at i x this")
    p.add_argument("--osl", type=int, default=16, help="tokens each reply generates")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="fresh servers each; medians")
    p.add_argument("--n-ctx", type=int, default=8192, help="each replica's KV pool")
    p.add_argument("--n-seq-max", type=int, default=8, help="each replica's slots")
    p.add_argument("--threads", type=int, default=1, help="each replica's (0: all cores)")
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--replica-args", default="", help="extra `one-gpu serve` options, quoted")
    p.add_argument("--only", nargs="+", help="these configurations (names as printed)")
    args = p.parse_args(argv)
    if min(args.replicas, args.users, args.turns, args.osl, args.repeats) < 1:
        p.error("--replicas, --users, --turns, --osl and --repeats must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    gpu = on_gpu(args.gpu)
    model = served_model(args.model)
    serve = replica_args(args, model, gpu)
    work = chat_work(args)
    logdir = Path(tempfile.mkdtemp(prefix="onegpu-replicas-"))
    chosen = [c for c in configs(args.replicas) if not args.only or c.name in args.only]
    results = [run_config(c, args, work, serve, logdir) for c in chosen]
    print(f"model {model.name}, gpu {gpu}; replicas: one-gpu serve {shlex.join(serve)}")
    print(f"router: vllm-router --policy POLICY {shlex.join(ROUTER_OPTIONS)}")
    print("\n".join(report(results, args)))
    print(f"\nserver and router logs: {logdir}")


if __name__ == "__main__":
    main()
