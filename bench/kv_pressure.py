"""KV pressure: more concurrent prompt than the KV pool holds. Does the server still finish
every request whole, and in about the time it takes to serve them one after another — or
does it thrash (preempt and recompute), fail, or cut requests short? Ours and llama.cpp's
`llama-server` (one unified KV buffer of the same size, `-kvu -c POOL`), same model, same
prompts, same run.

Scenarios (the pool is `--n-ctx` tokens):
  ten      10 requests, prompts of 30-45% of the pool each
  two-big  2 requests, prompts of pool - osl - 8 tokens each
  mixed    --clients requests, prompts uniform in [--min-prompt, --max-prompt]

Each is sent one after another (serial), then together: the first, and the rest as soon as
the server has queued it (so "the first request" is the one first in line, as when it came
a moment before the others); every reply must end with finish_reason "length" and exact
usage. From our /metrics: what the together phase
cost in preemptions, recomputed tokens, swapped bytes and KV waits.

    python -m bench.kv_pressure --scenario ten --n-ctx 1024 --osl 48         # CPU, embedded
    python -m bench.kv_pressure --scenario ten two-big --n-ctx 4096 --repeats 3
    python -m bench.kv_pressure --gpu --peer-bin DIR --model M --scenario mixed \\
        --n-ctx 16384 --clients 12 --min-prompt 3000 --max-prompt 14000 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import shlex
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import prompt
from bench.peers import ensure_peers
from bench.server_proc import (
    Server,
    add_pair_options,
    free_port,
    on_gpu,
    served_model,
    start_process,
    start_server,
)

log = logging.getLogger("bench.kv_pressure")
NAME = "bench-model"
SCENARIOS = ("ten", "two-big", "mixed")
MetricKey = tuple[str, tuple[tuple[str, str], ...]]  # sample name, sorted labels


@dataclass
class Reply:
    seconds: float  # serial: the request's own time; together: its end from the common start
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None  # transport error or non-200 answer


@dataclass
class Trial:
    """One repeat of one scenario on one server."""

    serial_s: float
    first_alone_s: float  # the first request's time in the serial phase
    together_s: float
    first_together_s: float  # the first request's end, from the together phase's start
    output_tokens: int  # completion tokens the together phase got back
    num_bad: int  # together-phase replies that failed or fell short
    serial_violations: list[str]
    together_violations: list[str]
    together_finish: dict[str, int]  # finish reasons (or "error") of the together phase
    metrics: dict[str, float] | None  # our /metrics deltas over the together phase
    serial_replies: list[Reply] = field(default_factory=list)
    together_replies: list[Reply] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.together_s / self.serial_s

    @property
    def first_ratio(self) -> float:
        return self.first_together_s / self.first_alone_s


def prompt_sizes(scenario: str, pool: int, osl: int, args: argparse.Namespace) -> list[int]:
    """Prompt lengths of a scenario, seeded so both servers get the same."""
    rng = random.Random(args.seed)
    if scenario == "ten":
        return [rng.randint(int(0.30 * pool), int(0.45 * pool)) for _ in range(10)]
    if scenario == "two-big":
        return [pool - osl - 8] * 2
    return [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.clients)]


def violations(reply: Reply, n_prompt: int, osl: int) -> list[str]:
    """How a reply falls short of a whole, exact completion."""
    if reply.error is not None:
        return [reply.error]
    bad = []
    if reply.finish_reason != "length":
        bad.append(f"finish_reason {reply.finish_reason!r}")
    want = {"prompt_tokens": n_prompt, "completion_tokens": osl, "total_tokens": n_prompt + osl}
    got = {k: (reply.usage or {}).get(k) for k in want}
    if got != want:
        bad.append(f"usage {got} (want {want})")
    return bad


async def complete(
    h: httpx.AsyncClient, base_url: str, ids: list[int], osl: int, since: float | None = None
) -> Reply:
    """One non-streamed completion, timed from `since` (default: the call). Failures are
    recorded in the reply: how a server fails under pressure is what this measures."""
    body = {"model": NAME, "prompt": ids, "max_tokens": osl, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False}  # fmt: skip
    t0 = time.monotonic() if since is None else since
    try:
        r = await h.post(base_url + "/completions", json=body)
    except httpx.HTTPError as e:
        return Reply(time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
    seconds = time.monotonic() - t0
    if r.status_code != 200:
        return Reply(seconds, error=f"HTTP {r.status_code}: {r.text[:200]}")
    got = r.json()
    return Reply(seconds, got["choices"][0].get("finish_reason"), got.get("usage"))


async def scrape(h: httpx.AsyncClient, url: str) -> dict[MetricKey, float]:
    text = (await h.get(url + "/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def pressure_metrics(
    before: dict[MetricKey, float], after: dict[MetricKey, float]
) -> dict[str, float]:
    """The KV-pressure series' growth between two scrapes; a series not exported counts 0."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}

    def total(name: str, **labels: str) -> float:
        return sum(
            v for (n, ls), v in delta.items() if n == name and labels.items() <= dict(ls).items()
        )

    return {
        "preemptions": total("onegpu_preemptions_total"),
        "preemptions_swap": total("onegpu_preemptions_total", kind="swap"),
        "preemptions_recompute": total("onegpu_preemptions_total", kind="recompute"),
        "recomputed_tokens": total("onegpu_recomputed_tokens_total"),
        "swapped_bytes": total("onegpu_swapped_bytes_total"),
        "swapped_bytes_out": total("onegpu_swapped_bytes_total", direction="out"),
        "swapped_bytes_in": total("onegpu_swapped_bytes_total", direction="in"),
        "kv_wait_sum_s": total("onegpu_request_kv_wait_seconds_sum"),
        "kv_wait_count": total("onegpu_request_kv_wait_seconds_count"),
    }


async def accepted(
    h: httpx.AsyncClient, url: str, before: float, first: asyncio.Task[Reply], *, ours: bool
) -> None:
    """Wait until the server has queued one more request than `before` (ours: requests
    accepted; llama-server: requests in a slot or deferred, from 0), or the first request
    has ended (refused, say): the first request of the together phase is then first in
    line, and the others arrive behind it."""
    names = (
        ("onegpu_lane_requests_total",)
        if ours
        else ("llamacpp:requests_processing", "llamacpp:requests_deferred")
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not first.done():
        got = await scrape(h, url)
        if sum(v for (n, _), v in got.items() if n in names) >= before + 1:
            return
        await asyncio.sleep(0.005)  # a poll interval, not a wait for the condition
    if not first.done():
        raise RuntimeError("the first request never reached the server")


async def trial(srv: Server, prompts: list[list[int]], osl: int, *, ours: bool) -> Trial:
    limits = httpx.Limits(max_keepalive_connections=0)  # llama-server drops kept-alive ones
    async with httpx.AsyncClient(timeout=3600, limits=limits) as h:
        await complete(h, srv.base_url, prompts[0][:8], 4)  # warm up
        t0 = time.monotonic()
        serial = [await complete(h, srv.base_url, p, osl) for p in prompts]
        serial_s = time.monotonic() - t0
        before = await scrape(h, srv.url) if ours else {}
        queued = sum(v for (n, _), v in before.items() if n == "onegpu_lane_requests_total")
        t0 = time.monotonic()
        first = asyncio.create_task(complete(h, srv.base_url, prompts[0], osl, t0))
        await accepted(h, srv.url, queued, first, ours=ours)
        rest = await asyncio.gather(*(complete(h, srv.base_url, p, osl, t0) for p in prompts[1:]))
        replies = [await first, *rest]
        together_s = time.monotonic() - t0
        after = await scrape(h, srv.url) if ours else {}

    def bad(rs: Sequence[Reply]) -> list[list[str]]:
        return [violations(r, len(p), osl) for r, p in zip(rs, prompts, strict=True)]

    serial_bad, together_bad = bad(serial), bad(replies)

    return Trial(
        serial_s=serial_s,
        first_alone_s=serial[0].seconds,
        together_s=together_s,
        first_together_s=replies[0].seconds,
        output_tokens=sum(int((r.usage or {}).get("completion_tokens", 0)) for r in replies),
        num_bad=sum(1 for b in together_bad if b),
        serial_violations=[f"request {i}: {v}" for i, b in enumerate(serial_bad) for v in b],
        together_violations=[f"request {i}: {v}" for i, b in enumerate(together_bad) for v in b],
        together_finish=dict(Counter(r.finish_reason or "error" for r in replies)),
        metrics=pressure_metrics(before, after) if ours else None,
        serial_replies=serial,
        together_replies=list(replies),
    )


@dataclass
class ServerRun:
    trials: dict[str, list[Trial]]  # by scenario
    log_notes: list[str]  # its warnings and errors while serving, distinct, most frequent first


def log_notes(text: str, most: int = 8) -> list[str]:
    """Warning and error lines (ours: logging's level names; llama-server: W/E after the
    timestamp), counted with their numbers masked so that one kind is one line."""
    level = re.compile(r"^\S+(?: \S+)? (W|E|WARNING|ERROR) ")
    lines = (" ".join(level.sub("", ln).split()) for ln in text.splitlines() if level.match(ln))
    kinds = Counter(re.sub(r"\d+", "N", ln) for ln in lines)
    return [f"{n}x {kind}" for kind, n in kinds.most_common(most)]


def run_server(
    srv: Server, scenarios: dict[str, list[list[int]]], osl: int, repeats: int, *, ours: bool
) -> ServerRun:
    out: dict[str, list[Trial]] = {}
    ready = len(srv.log())  # what it logged while starting is not this benchmark's
    try:
        for name, prompts in scenarios.items():
            out[name] = []
            for i in range(repeats):
                log.info(
                    "%s: %s, repeat %d/%d", "ours" if ours else "llama-server", name, i + 1, repeats
                )
                out[name].append(asyncio.run(trial(srv, prompts, osl, ours=ours)))
    finally:
        srv.stop()
    return ServerRun(out, log_notes(srv.log()[ready:]))


def start_ours(args: argparse.Namespace, model: Path, gpu: bool, logdir: Path) -> Server:
    cmd = ["--model", str(model), "--served-model-name", NAME, "--n-ctx", str(args.n_ctx),
           "--n-seq-max", str(args.n_seq_max), "--n-gpu-layers", "-1" if gpu else "0"]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return start_server([*cmd, *shlex.split(args.ours_args)], logdir / "ours.log")


def start_peer(args: argparse.Namespace, model: Path, gpu: bool, logdir: Path) -> Server:
    """llama-server with one unified KV buffer of the same pool, shared by as many slots as
    our --n-seq-max, and no host-RAM prompt cache (it would serve the together phase's
    prompts from the serial phase's)."""
    exe = (
        Path(args.peer_bin) / "llama-server"
        if args.peer_bin
        else ensure_peers(Path(args.cache).resolve(), cuda=gpu).server
    )
    port = free_port()
    cmd = [str(exe), "-m", str(model), "-a", NAME, "-c", str(args.n_ctx),
           "-np", str(args.n_seq_max), "-kvu", "--cache-ram", "0", "--no-webui", "--metrics",
           "-ngl", "99" if gpu else "0", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if args.threads:
        cmd += ["-t", str(args.threads)]
    return start_process([*cmd, *shlex.split(args.peer_args)], port, logdir / "llama-server.log")


def _median(trials: list[Trial], f: Callable[[Trial], float]) -> float:
    return statistics.median(f(t) for t in trials)


def _metric(trials: list[Trial], key: str) -> float:
    return _median(trials, lambda t: (t.metrics or {}).get(key, 0.0))


def table_row(who: str, trials: list[Trial]) -> str:
    cells = [
        who,
        f"{_median(trials, lambda t: t.serial_s):.2f}",
        f"{_median(trials, lambda t: t.together_s):.2f}",
        f"{_median(trials, lambda t: t.ratio):.2f}",
        f"{_median(trials, lambda t: t.first_ratio):.2f}",
    ]
    if trials[0].metrics is None:
        cells += ["-"] * 4
    else:
        wait_n = _metric(trials, "kv_wait_count")
        wait = f"{_metric(trials, 'kv_wait_sum_s'):.2f} / {wait_n:g}" if wait_n else "-"
        cells += [
            f"{_metric(trials, 'preemptions'):g} ({_metric(trials, 'preemptions_swap'):g}"
            f"/{_metric(trials, 'preemptions_recompute'):g})",
            f"{_metric(trials, 'recomputed_tokens'):g}",
            f"{_metric(trials, 'swapped_bytes') / 1e6:.1f}",
            wait,
        ]
    n_req = sum(len(t.together_replies) for t in trials)
    n_bad = sum(t.num_bad for t in trials)
    tput = _median(trials, lambda t: t.output_tokens / t.together_s)
    return "| " + " | ".join([*cells, f"{tput:.1f}", f"{n_bad}/{n_req}"]) + " |"


def report(
    runs: dict[str, ServerRun], sizes: dict[str, list[int]], args: argparse.Namespace
) -> None:
    head = ("| server | serial s | together s | together / serial | first: together / alone "
            "| preemptions (swap/recompute) | recomputed tokens | swapped MB | KV wait s / n "
            "| output tok/s together | bad replies together |")  # fmt: skip
    for name, ns in sizes.items():
        print(
            f"\n## {name}: {len(ns)} requests, prompts {min(ns)}-{max(ns)} tokens "
            f"(sum {sum(ns)}), pool {args.n_ctx}, {args.osl} out, median of {args.repeats}\n"
        )
        print(head)
        print("|---" * (head.count("|") - 1) + "|")
        for who, run in runs.items():
            print(table_row(who, run.trials[name]))
        for who, run in runs.items():
            trials = run.trials[name]
            finish = sum((Counter(t.together_finish) for t in trials), Counter())
            print(f"\n{who}: finish reasons together {dict(finish)}")
            if any(t.num_bad for t in trials):
                print("  (times together count failed requests' time to fail)")
            seen = [v for t in trials for v in t.serial_violations + t.together_violations]
            for v in dict.fromkeys(re.sub(r"^request \d+: ", "", v) for v in seen):
                print(f"  violation: {v}")
    for who, run in runs.items():
        print(f"\n{who} log while serving, warnings and errors:")
        print("\n".join("  " + n for n in run.log_notes) or "  (none)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=["ten"])
    p.add_argument("--n-ctx", type=int, default=16384, help="the KV pool in tokens, both servers")
    p.add_argument("--osl", type=int, default=96, help="tokens each request generates")
    p.add_argument("--clients", type=int, default=12, help="mixed: concurrent requests")
    p.add_argument("--min-prompt", type=int, default=3000, help="mixed: shortest prompt")
    p.add_argument("--max-prompt", type=int, default=14000, help="mixed: longest prompt")
    p.add_argument("--n-seq-max", type=int, default=16, help="ours --n-seq-max, llama-server -np")
    p.add_argument("--repeats", type=int, default=1, help="trials per scenario; medians reported")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--threads", type=int, default=0, help="both servers (0: their defaults)")
    add_pair_options(p)
    args = p.parse_args(argv)
    for name in args.scenario:
        longest = max(prompt_sizes(name, args.n_ctx, args.osl, args))
        if longest <= 0 or longest + args.osl > args.n_ctx:
            p.error(f"{name}: a {longest}-token prompt and {args.osl} out do not fit the pool")
    if args.min_prompt > args.max_prompt:
        p.error("--min-prompt is above --max-prompt")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    gpu = on_gpu(args.gpu)
    model = served_model(args.model)
    sizes = {s: prompt_sizes(s, args.n_ctx, args.osl, args) for s in args.scenario}
    rng = random.Random(args.seed)
    scenarios = {s: [prompt(rng, n) for n in ns] for s, ns in sizes.items()}
    logdir = Path(tempfile.mkdtemp(prefix="onegpu-kv-pressure-"))
    srv = start_ours(args, model, gpu, logdir)
    runs = {"ours": run_server(srv, scenarios, args.osl, args.repeats, ours=True)}
    if not args.no_peer:
        srv = start_peer(args, model, gpu, logdir)
        runs["llama-server"] = run_server(srv, scenarios, args.osl, args.repeats, ours=False)
    print(f"model {model.name}, gpu {gpu}, threads {args.threads or 'default'}, "
          f"ours {args.ours_args!r}, llama-server {args.peer_args!r}")  # fmt: skip
    report(runs, sizes, args)
    print(f"\nserver logs: {logdir}")
    if args.json:
        raw = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "model": str(model), "gpu": gpu, "prompt_sizes": sizes,
               "results": {who: asdict(run) for who, run in runs.items()}}  # fmt: skip
        args.json.write_text(json.dumps(raw, indent=1))
        log.info("raw results in %s", args.json)


if __name__ == "__main__":
    main()
