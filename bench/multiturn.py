"""Multi-turn chat and shared-prefix bursts: what a prefix cache buys. Ours and llama.cpp's
`llama-server` (its cache on: `cache_prompt`, its default, and `--cache-reuse 256`; one
unified KV buffer, `-kvu -c POOL`), same model, same prompts, same run.

Scenarios:
  chat   --users conversations of --turns turns, all opening with the same system prompt of
         --system-tokens; each turn adds a new user message of --question-tokens and sends
         the whole history (the assistant replies exactly as returned) to
         /v1/chat/completions; users start --stagger s apart and think --think-min to
         --think-max s (seeded) between turns; a failed turn ends its conversation
  burst  --burst requests at once, one system message of --burst-prefix-tokens shared by
         all, then a different short question each

Every request streams --osl tokens (greedy, `ignore_eos`) with usage; per request: TTFT
(sent -> first chunk with content), prompt, completion and cached tokens
(`usage.prompt_tokens_details.cached_tokens`). Reported per server and scenario: TTFT p50 and
p99 per turn, output tok/s (completion tokens / the scenario's wall time, think time
included), hit rate (cached / prompt tokens), failed requests; the ours / llama-server ratios;
and the deltas of our prefix-cache counters on /metrics.

The target "turn-N TTFT within 1.3x of the time to prefill only the new tokens" is read
against probe(n): after the scenarios, on the idle server, the TTFT of a fresh prompt of n
tokens of never-seen text (`cache_prompt: false`), n = the median uncached prompt tokens
(prompt - cached) of our chat turns >= 2; 3 tries, median.

The pool (--n-ctx, both servers; default: what all chat histories need at once, x1.2, or
the burst's shared prefix plus each request's own tokens, whichever is larger) is shared by
--n-seq-max slots (default: the most concurrent requests). llama-server's slots each hold
their own copy of the burst's prefix: a pool sized for one shared copy makes it queue or
refuse burst requests, which this reports as it happens. Text sizes are approximate (words
x 1.15 tokens, measured on Gemma 3's tokenizer); the tables give the counted tokens. A GGUF
without a chat template (the embedded one) gets ours in llama-server too, so that both see
the same prompts. Ours runs first in each repeat (the probe's n comes from it).

    python -m bench.multiturn --users 2 --turns 2 --system-tokens 300 --question-tokens 40 \\
        --osl 8 --burst 4 --burst-prefix-tokens 400 --n-ctx 4096      # CPU, embedded, minutes
    python -m bench.multiturn --gpu --peer-bin $PEER_BIN --model $MODEL --repeats 2 \\
        --json /tmp/multiturn.json                                     # H200, all on the GPU
    python -m bench.multiturn --gpu --cpu-moe --peer-bin $PEER_BIN --model $MODEL \\
        --json /tmp/multiturn-cpu-moe.json                             # H200, experts in RAM
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import shlex
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import httpx2
from openai import AsyncOpenAI, DefaultAsyncHttpx2Client
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from bench.kv_pressure import MetricKey, log_notes, scrape
from bench.peers import ensure_peers
from bench.server_proc import (
    ROOT,
    Server,
    add_pair_options,
    free_port,
    on_gpu,
    served_model,
    start_process,
    start_server,
)
from engine.gguf_header import read_header

log = logging.getLogger("bench.multiturn")
NAME = "bench-model"
SCENARIOS = ("chat", "burst")
SERVERS = ("ours", "llama-server")
TOKENS_PER_WORD = 1.15  # this word list through Gemma 3's tokenizer
TEMPLATE_TOKENS = 8  # a chat message's role markers, about
GEMMA_TEMPLATE = ROOT / "engine" / "templates" / "gemma.jinja"  # ours for GGUFs without one
# Our prefix-cache counters, reported as deltas over each scenario where /metrics has them.
COUNTERS = {
    "onegpu_prefix_cache_query_tokens_total": "prefix query tokens",
    "onegpu_prefix_cache_hit_tokens_total": "prefix hit tokens",
    "onegpu_prefill_tokens_total": "prefill tokens",
    "onegpu_prefix_cache_evicted_cells_total": "evicted cells",
    "onegpu_preemptions_total": "preemptions",
}
_WORD_TEXT = """the a an and or but if then when while because so that this these those it its
they them their we our you your he she his her one two three four five many few some every
each other another time year day week morning evening night hour minute people person child
friend family teacher student doctor city town village country river mountain road house room
door window table chair book letter story question answer idea plan problem reason result
change place garden market school office kitchen water bread coffee music picture paper money
light sound voice color make take give find keep hold bring carry build write read speak
listen learn teach open close walk run travel visit wait watch follow begin finish help move
turn show call ask tell think know feel believe remember forget understand explain describe
decide choose happen become seem good new old small large long short early late simple quiet
bright warm cold clear careful important different possible common useful strong gentle
patient curious honest busy ready always often never sometimes usually again almost already
together slowly quickly nearly about after before under over between through across around
during without within along"""
WORDS = tuple(_WORD_TEXT.split())


# The random-weight models of `bench.synth_moe` have a vocabulary of words `▁w0`, `▁w1`, …
# that their SPM tokenizer never reaches from text (no `▁w` piece to merge through), and
# byte tokens: there, text is lowercase letters, one byte token each, so sizes hold.
SYNTH_WORDS: tuple[str, ...] = ()


def use_synth_words(model: Path) -> None:
    global SYNTH_WORDS
    from gguf import GGUFReader

    field = GGUFReader(model).fields.get("tokenizer.ggml.tokens")
    if field is None or len(field.data) <= 3000:
        return
    if bytes(field.parts[field.data[259]]).decode() == "\u2581w0":
        SYNTH_WORDS = tuple(f"w{i}" for i in range(1000, 3000))


def text(rng: random.Random, n_tokens: int) -> str:
    """About `n_tokens` of sentence-like text from a fixed word list: real words tokenize the
    same way wherever they fall, so both servers count about the same, stable lengths."""
    if SYNTH_WORDS:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(max(1, n_tokens)))
    n_words = max(1, round(n_tokens / TOKENS_PER_WORD))
    out: list[str] = []
    sentence = 0
    for _ in range(n_words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if sentence == 0 else w)
        sentence += 1
        if sentence >= rng.randint(6, 14):
            out[-1] += rng.choice(".?.!")
            sentence = 0
    return " ".join(out) + ("." if sentence else "")


# ---- workloads ------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatWork:
    system: str
    questions: list[list[str]]  # [user][turn]
    think_s: list[list[float]]  # [user][turn]: the pause after that turn's reply
    stagger_s: float  # user i starts at i x this


@dataclass(frozen=True)
class BurstWork:
    prefix: str
    questions: list[str]


def chat_work(args: argparse.Namespace) -> ChatWork:
    """The same text and think times for both servers and every repeat (seeded)."""
    rng = random.Random(f"{args.seed}-chat")
    system = text(rng, args.system_tokens)
    questions = [[text(rng, args.question_tokens) for _ in range(args.turns)]
                 for _ in range(args.users)]  # fmt: skip
    think = [[rng.uniform(args.think_min, args.think_max) for _ in range(args.turns)]
             for _ in range(args.users)]  # fmt: skip
    return ChatWork(system, questions, think, args.stagger)


def burst_work(args: argparse.Namespace) -> BurstWork:
    rng = random.Random(f"{args.seed}-burst")
    prefix = text(rng, args.burst_prefix_tokens)
    return BurstWork(prefix, [text(rng, args.burst_question_tokens) for _ in range(args.burst)])


def default_n_ctx(args: argparse.Namespace) -> int:
    """A pool for every chat history at once (x1.2), or the burst's one shared prefix plus
    each request's own tokens, whichever is larger; rounded up to 1024."""
    need = 0
    if "chat" in args.scenario:
        turn = args.question_tokens + args.osl + 2 * TEMPLATE_TOKENS
        need = round(1.2 * args.users * (args.system_tokens + TEMPLATE_TOKENS + args.turns * turn))
    if "burst" in args.scenario:
        own = args.burst_question_tokens + args.osl + 3 * TEMPLATE_TOKENS
        need = max(need, args.burst_prefix_tokens + args.burst * own + 1024)
    return 1024 * math.ceil(need / 1024)


# ---- one request ----------------------------------------------------------------------
@dataclass
class Rec:
    """One request: times in seconds from its scenario's start."""

    user: int
    turn: int  # 1-based; a burst's requests are all turn 1
    sent: float
    ttft: float | None = None  # None: failed, or no chunk carried content
    end: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # exception or non-200, as the client raised it
    reply: str = ""  # as returned (the next turn sends it back): why a cache missed, say


def _cached(usage: CompletionUsage) -> int:
    details = usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


async def chat_request(
    c: AsyncOpenAI, messages: list[ChatCompletionMessageParam], osl: int, rec: Rec, t0: float
) -> str:
    """Stream one chat completion into `rec`; the reply's text. A failure is recorded, not
    raised: how a server fails is a result here."""
    reply: list[str] = []
    try:
        stream = await c.chat.completions.create(
            model=NAME, messages=messages, max_tokens=osl, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                if rec.ttft is None:
                    rec.ttft = time.monotonic() - t0 - rec.sent
                reply.append(ch.choices[0].delta.content)
            if ch.usage is not None:
                rec.prompt_tokens = ch.usage.prompt_tokens
                rec.completion_tokens = ch.usage.completion_tokens
                rec.cached_tokens = _cached(ch.usage)
    except Exception as e:  # recorded and reported (see the docstring)
        rec.error = f"{type(e).__name__}: {str(e)[:200]}"
        log.warning("user %d turn %d: %s", rec.user, rec.turn, rec.error)
    rec.end = time.monotonic() - t0
    rec.reply = "".join(reply)
    return rec.reply


def client(base_url: str) -> AsyncOpenAI:
    # A new connection per request: llama-server closes kept-alive connections at times,
    # and a request sent on a closing one fails (as bench/loadgen.py does).
    http = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0))
    return AsyncOpenAI(
        base_url=base_url, api_key="none", max_retries=0, timeout=1800, http_client=http
    )


# ---- scenarios ------------------------------------------------------------------------
@dataclass
class Run:
    """One scenario on one server."""

    wall_s: float
    records: list[Rec]
    metrics: dict[str, float] | None = None  # our counters' deltas (those /metrics has)


async def run_chat(c: AsyncOpenAI, work: ChatWork, osl: int) -> Run:
    records: list[Rec] = []
    t0 = time.monotonic()

    async def user(u: int) -> None:
        await asyncio.sleep(u * work.stagger_s)
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": work.system}]
        for t, question in enumerate(work.questions[u]):
            messages.append({"role": "user", "content": question})
            rec = Rec(u, t + 1, time.monotonic() - t0)
            records.append(rec)
            reply = await chat_request(c, messages, osl, rec, t0)
            if rec.error is not None:
                return  # no reply to build on: this conversation ends here
            messages.append({"role": "assistant", "content": reply})
            if t + 1 < len(work.questions[u]):
                await asyncio.sleep(work.think_s[u][t])

    await asyncio.gather(*(user(u) for u in range(len(work.questions))))
    return Run(time.monotonic() - t0, records)


async def run_burst(c: AsyncOpenAI, work: BurstWork, osl: int) -> Run:
    t0 = time.monotonic()
    records = [Rec(i, 1, 0.0) for i in range(len(work.questions))]
    chats: list[list[ChatCompletionMessageParam]] = [
        [{"role": "system", "content": work.prefix}, {"role": "user", "content": q}]
        for q in work.questions
    ]
    await asyncio.gather(
        *(chat_request(c, m, osl, r, t0) for m, r in zip(chats, records, strict=True))
    )
    return Run(time.monotonic() - t0, records)


@dataclass
class Probe:
    """TTFT of a fresh prompt of `tokens` never-seen tokens on the idle server."""

    tokens: int
    prompt_tokens: int = 0  # as the server counted them
    ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def probe(c: AsyncOpenAI, n_tokens: int, tries: int, seed: str) -> Probe:
    out = Probe(n_tokens)
    rng = random.Random(seed)
    for _ in range(tries):
        t0 = time.monotonic()
        first: float | None = None
        try:
            stream = await c.completions.create(
                model=NAME, prompt=text(rng, n_tokens), max_tokens=2, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "cache_prompt": False},
            )  # fmt: skip
            async for ch in stream:
                if first is None and ch.choices and ch.choices[0].text:
                    first = time.monotonic() - t0
                if ch.usage is not None:
                    out.prompt_tokens = ch.usage.prompt_tokens
        except Exception as e:  # recorded and reported
            out.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            continue
        # no text in 2 tokens (a control token, say): the whole request bounds the TTFT
        out.ttft_s.append(first if first is not None else time.monotonic() - t0)
    return out


def uncached_tokens(records: Sequence[Rec]) -> float:
    """The median prompt tokens a chat turn >= 2 computed (prompt - cached); NaN if none."""
    xs = [r.prompt_tokens - r.cached_tokens for r in records if r.turn >= 2 and r.error is None]
    return float(statistics.median(xs)) if xs else math.nan


def counter_deltas(
    before: dict[MetricKey, float], after: dict[MetricKey, float]
) -> dict[str, float]:
    """Growth of each of COUNTERS between two scrapes, summed over labels; those absent from
    the second scrape are left out."""
    out: dict[str, float] = {}
    for (name, labels), v in after.items():
        if name in COUNTERS:
            out[name] = out.get(name, 0.0) + v - before.get((name, labels), 0.0)
    return out


@dataclass
class Trial:
    """One repeat on one server: its scenarios, then the probe."""

    runs: dict[str, Run]
    probe: Probe | None
    log_notes: list[str]


async def trial(
    srv: Server, works: dict[str, ChatWork | BurstWork], args: argparse.Namespace,
    probe_tokens: int | None, *, ours: bool,
) -> Trial:  # fmt: skip
    """`probe_tokens` None: from this trial's chat (ours)."""
    runs: dict[str, Run] = {}
    async with httpx.AsyncClient(timeout=60) as h, client(srv.base_url) as c:
        try:  # graph allocation, page faults: not measured
            await c.completions.create(model=NAME, prompt="Warm-up request.", max_tokens=4)
        except Exception as e:  # the scenarios will show what fails
            log.warning("warm-up: %s: %s", type(e).__name__, e)
        for name, work in works.items():
            log.info("%s: %s", "ours" if ours else "llama-server", name)
            before = await scrape(h, srv.url) if ours else {}
            scenario = (
                run_chat(c, work, args.osl) if isinstance(work, ChatWork)
                else run_burst(c, work, args.osl)
            )  # fmt: skip
            try:
                runs[name] = await asyncio.wait_for(scenario, args.scenario_timeout or None)
            except TimeoutError:  # a server that cannot keep up must not eat the session
                why = f"the scenario did not finish in {args.scenario_timeout:g} s"
                log.warning("%s: %s", name, why)
                runs[name] = Run(args.scenario_timeout, [Rec(-1, 1, 0.0, error=why)])
                return Trial(runs, None, [])
            if ours:
                runs[name].metrics = counter_deltas(before, await scrape(h, srv.url))
        if probe_tokens is None:
            measured = uncached_tokens(runs["chat"].records) if "chat" in runs else math.nan
            probe_tokens = args.question_tokens if math.isnan(measured) else round(measured)
        got = None
        if probe_tokens > 0 and args.probe_tries > 0:
            got = await probe(c, probe_tokens, args.probe_tries, f"{args.seed}-probe")
    return Trial(runs, got, [])


# ---- servers --------------------------------------------------------------------------
def n_seq(args: argparse.Namespace) -> int:
    """Slots: the most requests a scenario has in flight at once."""
    if args.n_seq_max:
        return int(args.n_seq_max)
    most = {"chat": int(args.users), "burst": int(args.burst)}
    return max(most[s] for s in args.scenario)


def start_ours(args: argparse.Namespace, model: Path, gpu: bool, log_path: Path) -> Server:
    cmd = ["--model", str(model), "--served-model-name", NAME, "--n-ctx", str(args.n_ctx),
           "--n-seq-max", str(n_seq(args)), "--n-gpu-layers", "-1" if gpu else "0"]  # fmt: skip
    if args.cache_seqs:
        cmd += ["--cache-seqs", str(args.cache_seqs)]
    if args.cpu_moe:
        cmd.append("--cpu-moe")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return start_server([*cmd, *shlex.split(args.ours_args)], log_path)


def start_peer(args: argparse.Namespace, model: Path, gpu: bool, log_path: Path) -> Server:
    """llama-server as it serves chat best: one unified KV buffer of our pool shared by as
    many slots, prompt caching (the default, host-RAM prompt cache included) and reuse of
    cached chunks by KV shifting; the chat template ours uses."""
    exe = (
        Path(args.peer_bin) / "llama-server"
        if args.peer_bin
        else ensure_peers(Path(args.cache).resolve(), cuda=gpu).server
    )
    port = free_port()
    cmd = [str(exe), "-m", str(model), "-a", NAME, "-c", str(args.n_ctx), "-np", str(n_seq(args)),
           "-kvu", "--cache-reuse", "256", "--no-webui", "--metrics",
           "-ngl", "999" if gpu else "0", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if "tokenizer.chat_template" not in read_header(model).fields:
        # Ours then renders chats with its shipped Gemma template, llama-server with ChatML,
        # whose markers Gemma's vocabulary splits: 27 more tokens a turn on the embedded model.
        cmd += ["--jinja", "--chat-template-file", str(GEMMA_TEMPLATE)]
    if args.cpu_moe:
        cmd.append("--cpu-moe")
    if args.threads:
        cmd += ["-t", str(args.threads)]
    return start_process([*cmd, *shlex.split(args.peer_args)], port, log_path)


def serve(
    srv: Server, works: dict[str, ChatWork | BurstWork], args: argparse.Namespace,
    probe_tokens: int | None, *, ours: bool,
) -> Trial:  # fmt: skip
    ready = len(srv.log())  # what it logged while starting is not this benchmark's
    try:
        out = asyncio.run(trial(srv, works, args, probe_tokens, ours=ours))
    finally:
        srv.stop()
    out.log_notes = log_notes(srv.log()[ready:])
    return out


# ---- statistics and tables ------------------------------------------------------------
def pct(xs: Sequence[float], q: float) -> float:
    """The q-quantile, linear between order statistics; NaN of nothing."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def med(xs: Sequence[float]) -> float:
    """Median over repeats of the figures that exist (not NaN); NaN if none does."""
    have = [x for x in xs if not math.isnan(x)]
    return float(statistics.median(have)) if have else math.nan


@dataclass(frozen=True)
class TurnStats:
    requests: int
    failed: int
    prompt_tokens: float  # mean over the turn's answered requests
    cached_tokens: float
    ttft_p50: float  # seconds
    ttft_p99: float


def turn_stats(records: Sequence[Rec], turn: int | None = None) -> TurnStats:
    """Over one turn's requests (None: all; 0: turns >= 2)."""
    rs = [r for r in records if turn is None or r.turn == turn or (turn == 0 and r.turn >= 2)]
    ok = [r for r in rs if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    return TurnStats(
        requests=len(rs),
        failed=len(rs) - len(ok),
        prompt_tokens=statistics.mean(r.prompt_tokens for r in ok) if ok else math.nan,
        cached_tokens=statistics.mean(r.cached_tokens for r in ok) if ok else math.nan,
        ttft_p50=pct(ttft, 0.5),
        ttft_p99=pct(ttft, 0.99),
    )


def throughput(run: Run) -> float:
    return sum(r.completion_tokens for r in run.records if r.error is None) / run.wall_s


def hit_rate(records: Sequence[Rec]) -> float:
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else math.nan


def fmt(x: float, unit: float = 1.0, digits: int = 0) -> str:
    return "-" if math.isnan(x) else f"{x * unit:,.{digits}f}"


def ms(x: float) -> str:
    return fmt(x, 1000.0)


def ratio(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}"


def table(head: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """A markdown table; the first `left` columns left-aligned, the rest right."""
    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i < left else "---:" for i in range(len(head))) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def turn_rows(who: str, trials: Sequence[Trial], scenario: str, turns: int) -> list[list[str]]:
    rows = []
    for t in range(1, turns + 1):
        st = [turn_stats(tr.runs[scenario].records, t) for tr in trials]
        rows.append([
            who if t == 1 else "", str(t),
            f"{sum(s.requests for s in st)} ({sum(s.failed for s in st)})",
            fmt(med([s.prompt_tokens for s in st])), fmt(med([s.cached_tokens for s in st])),
            ms(med([s.ttft_p50 for s in st])), ms(med([s.ttft_p99 for s in st])),
        ])  # fmt: skip
    return rows


@dataclass(frozen=True)
class Summary:
    """One server on one scenario, medians over repeats."""

    requests: int
    failed: int
    wall_s: float
    tok_s: float
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    later_p50: float  # chat turns >= 2
    probe_s: float
    probe_tokens: float

    @property
    def later_over_probe(self) -> float:
        return self.later_p50 / self.probe_s if self.probe_s else math.nan


def summarize(trials: Sequence[Trial], scenario: str) -> Summary:
    runs = [tr.runs[scenario] for tr in trials]
    alls = [turn_stats(r.records) for r in runs]
    probes = [tr.probe for tr in trials if tr.probe is not None]
    return Summary(
        requests=sum(s.requests for s in alls),
        failed=sum(s.failed for s in alls),
        wall_s=med([r.wall_s for r in runs]),
        tok_s=med([throughput(r) for r in runs]),
        hit_rate=med([hit_rate(r.records) for r in runs]),
        ttft_p50=med([s.ttft_p50 for s in alls]),
        ttft_p99=med([s.ttft_p99 for s in alls]),
        later_p50=med([turn_stats(r.records, 0).ttft_p50 for r in runs]),
        probe_s=med([statistics.median(p.ttft_s) if p.ttft_s else math.nan for p in probes]),
        probe_tokens=med([float(p.prompt_tokens or math.nan) for p in probes]),
    )


def report(results: dict[str, list[Trial]], args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    titles = {
        "chat": f"chat: {args.users} users x {args.turns} turns, system ~{args.system_tokens:,} "
        f"tokens, questions ~{args.question_tokens}, {args.osl} out, think "
        f"{args.think_min}-{args.think_max} s",
        "burst": f"burst: {args.burst} requests at once, shared prefix "
        f"~{args.burst_prefix_tokens:,} tokens, questions ~{args.burst_question_tokens}, "
        f"{args.osl} out",
    }
    head = ["server", "turn", "requests (failed)", "prompt tokens", "cached tokens",
            "TTFT p50 ms", "TTFT p99 ms"]  # fmt: skip
    for s in args.scenario:
        out += [f"\n## {titles[s]}; pool {args.n_ctx:,}, median of {args.repeats}\n"]
        turns = args.turns if s == "chat" else 1
        rows = [row for who, trials in results.items() for row in turn_rows(who, trials, s, turns)]
        out += table(head, rows, left=1)
    sums = {(who, s): summarize(ts, s) for s in args.scenario for who, ts in results.items()}
    out += ["\n## Summary\n"]
    rows = []
    for (who, s), m in sums.items():
        chat = s == "chat"
        rows.append([
            s, who, f"{m.requests} ({m.failed})", fmt(m.wall_s, digits=1), fmt(m.tok_s, digits=1),
            fmt(m.hit_rate, 100.0, 1) + ("%" if not math.isnan(m.hit_rate) else ""),
            ms(m.ttft_p50), ms(m.ttft_p99), ms(m.later_p50) if chat else "-",
            f"{ms(m.probe_s)} ({fmt(m.probe_tokens)})" if chat else "-",
            fmt(m.later_over_probe, digits=2) if chat else "-",
        ])  # fmt: skip
    out += table(["scenario", "server", "requests (failed)", "wall s", "output tok/s",
                  "hit rate", "TTFT p50 ms", "TTFT p99 ms", "turn>=2 TTFT p50 ms",
                  "probe ms (its prompt tokens)", "turn>=2 p50 / probe"], rows, left=2)  # fmt: skip
    if len(results) == 2:
        out += ["\n## ours / llama-server\n"]
        rows = []
        for s in args.scenario:
            o, t = sums[("ours", s)], sums[("llama-server", s)]
            rows.append([s, ratio(o.ttft_p50, t.ttft_p50),
                         ratio(o.later_p50, t.later_p50) if s == "chat" else "-",
                         ratio(o.tok_s, t.tok_s)])  # fmt: skip
        out += table(["scenario", "TTFT p50", "turn>=2 TTFT p50", "output tok/s"], rows)
    ours = results.get("ours", [])
    have = [n for n in COUNTERS if any(n in (tr.runs[s].metrics or {})
                                       for tr in ours for s in args.scenario)]  # fmt: skip
    if ours and have:
        out += ["\n## Our /metrics over each scenario (median of repeats)\n"]
        rows = [[s, *(fmt(med([(tr.runs[s].metrics or {}).get(n, math.nan) for tr in ours]))
                      for n in have)] for s in args.scenario]  # fmt: skip
        out += table(["scenario", *(COUNTERS[n] for n in have)], rows)
    elif ours:
        out.append("\nour /metrics has none of the prefix-cache counters: " + ", ".join(COUNTERS))
    for who, trials in results.items():
        errors = {r.error for tr in trials for run in tr.runs.values() for r in run.records}
        errors |= {e for tr in trials if tr.probe for e in tr.probe.errors}
        short = sum(1 for tr in trials for run in tr.runs.values() for r in run.records
                    if r.error is None and r.completion_tokens != args.osl)  # fmt: skip
        notes = dict.fromkeys(n for tr in trials for n in tr.log_notes)
        out.append(f"\n{who}: {short} answered requests not of {args.osl} completion tokens")
        out += [f"  error: {e}" for e in sorted(e for e in errors if e)]
        out += [f"  log: {n}" for n in notes] or ["  log while serving: no warnings or errors"]
    return out


# ---- main -----------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--users", type=int, default=8, help="chat: conversations at once")
    p.add_argument("--turns", type=int, default=6, help="chat: turns per conversation")
    p.add_argument("--system-tokens", type=int, default=1500, help="chat: shared system prompt")
    p.add_argument("--question-tokens", type=int, default=120, help="chat: each user message")
    p.add_argument("--think-min", type=float, default=0.5, help="chat: pause between turns, s")
    p.add_argument("--think-max", type=float, default=2.0)
    p.add_argument("--stagger", type=float, default=0.25, help="chat: user i starts at i x this")
    p.add_argument("--burst", type=int, default=32, help="burst: requests sent at once")
    p.add_argument("--burst-prefix-tokens", type=int, default=4096, help="burst: shared prefix")
    p.add_argument("--burst-question-tokens", type=int, default=40)
    p.add_argument("--osl", type=int, default=48, help="tokens each reply generates")
    p.add_argument("--n-ctx", type=int, default=0, help="KV pool, both servers (0: sized)")
    p.add_argument(
        "--n-seq-max",
        type=int,
        default=0,
        help="ours --n-seq-max, llama-server -np (0: the most requests at once)",
    )
    p.add_argument(
        "--cache-seqs",
        type=int,
        default=None,
        help="ours --cache-seqs (default 0: not passed, the server's default)",
    )
    p.add_argument(
        "--probe-tokens",
        type=int,
        default=0,
        help="probe(n)'s n (0: our chat turns' median uncached tokens)",
    )
    p.add_argument("--probe-tries", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="fresh servers each; medians reported")
    p.add_argument("--scenario-timeout", type=float, default=0,
                   help="give up on a server whose scenario runs longer (0 = never)")  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--threads", type=int, default=0, help="both servers (0: their defaults)")
    p.add_argument("--cpu-moe", action="store_true", help="routed experts in host RAM, both")
    add_pair_options(p)
    args = p.parse_args(argv)
    if min(args.users, args.turns, args.burst, args.osl, args.repeats) < 1:
        p.error("--users, --turns, --burst, --osl and --repeats must be at least 1")
    if not 0 <= args.think_min <= args.think_max:
        p.error("want 0 <= --think-min <= --think-max")
    if args.cache_seqs is None:
        args.cache_seqs = 0  # the server's default
    if not args.n_ctx:
        args.n_ctx = default_n_ctx(args)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    gpu = on_gpu(args.gpu)
    model = served_model(args.model)
    use_synth_words(model)
    works: dict[str, ChatWork | BurstWork] = {}
    if "chat" in args.scenario:
        works["chat"] = chat_work(args)
    if "burst" in args.scenario:
        works["burst"] = burst_work(args)
    logdir = Path(tempfile.mkdtemp(prefix="onegpu-multiturn-"))
    results: dict[str, list[Trial]] = {who: [] for who in SERVERS[: 1 if args.no_peer else 2]}
    for rep in range(args.repeats):
        log.info("repeat %d/%d", rep + 1, args.repeats)
        # ours first: the probe's n comes from our chat turns
        srv = start_ours(args, model, gpu, logdir / f"ours-{rep}.log")
        got = serve(srv, works, args, args.probe_tokens or None, ours=True)
        results["ours"].append(got)
        if not args.no_peer:
            n = got.probe.tokens if got.probe else args.probe_tokens
            srv = start_peer(args, model, gpu, logdir / f"llama-server-{rep}.log")
            results["llama-server"].append(serve(srv, works, args, n, ours=False))
    print(f"model {model.name}, gpu {gpu}, cpu-moe {args.cpu_moe}, pool {args.n_ctx:,}, "
          f"slots {n_seq(args)}, threads {args.threads or 'default'}, ours "
          f"--cache-seqs {args.cache_seqs or '(not passed)'} {args.ours_args!r}, "
          f"llama-server {args.peer_args!r}")  # fmt: skip
    print("\n".join(report(results, args)))
    print(f"\nserver logs: {logdir}")
    if args.json:
        raw = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "model": str(model), "gpu": gpu,
               "results": {w: [asdict(t) for t in ts] for w, ts in results.items()}}  # fmt: skip
        args.json.write_text(json.dumps(raw, indent=1))
        log.info("raw results in %s", args.json)


if __name__ == "__main__":
    main()
