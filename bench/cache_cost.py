"""What cached KV costs requests that do not read it. llama.cpp attends, and builds its
mask, over every cell up to the highest one in use, so cells the prefix cache keeps widen
every step. Probe: the time to the first token of a fresh prompt (`cache_prompt: false`)
on an empty server, then beside `--conversations` cached ones of the same size; the same
with `--no-prefix-cache` (nothing stays) as the control.

    python -m bench.cache_cost                                  # CPU, embedded model
    python3 -m bench.cache_cost --gpu --model $MODEL --tokens 8192 --conversations 12
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from bench.server_proc import start_server


def probe(c: OpenAI, rng: random.Random, tokens: int, tries: int) -> float:
    times = []
    for _ in range(tries):
        ids = [rng.randrange(1000, 10000) for _ in range(tokens)]
        t0 = time.monotonic()
        c.completions.create(model="m", prompt=ids, max_tokens=1,
                             extra_body={"cache_prompt": False})  # fmt: skip
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace, extra: list[str]) -> tuple[float, float]:
    model = ["--model", args.model] if args.model else []
    log = Path(tempfile.mkdtemp(prefix="onegpu-cache-cost-")) / "server.log"
    srv = start_server(
        [*model, "--served-model-name", "m", "--n-ctx", str(args.n_ctx), "--n-seq-max", "8",
         "--repro-slots", "0", "--n-gpu-layers", "-1" if args.gpu else "0", *extra],
        log,
    )  # fmt: skip
    rng = random.Random(1)
    try:
        with OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=900) as c:
            empty = probe(c, rng, args.tokens, args.tries)
            for _ in range(args.conversations):
                ids = [rng.randrange(1000, 10000) for _ in range(args.tokens)]
                c.completions.create(model="m", prompt=ids, max_tokens=8)
            beside = probe(c, rng, args.tokens, args.tries)
    finally:
        srv.stop()
    return empty, beside


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF (default: the embedded model)")
    p.add_argument("--gpu", action="store_true", help="all layers on the GPU")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per prompt")
    p.add_argument("--conversations", type=int, default=8, help="cached before the 2nd probe")
    p.add_argument("--n-ctx", type=int, default=32768)
    p.add_argument("--tries", type=int, default=3)
    args = p.parse_args()
    print(f"| server | probe, empty server s | beside {args.conversations} cached "
          f"{args.tokens}-token conversations s | ratio |\n|---|---:|---:|---:|")  # fmt: skip
    for name, extra in (("prefix cache", []), ("--no-prefix-cache", ["--no-prefix-cache"])):
        empty, beside = run(args, extra)
        print(f"| {name} | {empty:.3f} | {beside:.3f} | {beside / empty:.2f} |")


if __name__ == "__main__":
    main()
