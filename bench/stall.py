"""The long-prompt scenario as a user meets it: N users stream tokens; a long prompt
arrives. How long do the decoders wait for their next token while it is prefilled, and how
long does the long prompt wait for its first token — against llama-server in the same run,
same model, same threads, and against the same prompt on an idle server?

    python -m bench.stall --prompt-tokens 8192 --decoders 4 --runs 3   # CPU, embedded model
    python -m bench.stall --gpu --peer-bin DIR --model M --prompt-tokens 65000

What it measures, and why so: each server is set up as a user sets it up, and the figures
are what a streaming client sees (an independent `openai` client gets the same ones).

- Ours runs with its defaults: no `--max-stall-ms` (the default target, `auto`), and no
  `--n-ctx`/`--n-seq-max` unless the scenario does not fit the defaults.
- llama-server runs as a user runs it for N + 1 users: `-np N+1` and a context whose
  slots each hold the long prompt, its defaults otherwise (`-b 2048 -ub 512`, one KV
  stream per slot, its prompt cache): not `-kvu --cache-ram 0`. `--peer-args` adds more.
- Both get the same threads (`-t`, `--threads`: all cores unless given): llama-server
  counts physical cores by default, we count the CPUs we may run on.
- Each server is freshly started for the scenario, as a user's is, and the decoders
  stream for `--warmup-s` first. The prompt on an idle server is measured on another
  fresh start: measured first (as this benchmark did), its unbounded 2,048-row steps
  taught our cost model what a full batch costs at every depth before the scenario, which
  a new server has to learn from its first chunks. The policy before issue 32, 2-core CPU,
  8K prompt, minutes apart: measured so, TTFT 1.19x llama-server's and longest pause
  0.25x; by an independent client against fresh servers, 1.87x and 0.19x. Measured after
  the scenario on the same server, the cached prompts slowed it: 1.28x llama-server's
  idle TTFT, against 1.01x fresh.
- The decoders must still be streaming when the long prompt's first token comes: a
  decoder that ended early would hide the gap.

The prompts are distinct random token ids (exactly the length asked for, on both
servers, whatever the tokenizer): their content does not change what a step costs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import httpx2
from openai import AsyncOpenAI, DefaultAsyncHttpx2Client

from bench.loadgen import prompt
from bench.peers import ensure_peers
from bench.server_proc import (
    Server,
    free_port,
    on_gpu,
    served_model,
    start_process,
    start_server,
)
from engine.config import default_threads

log = logging.getLogger("bench.stall")
NAME = "bench-model"
DECODER_TOKENS = 1024  # each decoder's budget: the warm-up and the prefill take far fewer
DECODER_PROMPT = 32
OURS_N_CTX, OURS_N_SEQ = 16384, 32  # `one-gpu serve` defaults (api.server.cli)


@dataclass
class StallResult:
    max_gap_ms: float  # longest gap of any decoder while the long prompt was prefilled
    median_gap_ms: float  # median gap of the decoders in that window
    p99_gap_ms: float  # their 99th percentile
    ttft_s: float  # the long prompt's time to first token, decoders running
    ttft_idle_s: float  # the same prompt length on the idle server
    decoder_tokens: int  # tokens the decoders received in the window


def _first_token_s(base_url: str, prompt: list[int]) -> float:
    """Time to the first streamed token of a long prompt. Runs in its own thread with its
    own client: encoding a 64K-token request must not block the event loop that reads the
    decoders' streams, or their gaps would measure the client instead of the server."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    with httpx.Client(timeout=3600) as h:
        t0 = time.monotonic()
        with h.stream("POST", base_url + "/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return time.monotonic() - t0
    raise RuntimeError("no token")


async def scenario(
    base_url: str, n_decoders: int, prompt_tokens: int, seed: int, warmup_s: float
) -> StallResult:
    """The decoders, then the long prompt; `ttft_idle_s` is left to `idle_ttft_s`."""
    rng = random.Random(seed)
    http = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0))
    async with AsyncOpenAI(
        base_url=base_url, api_key="none", max_retries=0, timeout=3600, http_client=http
    ) as c:
        stamps: list[list[float]] = [[] for _ in range(n_decoders)]
        streaming = asyncio.Event()
        done = asyncio.Event()

        async def decoder(i: int) -> None:
            stream = await c.completions.create(
                model=NAME,
                prompt=prompt(rng, DECODER_PROMPT),
                max_tokens=DECODER_TOKENS,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            async for ch in stream:
                if ch.choices and ch.choices[0].text:
                    stamps[i].append(time.monotonic())
                    if all(stamps):
                        streaming.set()
                if done.is_set():
                    break
            await stream.close()
            if not done.is_set():
                raise RuntimeError(f"decoder {i} ended before the long prompt's first token")

        tasks = [asyncio.create_task(decoder(i)) for i in range(n_decoders)]
        warm = asyncio.create_task(_after(streaming, warmup_s))
        await asyncio.wait({warm, *tasks}, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t.done():
                t.result()  # a decoder that failed (or ended) before the warm-up: say why
        long_prompt = prompt(rng, prompt_tokens)
        t_send = time.monotonic()
        ttft = await asyncio.to_thread(_first_token_s, base_url, long_prompt)
        t_first = t_send + ttft
        done.set()
        await asyncio.gather(*tasks)
    gaps: list[float] = []
    n_tokens = 0
    for s in stamps:
        window = [t for t in s if t_send <= t <= t_first]
        before = [t for t in s if t < t_send][-1:]
        after = [t for t in s if t > t_first][:1]
        pts = before + window + after
        gaps += [b - a for a, b in itertools.pairwise(pts)]
        n_tokens += len(window)
    return StallResult(
        max_gap_ms=1000 * max(gaps),
        median_gap_ms=1000 * statistics.median(gaps),
        p99_gap_ms=1000 * sorted(gaps)[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        ttft_s=ttft,
        ttft_idle_s=0.0,
        decoder_tokens=n_tokens,
    )


async def _after(event: asyncio.Event, seconds: float) -> None:
    await event.wait()
    await asyncio.sleep(seconds)


def idle_ttft_s(base_url: str, prompt_tokens: int, seed: int) -> float:
    """The same prompt length alone, on a server started for it: measured before the
    scenario, it taught our cost model the prompt's costs (a user's freshly started server
    has not learned them); after it on the same server, the scenario's prompts were still
    cached, and every step attended their KV as well (the unified cache's used range)."""
    return _first_token_s(base_url, prompt(random.Random(seed + 1), prompt_tokens))


def ours_args(args: argparse.Namespace, model: Path, gpu: bool) -> list[str]:
    """`one-gpu serve` as a user runs it: its defaults, but for what the scenario needs."""
    need_ctx = args.prompt_tokens + args.decoders * (DECODER_PROMPT + DECODER_TOKENS) + 1024
    out = ["--model", str(model), "--served-model-name", NAME]
    if need_ctx > OURS_N_CTX:
        out += ["--n-ctx", str(need_ctx)]
    if args.decoders + 1 > OURS_N_SEQ:
        out += ["--n-seq-max", str(args.decoders + 1)]
    if args.max_stall_ms != "auto":
        out += ["--max-stall-ms", args.max_stall_ms]
    out += ["--n-gpu-layers", "-1" if gpu else "0"]
    out += ["--log-level", "info"]  # the server logs each step past the target (scheduler.loop)
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.cpu_moe:
        out += ["--cpu-moe"]
    extra: str = args.ours_args  # last: `--log-level debug` traces every planned step
    return out + extra.split()


def peer_cmd(args: argparse.Namespace, exe: Path, model: Path, gpu: bool, port: int) -> list[str]:
    """llama-server as a user runs it for N + 1 users: N + 1 slots that each hold the long
    prompt (one KV stream per slot, its default with -np), its other defaults, our threads."""
    per_slot = max(args.prompt_tokens, DECODER_PROMPT + DECODER_TOKENS) + 1024
    cmd = [str(exe), "-m", str(model), "-a", NAME]
    cmd += ["-np", str(args.decoders + 1), "-c", str((args.decoders + 1) * per_slot)]
    cmd += ["-t", str(args.threads or default_threads())]
    cmd += ["-ngl", "99" if gpu else "0", "--host", "127.0.0.1", "--port", str(port)]
    if args.cpu_moe:
        cmd += ["--cpu-moe"]
    extra: str = args.peer_args
    return cmd + extra.split()


def run_once(
    args: argparse.Namespace, model: Path, gpu: bool, peer: Path | None, logdir: Path
) -> tuple[dict[str, StallResult], str, list[str]]:
    """One run: ours, then llama-server, each freshly started."""
    results: dict[str, StallResult] = {}
    srv: Server = start_server(ours_args(args, model, gpu), logdir / "ours.log")
    try:
        results["ours"] = asyncio.run(
            scenario(srv.base_url, args.decoders, args.prompt_tokens, 1, args.warmup_s)
        )
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    over = [ln.split(": ", 1)[-1] for ln in srv.log().splitlines() if "over the stall target" in ln]
    srv = start_server(ours_args(args, model, gpu), logdir / "ours-idle.log")
    try:
        results["ours"].ttft_idle_s = idle_ttft_s(srv.base_url, args.prompt_tokens, 1)
    finally:
        srv.stop()
    if peer is not None:
        for name, key in (("llama-server", "scenario"), ("llama-server-idle", "idle")):
            port = free_port()
            cmd = peer_cmd(args, peer, model, gpu, port)
            srv = start_process(cmd, port, logdir / f"{name}.log")
            try:
                if key == "scenario":
                    results["llama-server"] = asyncio.run(
                        scenario(srv.base_url, args.decoders, args.prompt_tokens, 1, args.warmup_s)
                    )
                else:
                    results["llama-server"].ttft_idle_s = idle_ttft_s(
                        srv.base_url, args.prompt_tokens, 1
                    )
            finally:
                srv.stop()
    return results, metrics, over


def report(results: dict[str, StallResult], metrics: str, over: list[str]) -> None:
    print(
        "\n| server | longest decoder gap ms | p99 gap ms | median gap ms | decoder tokens "
        "during prefill | long TTFT s | idle TTFT s | TTFT / idle |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for who, r in results.items():
        print(
            f"| {who} | {r.max_gap_ms:.0f} | {r.p99_gap_ms:.0f} | {r.median_gap_ms:.0f} | "
            f"{r.decoder_tokens} | "
            f"{r.ttft_s:.2f} | {r.ttft_idle_s:.2f} | {r.ttft_s / r.ttft_idle_s:.2f} |"
        )
    if (ours := results.get("ours")) and (peer := results.get("llama-server")):
        print(
            f"\nours / llama-server: TTFT {ours.ttft_s / peer.ttft_s:.2f}, "
            f"longest gap {ours.max_gap_ms / peer.max_gap_ms:.2f}"
        )
    shown = ("onegpu_cost_model", "onegpu_side_prefill_tokens_total")
    cost = [ln for ln in metrics.splitlines() if ln.startswith(shown)]
    print("\nour cost model at the end:\n" + "\n".join(cost))
    # Server-side: steps that ran past the target. None while the client saw a longer gap
    # means the gap was made outside the step (HTTP, the client, the host).
    n_over = len(over) + sum(int(ln.rsplit("); ", 1)[-1].split()[0]) for ln in over)
    print(f"\nour steps over the target while others decoded: {n_over} (logged: {len(over)})")
    print("\n".join(over[:10]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--max-stall-ms", default="auto", help="ours: a target in ms, or auto (the "
                   "server's default: no flag given)")  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="both servers (default: all cores)")
    p.add_argument("--warmup-s", type=float, default=3.0,
                   help="seconds the decoders stream before the long prompt")  # fmt: skip
    p.add_argument("--runs", type=int, default=1, help="runs, each with both servers")
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--peer-bin", help="prebuilt llama-server folder (default: build it)")
    p.add_argument("--cache", default=".bench")
    p.add_argument("--no-peer", action="store_true", help="ours only")
    p.add_argument("--ours-args", default="", help="extra `one-gpu serve` options, quoted")
    p.add_argument("--peer-args", default="", help="extra llama-server options, quoted")
    p.add_argument("--cpu-moe", action="store_true", help="both servers: experts in host RAM")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    gpu = on_gpu(args.gpu)
    model = served_model(args.model)
    peer = None
    if not args.no_peer:
        bin_dir = Path(args.peer_bin) if args.peer_bin else None
        peer = (
            bin_dir / "llama-server"
            if bin_dir
            else ensure_peers(Path(args.cache).resolve(), cuda=gpu).server
        )
    print(
        f"model {model.name}, {args.decoders} decoders, {args.prompt_tokens}-token prompt, "
        f"gpu {gpu}, experts in host RAM {args.cpu_moe}, our --max-stall-ms {args.max_stall_ms}"
    )
    print("ours: one-gpu serve " + " ".join(ours_args(args, model, gpu)))
    if peer is not None:
        print("llama-server: " + " ".join(peer_cmd(args, peer, model, gpu, 0)[1:]))
    runs: list[dict[str, StallResult]] = []
    for i in range(args.runs):
        logdir = Path(tempfile.mkdtemp(prefix="onegpu-stall-"))
        results, metrics, over = run_once(args, model, gpu, peer, logdir)
        runs.append(results)
        print(f"\n## run {i + 1} of {args.runs}")
        report(results, metrics, over)
        print(f"\nserver logs: {logdir}")
    if len(runs) > 1 and peer is not None:
        ttft = [r["ours"].ttft_s / r["llama-server"].ttft_s for r in runs]
        gap = [r["ours"].max_gap_ms / r["llama-server"].max_gap_ms for r in runs]
        print(
            f"\nours / llama-server over {len(runs)} runs: TTFT median "
            f"{statistics.median(ttft):.2f}, worst {max(ttft):.2f}; longest gap median "
            f"{statistics.median(gap):.2f}, worst {max(gap):.2f}"
        )


if __name__ == "__main__":
    main()
