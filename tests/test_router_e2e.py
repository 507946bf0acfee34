"""End to end: three replicas of the server on the embedded model behind vllm-router (the
router docs/design/router.md chooses, with bench.router_proc's command line), driven by
the official `openai` client with strict response validation and no client retries, so
that every error the router lets through fails a test.

- New work spreads by load: uniform traffic leaves no replica more than 1.5x the mean
  share; a replica kept busy with long prompts (sent to it directly, past the router)
  takes fewer of the router's requests than the mean (the router sends each request to
  the replica with the fewest of its requests in flight; a busy one keeps them longer).
- Conversations stay where their prefix is: the same multi-turn conversations read as
  many prefix-cache tokens through the router (all replicas summed) as on one replica
  alone (at least 80%), and their later turns start sooner than through round-robin, in
  the same run, on conversations of the same shape.
- A replica drained (SIGTERM: /health 503, new requests 503, running ones finish, exit)
  and restarted mid-traffic costs no client an error, and the router sends it work
  again once it is back.

Requests per replica are read from each replica's /metrics
(`onegpu_http_responses_total`), cache reads from `onegpu_prefix_cache_hit_tokens_total`.
"""

from __future__ import annotations

import asyncio
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.multiturn import text
from bench.router_proc import start_router
from bench.server_proc import Server, start_many, start_process, start_server
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e

REPLICAS = 3
# Small pools and one llama.cpp thread each: four servers, the router and the client
# share two cores here.
REPLICA_ARGS = ["--n-ctx", "8192", "--n-seq-max", "8", "--threads", "1", "--repro-slots", "0",
                "--drain-seconds", "30"]  # fmt: skip
CHAT_OK = ("onegpu_http_responses_total", {"route": "/v1/chat/completions", "code": "200"})
HITS = ("onegpu_prefix_cache_hit_tokens_total", {})
# The conversations: each its own system prompt (no prefix shared between them, so only
# the router's placement decides the hits), a few short turns, greedy replies. Five, not
# a multiple of the three replicas: round-robin's counter then moves by 5 a turn, and
# conversations that send their turns in the same order each time cannot keep their
# replica by that coincidence.
USERS, TURNS, SYSTEM_TOKENS, QUESTION_TOKENS, REPLY_TOKENS = 5, 3, 250, 30, 12


@dataclass
class Pool:
    replicas: list[Server]
    single: Server  # the conversations' one-replica baseline, outside the pool
    router: Server  # cache-aware: the chosen policy
    round_robin: Server  # the same replicas in turn, for the TTFT comparison
    logs: Path


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    logs = tmp_path_factory.mktemp("router")
    starts = [
        (lambda i=i: start_server(REPLICA_ARGS, logs / f"replica-{i}.log"))
        for i in range(REPLICAS + 1)
    ]
    *replicas, single = start_many(starts)
    urls = [r.url for r in replicas]
    routers: list[Server] = []
    try:
        routers.append(start_router(urls, logs / "router.log"))
        routers.append(start_router(urls, logs / "round-robin.log", policy="round_robin"))
        yield Pool(replicas, single, routers[0], routers[1], logs)
    finally:
        for srv in [*routers, *replicas, single]:
            srv.stop()


# ---- reading the replicas ------------------------------------------------------------
def sample(srv: Server, metric: tuple[str, dict[str, str]]) -> float:
    """One series of the server's /metrics (0 where it has none yet)."""
    name, labels = metric
    body = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def samples(servers: list[Server], metric: tuple[str, dict[str, str]]) -> list[float]:
    return [sample(s, metric) for s in servers]


def deltas(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling a condition, bounded by the deadline


# ---- clients -------------------------------------------------------------------------
def aclient(srv: Server) -> AsyncOpenAI:
    """No client retries: an error the router lets through is the test's to see."""
    return AsyncOpenAI(
        base_url=srv.base_url, api_key="none", max_retries=0, timeout=120,
        _strict_response_validation=True,
    )  # fmt: skip


async def ask(c: AsyncOpenAI, prompt: str, max_tokens: int, stream: bool = False) -> None:
    """One chat completion; raises whatever the client raises."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = await c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        return
    s = await c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    finish = None
    async for ch in s:
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    assert finish in ("stop", "length")


async def spread(srv: Server, prompts: list[str], in_flight: int, max_tokens: int) -> None:
    """`prompts`, `in_flight` at a time, through `srv`."""
    queue = list(reversed(prompts))
    async with aclient(srv) as c:

        async def worker() -> None:
            while queue:
                await ask(c, queue.pop(), max_tokens)

        await asyncio.gather(*(worker() for _ in range(in_flight)))


def prompts(seed: str, n: int, tokens: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}. {text(rng, tokens)}" for i in range(n)]


# ---- conversations -------------------------------------------------------------------
@dataclass(frozen=True)
class Conversation:
    system: str
    questions: tuple[str, ...]


def conversations(seed: str) -> list[Conversation]:
    rng = random.Random(seed)
    return [
        Conversation(
            text(rng, SYSTEM_TOKENS),
            tuple(text(rng, QUESTION_TOKENS) for _ in range(TURNS)),
        )
        for _ in range(USERS)
    ]


async def converse(c: AsyncOpenAI, conv: Conversation) -> list[float]:
    """The conversation turn by turn (each turn sends the whole history, the replies as
    returned); its turns' times to first token, in seconds."""
    messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}]
    ttfts = []
    for question in conv.questions:
        messages.append({"role": "user", "content": question})
        t0 = time.monotonic()
        first = None
        reply: list[str] = []
        s = await c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=REPLY_TOKENS,
            temperature=0,
            stream=True,
        )
        async for ch in s:
            if ch.choices and ch.choices[0].delta.content:
                first = first or time.monotonic() - t0
                reply.append(ch.choices[0].delta.content)
        assert first is not None, "a turn streamed no text"
        ttfts.append(first)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return ttfts


def run_conversations(srv: Server, convs: list[Conversation]) -> list[list[float]]:
    async def main() -> list[list[float]]:
        async with aclient(srv) as c:
            return list(await asyncio.gather(*(converse(c, conv) for conv in convs)))

    return asyncio.run(main())


def later_turns_p50(ttfts: list[list[float]]) -> float:
    return statistics.median(t for conv in ttfts for t in conv[1:])


# ---- the tests -----------------------------------------------------------------------
def test_uniform_load_spreads_evenly(pool: Pool) -> None:
    before = samples(pool.replicas, CHAT_OK)
    asyncio.run(spread(pool.router, prompts("uniform", 36, 60), in_flight=6, max_tokens=6))
    got = deltas(samples(pool.replicas, CHAT_OK), before)
    print(f"uniform: requests per replica {got}")
    assert sum(got) == 36
    assert max(got) <= 1.5 * statistics.mean(got), f"requests per replica: {got}"


def test_a_replica_busy_with_long_prompts_takes_fewer_requests(pool: Pool) -> None:
    busy = pool.replicas[0]
    long_prompts = prompts("long", 40, 1500)
    stop = asyncio.Event()

    async def keep_busy(c: AsyncOpenAI) -> None:
        """Past the router (its counts miss these), and on /v1/completions, which the
        chat request counts leave out."""
        while not stop.is_set() and long_prompts:
            await c.completions.create(model=MODEL, prompt=long_prompts.pop(), max_tokens=2)

    async def main() -> list[float]:
        async with aclient(busy) as direct:
            loaders = [asyncio.ensure_future(keep_busy(direct)) for _ in range(2)]
            try:
                await asyncio.to_thread(
                    wait_for, lambda: sample(busy, ("onegpu_prefill_tokens_total", {})) > 0,
                    60, "the long prompts to start",
                )  # fmt: skip
                before = await asyncio.to_thread(samples, pool.replicas, CHAT_OK)
                await spread(pool.router, prompts("beside", 36, 60), in_flight=6, max_tokens=6)
                after = await asyncio.to_thread(samples, pool.replicas, CHAT_OK)
            finally:
                stop.set()
                for loader in loaders:  # (a prompt still prefilling is aborted)
                    loader.cancel()
                await asyncio.gather(*loaders, return_exceptions=True)
        return deltas(after, before)

    got = asyncio.run(main())
    print(f"one replica busy: requests per replica (busy first) {got}")
    assert sum(got) == 36
    assert got[0] < 0.75 * statistics.mean(got), f"requests per replica (busy first): {got}"


def test_conversations_stay_on_the_replica_holding_their_prefix(pool: Pool) -> None:
    convs = conversations("prefix")
    hits = sample(pool.single, HITS)
    run_conversations(pool.single, convs)
    single_hits = sample(pool.single, HITS) - hits

    before = samples(pool.replicas, HITS)
    routed = run_conversations(pool.router, convs)
    routed_hits = sum(deltas(samples(pool.replicas, HITS), before))
    # the same shape, other text: round-robin sees none of the routed pass's prefixes
    turned = run_conversations(pool.round_robin, conversations("round-robin"))

    print(
        f"prefix hit tokens: one replica {single_hits:.0f}, routed {routed_hits:.0f}; "
        f"turn>=2 TTFT p50: routed {later_turns_p50(routed):.3f} s, "
        f"round-robin {later_turns_p50(turned):.3f} s"
    )
    assert single_hits > USERS * (TURNS - 1) * SYSTEM_TOKENS  # the baseline reads its cache
    assert routed_hits >= 0.8 * single_hits, (routed_hits, single_hits)
    assert later_turns_p50(routed) < later_turns_p50(turned), (routed, turned)


def test_a_replica_drained_and_restarted_mid_traffic_costs_no_client_an_error(
    pool: Pool,
) -> None:
    """The drain is aimed at: a prefix is placed on one replica first, then a long stream
    on that prefix (which the drain lets finish, through the router) and, right after
    the SIGTERM, requests on that prefix, which the router sends to the draining replica
    until its next health check; beside them, traffic from six clients throughout."""
    rng = random.Random("drain")
    pin = text(rng, 300)  # a prefix the cache-aware policy keeps on one replica
    before = samples(pool.replicas, CHAT_OK)
    asyncio.run(spread(pool.router, [f"{pin} Question 0."], in_flight=1, max_tokens=4))
    placed = deltas(samples(pool.replicas, CHAT_OK), before)
    assert sorted(placed) == [0, 0, 1], placed  # quiet: one replica served it
    which = placed.index(1)
    victim = pool.replicas[which]
    stop = asyncio.Event()
    errors: list[str] = []
    done = [0]

    async def traffic(c: AsyncOpenAI, k: int) -> None:
        rng = random.Random(f"drain-{k}")
        while not stop.is_set():
            try:
                await ask(c, text(rng, 40), rng.choice((8, 24)), stream=rng.random() < 0.5)
                done[0] += 1
            except Exception as e:  # every failure is the test's finding
                errors.append(f"{type(e).__name__}: {e}")

    async def long_stream(c: AsyncOpenAI) -> int:
        s = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{pin} Tell a long story."}],
            max_tokens=150, temperature=0, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )  # fmt: skip
        n = 0
        async for ch in s:
            if ch.usage is not None:
                n = ch.usage.completion_tokens
        return n

    def drain(pinned: Callable[[], None]) -> None:
        wait_for(lambda: done[0] >= 12, 120, "traffic through the router")
        wait_for(lambda: sample(victim, ("onegpu_requests_running", {})) > 0, 60,
                 "the long stream running on the replica")  # fmt: skip
        victim.proc.send_signal(signal.SIGTERM)
        pinned()  # at once: the router has not seen the 503 of /health yet

    def restart() -> Server:
        assert victim.proc.wait(60) in (0, -signal.SIGTERM)
        assert "draining: new requests get 503" in victim.log()
        cmd = [
            sys.executable,
            "-m",
            "api.server.cli",
            "serve",
            "--port",
            str(victim.port),
            *REPLICA_ARGS,
        ]
        back = start_process(cmd, victim.port, pool.logs / f"replica-{which}-restarted.log")
        # the router checks /health every second: the replica serves its requests again
        wait_for(lambda: sample(back, CHAT_OK) >= 3, 60, "the restarted replica's requests")
        return back

    async def main() -> tuple[Server, int]:
        async with aclient(pool.router) as c:
            loop = asyncio.get_running_loop()
            clients = [asyncio.ensure_future(traffic(c, k)) for k in range(6)]
            story = asyncio.ensure_future(long_stream(c))
            pinned: list[asyncio.Future[None]] = []

            def send_pinned() -> None:  # (from the drain's thread)
                for i in range(4):
                    coro = ask(c, f"{pin} Question {i + 1}.", 8)
                    pinned.append(asyncio.run_coroutine_threadsafe(coro, loop))

            try:
                await asyncio.to_thread(drain, send_pinned)
                await asyncio.gather(*(asyncio.wrap_future(f) for f in pinned))
                told = await story
                back = await asyncio.to_thread(restart)
            finally:
                stop.set()
                await asyncio.gather(*clients)
            return back, told

    pool.replicas[which], told = asyncio.run(main())
    refused = victim.log().count('"POST /v1/chat/completions HTTP/1.1" 503')
    print(f"drain: the draining replica answered {refused} chat requests with 503")
    assert errors == [], errors
    assert told == 150  # the stream the drain found running finished, through the router
