"""Soak: minutes of mixed traffic against one real server process of ours, then its health.

A server that passes every short test can still leak: a sequence an aborted stream never
freed, KV cells a preemption forgot, memory that grows with each request. This drives
`--clients` concurrent users for `--minutes` with a seeded mix — streamed chats read to the
end, streams closed after a few tokens, long token-id prompts (up to ~45% of the KV pool, so
admission works), long outputs (up to an eighth of the pool each, so running requests
outgrow their reserve and preemption works), reproducible-lane requests, n=2 requests and
requests that must be refused with a 400 — on a server started under KV pressure. Then it
checks:

- no 5xx, connection error or malformed response, ever;
- after the warm-up, the server's resident memory moved by at most `--rss-slack-mib`;
- once traffic stops and the queues drain, every lane holds no request and no KV cell.

It prints a report (and `--json PATH` writes it) and exits non-zero when a check fails.

    python -m bench.soak                                    # 30 minutes, embedded model
    python -m bench.soak --minutes 1.5 --warmup-minutes 0.5 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import prompt
from bench.server_proc import Server, start_server

log = logging.getLogger("bench.soak")

DEFAULT_SERVER_ARGS = "--n-ctx 4096 --n-seq-max 8 --repro-slots 2"
LANES_IDLE = ("onegpu_requests_running", "onegpu_requests_waiting")
LANES_EMPTY = (
    "onegpu_kv_cache_used_cells",  # less the prefix cache's (held_at_end)
    "onegpu_kv_cache_reserved_cells",
    "onegpu_swap_space_used_cells",
)
CANCELLED = "cancelled-at-end"
WORDS = ("river", "engine", "winter", "garden", "signal", "copper", "harbor", "lantern", "violin")


class Unexpected(Exception):
    """A response that arrived but is not what the request must get."""

    def __init__(self, detail: str, status: str = "unexpected") -> None:
        super().__init__(detail)
        self.status = status


@dataclass
class Traffic:
    """What every request needs: the clients, the served model and the KV pool's size."""

    client: AsyncOpenAI  # validates every response strictly
    # for streamed completions: their chunks carry `finish_reason: null` until the last,
    # which the SDK's own type rejects in strict mode (for OpenAI's API too)
    loose: AsyncOpenAI
    http: httpx.AsyncClient
    model: str
    pool_cells: int  # the fast lane's KV capacity: long prompts are sized from it


@dataclass
class Tally:
    """Every response's status by request kind, and each failure described."""

    statuses: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def record(self, kind: str, status: str, failure: str | None = None) -> None:
        self.statuses[kind, status] += 1
        if failure is not None:
            at = time.monotonic() - self.t0
            self.failures.append(f"{at:7.1f}s {kind}: {status}: {failure}")
            log.warning("failure: %s", self.failures[-1])


@dataclass
class ServerSample:
    t_s: float  # seconds since traffic began
    rss_mib: float
    kv_used_cells: float  # all lanes
    waiting: float  # requests queued, all lanes


# ---- the requests ---------------------------------------------------------------------
def chat_text(rng: random.Random) -> str:
    return f"Write {rng.randint(3, 12)} short sentences about a {rng.choice(WORDS)}."


async def chat_stream(t: Traffic, rng: random.Random) -> None:
    """A streamed chat read to its end: it must finish with a reason."""
    stream = await t.client.chat.completions.create(
        model=t.model,
        messages=[{"role": "user", "content": chat_text(rng)}],
        max_tokens=rng.randint(8, 64),
        temperature=rng.choice([0.0, 0.7]),
        seed=rng.randrange(1 << 30),
        stream=True,
    )
    reasons = [c.finish_reason async for ch in stream for c in ch.choices if c.finish_reason]
    if len(reasons) != 1:
        raise Unexpected(f"finish reasons {reasons}")


async def cancelled_stream(t: Traffic, rng: random.Random) -> None:
    """A streamed completion closed after a few tokens: the server must abort it."""
    stream = await t.loose.completions.create(
        model=t.model,
        prompt=prompt(rng, rng.randint(16, 256)),
        max_tokens=512,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    wanted, got = rng.randint(1, 8), 0
    async for ch in stream:
        got += sum(1 for c in ch.choices if c.text)
        if got >= wanted:
            break
    await stream.close()
    if got < wanted:
        raise Unexpected(f"the stream ended after {got} of 512 tokens")


async def long_prompt(t: Traffic, rng: random.Random) -> None:
    """A non-streamed completion whose prompt takes up to 45% of the KV pool."""
    n = rng.randint(t.pool_cells // 8, int(0.45 * t.pool_cells))
    out = await t.client.completions.create(
        model=t.model, prompt=prompt(rng, n), max_tokens=rng.randint(1, 24), temperature=0
    )
    if out.usage is None or out.usage.prompt_tokens != n:
        raise Unexpected(f"usage {out.usage} for a {n}-token prompt")


async def long_output(t: Traffic, rng: random.Random) -> None:
    """A completion that grows by up to an eighth of the KV pool: several at once outgrow
    what admission reserved for them, so running requests get preempted (swapped or
    recomputed) and must still finish whole."""
    n, want = rng.randint(16, t.pool_cells // 8), rng.randint(64, t.pool_cells // 8)
    out = await t.client.completions.create(
        model=t.model, prompt=prompt(rng, n), max_tokens=want, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    if out.usage is None or (out.usage.prompt_tokens, out.usage.completion_tokens) != (n, want):
        raise Unexpected(f"usage {out.usage} for {n} tokens in, {want} out")


async def reproducible(t: Traffic, rng: random.Random) -> None:
    """A request served in the reproducible lane; its fingerprint names that lane."""
    out = await t.client.completions.create(
        model=t.model,
        prompt=prompt(rng, rng.randint(16, 256)),
        max_tokens=rng.randint(4, 24),
        temperature=0,
        extra_body={"strata_reproducible": "required"},
    )
    if not (out.system_fingerprint or "").endswith("reproducible"):
        raise Unexpected(f"fingerprint {out.system_fingerprint!r}")


async def two_choices(t: Traffic, rng: random.Random) -> None:
    """A sampled chat with n=2: two choices, each finished."""
    out = await t.client.chat.completions.create(
        model=t.model,
        messages=[{"role": "user", "content": chat_text(rng)}],
        max_tokens=rng.randint(8, 32),
        temperature=0.8,
        seed=rng.randrange(1 << 30),
        n=2,
    )
    if sorted(c.index for c in out.choices) != [0, 1]:
        raise Unexpected(f"choices {[c.index for c in out.choices]}")


def bad_body(model: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(route, body) of a request the server must refuse with a 400."""
    user = {"role": "user", "content": chat_text(rng)}
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/chat/completions", {"model": model, "messages": [user], "max_tokens": -1}),
        ("/chat/completions", {"model": model, "messages": [{**user, "role": "wizard"}]}),
        ("/completions", {"model": model, "prompt": "hi", "strata_reproducible": True}),
        ("/completions", {"model": model, "prompt": [], "max_tokens": 4}),
    ]
    return rng.choice(bodies)


async def bad_request(t: Traffic, rng: random.Random) -> str:
    """A request the server must refuse: a 400 with an OpenAI error body, never a 5xx."""
    route, body = bad_body(t.model, rng)
    r = await t.http.post(route, json=body)
    if r.status_code != 400 or not r.text.startswith('{"error"'):
        raise Unexpected(f"for {body}: {r.text[:200]}", str(r.status_code))
    return "400"


Request = Callable[[Traffic, random.Random], Awaitable[str | None]]
MIX: dict[str, tuple[float, Request]] = {  # kind: (weight, request)
    "chat_stream": (3.0, chat_stream),
    "cancelled_stream": (2.0, cancelled_stream),
    "long_prompt": (2.0, long_prompt),
    "long_output": (1.0, long_output),
    "reproducible": (1.0, reproducible),
    "n2": (1.0, two_choices),
    "bad_request": (0.5, bad_request),
}


async def send(kind: str, t: Traffic, rng: random.Random, tally: Tally) -> None:
    """One request of `kind`; its status tallied, a failure recorded, never raised."""
    try:
        status = await MIX[kind][1](t, rng)
    except openai.APIStatusError as e:  # only a 429 (busy: come back later) is no failure
        tally.record(kind, str(e.status_code), None if e.status_code == 429 else str(e)[:300])
    except (openai.APIConnectionError, httpx.TransportError, httpx2.TransportError) as e:
        tally.record(kind, "connection-error", f"{type(e).__name__}: {e}")
    except openai.APIResponseValidationError as e:
        tally.record(kind, "invalid-response", str(e)[:300])
    except openai.APIError as e:  # an error event inside a stream
        tally.record(kind, "stream-error", str(e)[:300])
    except Unexpected as e:
        tally.record(kind, e.status, str(e))
    except asyncio.CancelledError:  # still running --drain-timeout-s after the end
        tally.record(kind, CANCELLED)
        raise
    else:
        tally.record(kind, status or "200")


async def worker(i: int, seed: int, t: Traffic, deadline: float, tally: Tally) -> None:
    """Worker `i` sends kind `i` of the mix first (so the workers together send every kind
    however few requests a slow or busy host completes), then draws kinds by weight."""
    rng = random.Random(seed * 1000 + i)
    kinds = list(MIX)
    weights = [MIX[k][0] for k in kinds]
    kind = kinds[i % len(kinds)]
    while time.monotonic() < deadline:
        await send(kind, t, rng, tally)
        kind = rng.choices(kinds, weights)[0]


# ---- memory and load -----------------------------------------------------------------
def rss_mib(pid: int) -> float:
    """Resident memory of `pid` now (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def sample_server(srv: Server, every_s: float, stop: asyncio.Event) -> list[ServerSample]:
    """RSS, KV use and queue length every `every_s` until `stop`: memory growth, and the
    evidence that the traffic put the KV pool under pressure."""
    t0 = time.monotonic()

    async def one() -> ServerSample:
        metrics = await asyncio.to_thread(scrape, srv.url)
        kv = sum(by_label(metrics, "onegpu_kv_cache_used_cells", "lane").values())
        waiting = sum(by_label(metrics, "onegpu_requests_waiting", "lane").values())
        return ServerSample(time.monotonic() - t0, rss_mib(srv.proc.pid), kv, waiting)

    samples = [await one()]
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            samples.append(await one())
    return samples


# ---- metrics --------------------------------------------------------------------------
Samples = list[tuple[str, dict[str, str], float]]  # (sample name, labels, value)


def scrape(url: str) -> Samples:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """`name`'s values summed by `label` (series without it under "")."""
    out: dict[str, float] = {}
    for n, labels, v in samples:
        if n == name:
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def total(samples: Samples, name: str) -> float | None:
    """`name` summed over its labels; None when the server does not export it."""
    values = by_label(samples, name, "")
    return sum(values.values()) if values else None


def lane_gauges(samples: Samples, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """lane -> gauge name -> value."""
    out: dict[str, dict[str, float]] = {}
    for name in names:
        for lane, v in by_label(samples, name, "lane").items():
            out.setdefault(lane, {})[name] = v
    return out


def held_at_end(samples: Samples) -> dict[str, dict[str, float]]:
    """The idle and empty gauges by lane; KV cells in use count only those not kept as
    prefix cache (a finished request's KV stays there for later prompts, by design)."""
    lanes = lane_gauges(samples, LANES_IDLE + LANES_EMPTY)
    cached = by_label(samples, "onegpu_kv_cache_cached_cells", "lane")
    for lane, gauges in lanes.items():
        if "onegpu_kv_cache_used_cells" in gauges:
            gauges["onegpu_kv_cache_used_cells"] -= cached.get(lane, 0.0)
    return lanes


def is_idle(samples: Samples) -> bool:
    lanes = lane_gauges(samples, LANES_IDLE)
    return bool(lanes) and all(v == 0 for gauges in lanes.values() for v in gauges.values())


def wait_drained(url: str, timeout_s: float) -> tuple[Samples, bool]:
    """The metrics once no lane runs or queues a request (polled; False at the deadline)."""
    deadline = time.monotonic() + timeout_s
    samples = scrape(url)
    while not is_idle(samples):
        if time.monotonic() > deadline:
            return samples, False
        time.sleep(0.2)  # polling a condition, bounded by the deadline
        samples = scrape(url)
    return samples, True


# ---- the run --------------------------------------------------------------------------
def openai_client(base_url: str, timeout_s: float, *, strict: bool) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=base_url,
        api_key="x",
        max_retries=0,
        timeout=timeout_s,
        _strict_response_validation=strict,
    )


def served_model(srv: Server) -> str:
    return str(httpx.get(srv.base_url + "/models").json()["data"][0]["id"])


def fast_pool_cells(srv: Server, model: str) -> int:
    """The fast lane's KV capacity. The first step sets the gauge: one tiny request first."""
    body = {"model": model, "prompt": [1000], "max_tokens": 1}
    httpx.post(srv.base_url + "/completions", json=body, timeout=60).raise_for_status()
    return int(by_label(scrape(srv.url), "onegpu_kv_cache_capacity_cells", "lane")["fast"])


async def run_traffic(
    srv: Server, args: argparse.Namespace, model: str, pool_cells: int
) -> tuple[Tally, list[ServerSample]]:
    """Traffic for `--minutes`; then the in-flight requests end (or are cancelled after
    `--drain-timeout-s`). Returns the tally and the server's samples."""
    tally = Tally()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_server(srv, args.sample_s, stop))
    timeout = args.request_timeout_s
    async with (
        openai_client(srv.base_url, timeout, strict=True) as client,
        openai_client(srv.base_url, timeout, strict=False) as loose,
        httpx.AsyncClient(base_url=srv.base_url, timeout=timeout) as http,
    ):
        t = Traffic(client, loose, http, model, pool_cells)
        deadline = time.monotonic() + 60 * args.minutes
        workers = [
            asyncio.create_task(worker(i, args.seed, t, deadline, tally))
            for i in range(args.clients)
        ]
        progress = asyncio.create_task(log_progress(tally, deadline))
        _, late = await asyncio.wait(workers, timeout=60 * args.minutes + args.drain_timeout_s)
        for w in late:
            w.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        progress.cancel()
        for w in workers:
            if not w.cancelled():
                w.result()  # a worker that crashed is a bug in this script: say where
    stop.set()
    return tally, await sampler


async def log_progress(tally: Tally, deadline: float) -> None:
    while time.monotonic() < deadline:
        await asyncio.sleep(30)
        done = sum(tally.statuses.values())
        left = max(0.0, deadline - time.monotonic())
        log.info("%d requests, %d failures, %.0f s left", done, len(tally.failures), left)


@dataclass
class RssReport:
    start_mib: float
    after_warmup_mib: float
    max_mib: float
    end_mib: float
    spread_after_warmup_mib: float  # max - min of the samples after the warm-up
    slack_mib: float


def rss_report(
    samples: list[ServerSample], end_mib: float, warmup_s: float, slack: float
) -> RssReport:
    warm = [s.rss_mib for s in samples if s.t_s >= warmup_s] or [samples[-1].rss_mib]
    return RssReport(
        start_mib=samples[0].rss_mib,
        after_warmup_mib=warm[0],
        max_mib=max(max(s.rss_mib for s in samples), end_mib),
        end_mib=end_mib,
        spread_after_warmup_mib=max(warm) - min(warm),
        slack_mib=slack,
    )


@dataclass
class SoakReport:
    minutes: float
    warmup_minutes: float
    clients: int
    seed: int
    server_args: list[str]
    server_log: str
    requests: dict[str, dict[str, int]]  # kind -> status -> count
    num_5xx: int
    num_connection_errors: int
    failures: list[str]  # every 5xx, connection error, malformed or unexpected response
    cancelled_at_end: int  # requests still running --drain-timeout-s after the end
    rss: RssReport
    pool_cells: int  # the fast lane's
    peak_kv_used_cells: float  # the highest sample, all lanes
    peak_waiting: float  # the highest sample, all lanes
    samples: list[ServerSample]
    drained: bool
    lanes_at_end: dict[str, dict[str, float]]  # lane -> gauge -> value
    finished_by_reason: dict[str, float]
    preemptions: float | None
    preemptions_by_kind: dict[str, float]
    recomputed_tokens: float | None
    swapped_bytes: float | None
    log_warnings: list[str]  # the server log's warning, error and traceback lines
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


def count_status(tally: Tally, match: Callable[[str], bool]) -> int:
    return sum(n for (_, status), n in tally.statuses.items() if match(status))


def requests_table(tally: Tally) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (kind, status), n in sorted(tally.statuses.items()):
        out.setdefault(kind, {})[status] = n
    return out


def suspicious_lines(log_text: str, most: int = 40) -> list[str]:
    keys = ("WARNING", "ERROR", "CRITICAL", "Traceback", "Exception")
    return [ln for ln in log_text.splitlines() if any(k in ln for k in keys)][:most]


def judge(r: SoakReport) -> dict[str, bool]:
    leaks = [v for gauges in r.lanes_at_end.values() for v in gauges.values()]
    return {
        "no 5xx": r.num_5xx == 0,
        "no connection errors": r.num_connection_errors == 0,
        "no other failed or unexpected response": (
            len(r.failures) == r.num_5xx + r.num_connection_errors
        ),
        "every request ended before the drain timeout": r.cancelled_at_end == 0,
        "the server drained (no lane runs or queues a request)": r.drained,
        "no leaked sequences or KV cells": bool(leaks) and all(v == 0 for v in leaks),
        f"RSS spread after warm-up <= {r.rss.slack_mib:g} MiB": (
            r.rss.spread_after_warmup_mib <= r.rss.slack_mib
        ),
    }


def render(r: SoakReport) -> str:
    lines = [
        f"soak: {r.minutes:g} min ({r.warmup_minutes:g} warm-up), {r.clients} clients, "
        f"seed {r.seed}, server args: {shlex.join(r.server_args)}",
        f"server log: {r.server_log}",
        "",
        "requests by kind and status:",
    ]
    for kind, statuses in r.requests.items():
        cells = ", ".join(f"{s}: {n}" for s, n in statuses.items())
        lines.append(f"  {kind:<17} {sum(statuses.values()):>5}  ({cells})")
    n_all = sum(sum(s.values()) for s in r.requests.values())
    lines.append(f"  {'total':<17} {n_all:>5}")
    lines.append(
        f"failures: {len(r.failures)} ({r.num_5xx} 5xx, {r.num_connection_errors} "
        "connection errors, the rest malformed or unexpected responses)"
    )
    lines += [f"  {f}" for f in r.failures[:20]]
    lines.append(f"requests cancelled at the end (past --drain-timeout-s): {r.cancelled_at_end}")
    m = r.rss
    lines += [
        "",
        f"RSS MiB: start {m.start_mib:.1f}, after warm-up {m.after_warmup_mib:.1f}, "
        f"max {m.max_mib:.1f}, end {m.end_mib:.1f}; spread after warm-up "
        f"{m.spread_after_warmup_mib:.1f} (slack {m.slack_mib:g}), {len(r.samples)} samples",
        f"peaks sampled: {r.peak_kv_used_cells:g} KV cells in use (fast-lane pool "
        f"{r.pool_cells}), {r.peak_waiting:g} requests waiting",
        "",
        f"at the end (drained: {r.drained}):",
    ]
    for lane, gauges in r.lanes_at_end.items():
        cells = ", ".join(f"{k.removeprefix('onegpu_')} {v:g}" for k, v in gauges.items())
        lines.append(f"  {lane}: {cells}")
    by_kind = ", ".join(f"{k}: {v:g}" for k, v in r.preemptions_by_kind.items() if k)
    lines += [
        "finished by reason: "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(r.finished_by_reason.items())),
        f"preemptions: {r.preemptions}" + (f" ({by_kind})" if by_kind else ""),
        f"recomputed tokens: {r.recomputed_tokens}",
        f"swapped bytes: {'not exported' if r.swapped_bytes is None else r.swapped_bytes}",
        f"server log warnings/errors: {len(r.log_warnings)}",
        *[f"  {ln}" for ln in r.log_warnings[:10]],
        "",
        "checks:",
        *[f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in r.checks.items()],
        f"soak {'passed' if r.ok else 'FAILED'}",
    ]
    return "\n".join(lines)


def soak(args: argparse.Namespace, server_args: list[str], log_path: Path) -> SoakReport:
    warmup_min = args.warmup_minutes
    if warmup_min is None:
        warmup_min = min(3.0, 0.1 * args.minutes)
    srv = start_server(server_args, log_path)
    try:
        model = served_model(srv)
        pool = fast_pool_cells(srv, model)
        log.info("server up (pid %d, fast-lane pool %d cells); traffic for %g min",
                 srv.proc.pid, pool, args.minutes)  # fmt: skip
        tally, samples = asyncio.run(run_traffic(srv, args, model, pool))
        log.info("traffic stopped; waiting for the server to drain")
        metrics, drained = wait_drained(srv.url, args.drain_timeout_s)
        end_mib = rss_mib(srv.proc.pid)
    finally:
        code = srv.stop()
        log.info("server stopped (exit code %d)", code)
    report = SoakReport(
        minutes=args.minutes,
        warmup_minutes=warmup_min,
        clients=args.clients,
        seed=args.seed,
        server_args=server_args,
        server_log=str(log_path),
        requests=requests_table(tally),
        num_5xx=count_status(tally, lambda s: s.startswith("5")),
        num_connection_errors=count_status(tally, lambda s: s == "connection-error"),
        failures=tally.failures,
        cancelled_at_end=count_status(tally, lambda s: s == CANCELLED),
        rss=rss_report(samples, end_mib, 60 * warmup_min, args.rss_slack_mib),
        pool_cells=pool,
        peak_kv_used_cells=max(s.kv_used_cells for s in samples),
        peak_waiting=max(s.waiting for s in samples),
        samples=samples,
        drained=drained,
        lanes_at_end=held_at_end(metrics),
        finished_by_reason=by_label(metrics, "onegpu_requests_finished_total", "finish_reason"),
        preemptions=total(metrics, "onegpu_preemptions_total"),
        preemptions_by_kind=by_label(metrics, "onegpu_preemptions_total", "kind"),
        recomputed_tokens=total(metrics, "onegpu_recomputed_tokens_total"),
        swapped_bytes=total(metrics, "onegpu_swapped_bytes_total"),
        log_warnings=suspicious_lines(srv.log()),
    )
    report.checks = judge(report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="traffic duration")
    p.add_argument(
        "--warmup-minutes",
        type=float,
        default=None,
        help="RSS is judged after this (default: 3, or 10%% of a shorter run)",
    )
    p.add_argument("--clients", type=int, default=6, help="concurrent users")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", help="GGUF (default: the server's, the embedded Gemma 3 270M)")
    p.add_argument(
        "--server-args",
        default=DEFAULT_SERVER_ARGS,
        help=f"`one-gpu serve` options, quoted (default: {DEFAULT_SERVER_ARGS!r})",
    )
    p.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period")
    p.add_argument(
        "--rss-slack-mib",
        type=float,
        default=64.0,
        help="largest RSS spread allowed after the warm-up",
    )
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=120.0,
        help="bound on the end: in-flight requests, then the server's queues",
    )
    p.add_argument("--json", type=Path, help="write the report here as JSON too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    server_args = (["--model", args.model] if args.model else []) + shlex.split(args.server_args)
    log_path = Path(tempfile.mkdtemp(prefix="onegpu-soak-")) / "server.log"
    report = soak(args, server_args, log_path)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
