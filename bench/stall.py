"""The long-prompt scenario: N users decode steadily; a long prompt arrives. How long do
the decoders wait for their next token while it is prefilled, and how long does the long
prompt wait for its first token — against the same prompt on an otherwise idle server?
Ours and `llama-server` (its default batch settings), same model, same run.

    python -m bench.stall --prompt-tokens 16384 --decoders 4          # CPU, embedded model
    python -m bench.stall --gpu --peer-bin DIR --model M --prompt-tokens 65000
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

log = logging.getLogger("bench.stall")
NAME = "bench-model"
DECODER_TOKENS = 4000  # each decoder's budget; the context holds 4,096 a decoder


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
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "stream": True,
            "temperature": 0, "cache_prompt": False}  # fmt: skip
    with httpx.Client(timeout=3600) as h:
        t0 = time.monotonic()
        with h.stream("POST", base_url + "/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return time.monotonic() - t0
    raise RuntimeError("no token")


async def scenario(base_url: str, n_decoders: int, prompt_tokens: int, seed: int) -> StallResult:
    rng = random.Random(seed)
    http = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_keepalive_connections=0))
    async with AsyncOpenAI(
        base_url=base_url, api_key="none", max_retries=0, timeout=3600, http_client=http
    ) as c:
        ttft_idle = await asyncio.to_thread(_first_token_s, base_url, prompt(rng, prompt_tokens))
        stamps: list[list[float]] = [[] for _ in range(n_decoders)]
        warm = asyncio.Event()
        done = asyncio.Event()

        async def decoder(i: int) -> None:
            stream = await c.completions.create(
                model=NAME,
                prompt=prompt(rng, 32),
                max_tokens=DECODER_TOKENS,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True, "cache_prompt": False},
            )
            async for ch in stream:
                if ch.choices and ch.choices[0].text:
                    stamps[i].append(time.monotonic())
                    if all(len(s) >= 5 for s in stamps):
                        warm.set()
                if done.is_set():
                    break
            await stream.close()

        tasks = [asyncio.create_task(decoder(i)) for i in range(n_decoders)]
        warmed = asyncio.create_task(warm.wait())
        await asyncio.wait({warmed, *tasks}, return_when=asyncio.FIRST_COMPLETED)
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
        ttft_idle_s=ttft_idle,
        decoder_tokens=n_tokens,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--max-stall-ms", default="250", help="ours: a target in ms, or auto (the "
                   "server's default: no flag given)")  # fmt: skip
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--peer-bin", help="prebuilt llama-server folder (default: build it)")
    p.add_argument("--cache", default=".bench")
    p.add_argument("--no-peer", action="store_true", help="ours only")
    p.add_argument("--ours-args", default="", help="extra `one-gpu serve` options, quoted")
    p.add_argument("--cpu-moe", action="store_true", help="both servers: experts in host RAM")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    gpu = on_gpu(args.gpu)
    model = served_model(args.model)
    n_ctx = args.prompt_tokens + args.decoders * (DECODER_TOKENS + 96) + 1024
    logdir = Path(tempfile.mkdtemp(prefix="onegpu-stall-"))
    ours_args = [
        "--model",
        str(model),
        "--served-model-name",
        NAME,
        "--n-ctx",
        str(n_ctx),
        "--n-seq-max",
        str(args.decoders + 1),
        *([] if args.max_stall_ms == "auto" else ["--max-stall-ms", args.max_stall_ms]),
        "--n-gpu-layers",
        "-1" if gpu else "0",
        "--log-level",
        "info",  # the server logs each step that runs past the target (scheduler.loop)
    ]
    if args.threads:
        ours_args += ["--threads", str(args.threads)]
    if args.cpu_moe:
        ours_args += ["--cpu-moe"]
    ours_args += args.ours_args.split()  # last: `--log-level debug` traces every planned step
    results: dict[str, StallResult] = {}
    srv: Server = start_server(ours_args, logdir / "ours.log")
    try:
        results["ours"] = asyncio.run(scenario(srv.base_url, args.decoders, args.prompt_tokens, 1))
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    over = [ln.split(": ", 1)[-1] for ln in srv.log().splitlines() if "over the stall target" in ln]
    if not args.no_peer:
        bin_dir = Path(args.peer_bin) if args.peer_bin else None
        exe = (
            bin_dir / "llama-server"
            if bin_dir
            else ensure_peers(Path(args.cache).resolve(), cuda=gpu).server
        )
        port = free_port()
        cmd = [
            str(exe),
            "-m",
            str(model),
            "-a",
            NAME,
            "-c",
            str(n_ctx),
            "-np",
            str(args.decoders + 1),
            "-kvu",
            "--cache-ram",
            "0",
            "-ngl",
            "99" if gpu else "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        if args.threads:
            cmd += ["-t", str(args.threads)]
        if args.cpu_moe:
            cmd += ["--cpu-moe"]
        srv = start_process(cmd, port, logdir / "llama-server.log")
        try:
            results["llama-server"] = asyncio.run(
                scenario(srv.base_url, args.decoders, args.prompt_tokens, 1)
            )
        finally:
            srv.stop()
    print(
        f"model {model.name}, {args.decoders} decoders, {args.prompt_tokens}-token prompt, "
        f"gpu {gpu}, experts in host RAM {args.cpu_moe}, our --max-stall-ms {args.max_stall_ms}"
    )
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
    cost = [ln for ln in metrics.splitlines() if ln.startswith("onegpu_cost_model")]
    print("\nour cost model at the end:\n" + "\n".join(cost))
    # Server-side: steps that ran past the target. None while the client saw a longer gap
    # means the gap was made outside the step (HTTP, the client, the host).
    n_over = len(over) + sum(int(ln.rsplit("); ", 1)[-1].split()[0]) for ln in over)
    print(f"\nour steps over the target while others decoded: {n_over} (logged: {len(over)})")
    print("\n".join(over[:10]))
    print(f"\nserver logs: {logdir}")


if __name__ == "__main__":
    main()
