"""Does the serving path cost quality? Perplexity of one model over one text, computed
through our server (completions with echo + logprobs, the chunks sent concurrently so
they share steps) and by llama.cpp's `llama-perplexity`, the same way: the text's tokens
(with BOS) cut into windows of --ctx tokens, each window's first token replaced by BOS,
the second half of each window scored. The target: equal within 0.5%.

The default text is the documentation of Python's standard library modules (every host
that runs this has it); --text FILE scores another.

    python -m bench.perplexity                              # CPU, embedded model
    python -m bench.perplexity --gpu --model M.gguf --peer-bin DIR
    python -m bench.perplexity --gpu --model M.gguf --peer-bin DIR \\
        --ours-args="--cpu-moe" --peer-args="--cpu-moe"     # experts in host RAM
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import logging
import math
import re
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.peers import ensure_peers
from bench.server_proc import on_gpu, served_model, start_server

log = logging.getLogger("bench.perplexity")
NAME = "bench-model"
MODULES = (
    "argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal",
    "email", "fractions", "functools", "heapq", "http.client", "inspect", "itertools",
    "json", "logging", "pathlib", "pickle", "re", "shutil", "socket", "sqlite3",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing",
    "unittest", "urllib.parse", "zipfile",
)  # fmt: skip


def stdlib_text() -> str:
    """The docstrings of MODULES and of their public functions and classes."""
    parts: list[str] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def tokenize(model: Path, text: str) -> tuple[list[int], int]:
    """The text's tokens as llama-perplexity takes them (with BOS when the vocabulary adds
    one), and the BOS id: the model's vocabulary alone is loaded."""
    from engine._capi import llama

    ll = llama()
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    m = ll.llama_model_load_from_file(str(model).encode(), params)
    if not m:
        raise SystemExit(f"cannot load the vocabulary of {model}")
    try:
        vocab = ll.llama_model_get_vocab(m)
        data = text.encode()
        buf = (ll.llama_token * (len(data) + 16))()
        n = ll.llama_tokenize(vocab, data, len(data), buf, len(buf), True, False)
        if n < 0:  # more tokens than bytes (a byte-level vocabulary): -n is how many
            buf = (ll.llama_token * -n)()
            n = ll.llama_tokenize(vocab, data, len(data), buf, len(buf), True, False)
        if n < 0:
            raise SystemExit("tokenization failed")
        return list(buf[:n]), int(ll.llama_vocab_bos(vocab))
    finally:
        ll.llama_model_free(m)


async def ours(
    url: str, tokens: list[int], bos: int, ctx: int, chunks: int, concurrency: int
) -> tuple[float, float]:
    """(perplexity, seconds) through the server: each window one request, max_tokens 0."""
    first = ctx // 2
    gate = asyncio.Semaphore(concurrency)

    async def window(h: httpx.AsyncClient, i: int) -> list[float]:
        ids = [bos, *tokens[i * ctx + 1 : (i + 1) * ctx]]
        body = {"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                "temperature": 0}  # fmt: skip
        async with gate:
            r = await h.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert len(lps) == ctx, (len(lps), ctx)
        return [float(v) for v in lps[first + 1 :]]

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=3600) as h:
        scored = await asyncio.gather(*(window(h, i) for i in range(chunks)))
    seconds = time.perf_counter() - t0
    nll = -sum(sum(s) for s in scored)
    count = sum(len(s) for s in scored)
    return math.exp(nll / count), seconds


def peer(
    binary: Path, model: Path, text: Path, ctx: int, chunks: int, extra: list[str]
) -> tuple[float, float]:
    """(perplexity, seconds) from llama-perplexity's final estimate."""
    cmd = [str(binary), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
           "--chunks", str(chunks), *extra]  # fmt: skip
    log.info("$ %s", shlex.join(cmd))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - t0
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not m:
        raise SystemExit("llama-perplexity printed no final estimate:\n" + out.stderr[-2000:])
    return float(m.group(1)), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF (default: the embedded model)")
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--text", type=Path, help="text file (default: Python's stdlib docs)")
    p.add_argument("--ctx", type=int, default=512, help="window, as llama-perplexity's -c")
    p.add_argument("--chunks", type=int, default=16, help="windows scored")
    p.add_argument("--concurrency", type=int, default=4, help="windows in flight at once")
    p.add_argument("--peer-bin", help="folder with llama-perplexity (default: build it)")
    p.add_argument("--cache", default=".bench")
    p.add_argument("--ours-args", default="--repro-slots 0")
    p.add_argument("--peer-args", default="")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    gpu = on_gpu(args.gpu)
    model = served_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="onegpu-ppl-"))
    text_path = args.text or tmp / "stdlib.txt"
    if args.text is None:
        text_path.write_text(stdlib_text())
    tokens, bos = tokenize(model, text_path.read_text())
    chunks = min(args.chunks, len(tokens) // args.ctx)
    if chunks < 2:
        raise SystemExit(f"the text has {len(tokens)} tokens: need two windows of {args.ctx}")
    print(f"text: {len(tokens)} tokens; {chunks} windows of {args.ctx}, the second half of "
          f"each scored ({chunks * (args.ctx - args.ctx // 2 - 1)} tokens)")  # fmt: skip
    gpu_args = ["--n-gpu-layers", "999"] if gpu else ["--n-gpu-layers", "0"]
    srv = start_server(
        ["--model", str(model), "--served-model-name", NAME,
         "--n-ctx", str(args.ctx * args.concurrency + 64), *gpu_args,
         *shlex.split(args.ours_args)],
        tmp / "ours.log",
    )  # fmt: skip
    try:
        ppl_ours, s_ours = asyncio.run(
            ours(srv.url, tokens, bos, args.ctx, chunks, args.concurrency)
        )
    finally:
        srv.stop()
    if args.peer_bin:
        binary = Path(args.peer_bin) / "llama-perplexity"
    else:
        binary = ensure_peers(Path(args.cache), cuda=gpu).perplexity
    peer_args = ["-ngl", "999" if gpu else "0", *shlex.split(args.peer_args)]
    ppl_peer, s_peer = peer(binary, model, text_path, args.ctx, chunks, peer_args)
    diff = ppl_ours / ppl_peer - 1
    print(f"ours  (echo + logprobs, {args.concurrency} windows at once): PPL {ppl_ours:.4f} "
          f"({s_ours:.1f} s)")  # fmt: skip
    print(f"llama-perplexity: PPL {ppl_peer:.4f} ({s_peer:.1f} s)")
    print(f"ours / llama-perplexity - 1: {100 * diff:+.3f}% (target within 0.5%): "
          f"{'PASS' if abs(diff) <= 0.005 else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()
