"""What a prompt chunk costs by its size and KV depth, next to D decoding sequences.

The stall bound (scheduler.budget) plans chunk sizes from a model of step time; this
measures the real shape on a machine, engine alone: a long prompt is prefilled to each
depth in full batches, then steps of D decode tokens plus a P-token chunk of that prompt
are timed for each P (interleaved, several rounds; the prompt advances by the chunks, so
the depth grows a little during a round). It prints ms per step and per prompt token.

    python -m bench.chunk_cost --depths 4096 8192 --chunks 16 32 56 64 96 128 192 256
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from engine.config import EngineConfig
from engine.model import Model
from engine.runner import Engine
from engine.step_types import SamplingParams, SeqChunk, SeqStart, StepBatch

GREEDY = SamplingParams(temperature=0.0)
LONG = 0  # the long prompt's sequence; decoders are 1..D


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--depths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 56, 64, 96, 128, 192, 256])
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--n-gpu-layers", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.model is None:
        from engine.default_model import default_model_path

        args.model = default_model_path()
    need = max(args.depths) + args.rounds * sum(args.chunks) + 64 * (args.decoders + 1) + 4096
    cfg = EngineConfig(
        args.model, n_ctx=need, n_seq_max=args.decoders + 1, n_batch=2048,
        n_threads=args.threads, n_gpu_layers=args.n_gpu_layers,
    )  # fmt: skip
    with Model(cfg) as model:
        engine = Engine(model)
        vocab = model.n_vocab
        dec = list(range(1, args.decoders + 1))
        starts = [SeqStart(s, GREEDY) for s in [LONG, *dec]]
        res = engine.step(
            StepBatch([SeqChunk(s, [(100 + s) % vocab] * 16, 0, True) for s in dec], starts)
        )
        last = {s: res.sampled[s].token for s in dec}
        pos = dict.fromkeys(dec, 16)
        depth = 0

        def step(chunk: int) -> float:
            """One step of every decoder plus `chunk` prompt tokens; its seconds."""
            nonlocal depth
            chunks = [SeqChunk(s, [last[s]], pos[s], True) for s in dec]
            if chunk:
                toks = [(7 + depth + i) % vocab for i in range(chunk)]
                chunks.append(SeqChunk(LONG, toks, depth, False))
            t0 = time.perf_counter()
            r = engine.step(StepBatch(chunks))
            dt = time.perf_counter() - t0
            for s in dec:
                last[s] = r.sampled[s].token
                pos[s] += 1
            depth += chunk
            return dt

        print(f"model {args.model}, {args.decoders} decoders, threads {cfg.threads()}")
        print("| depth | chunk | step ms | ms per prompt token (step - decode-only) |")
        print("|---|---|---|---|")
        for target in args.depths:
            while depth < target:  # full batches, no decoders: what an idle server does
                n = min(2048, target - depth)
                toks = [(7 + depth + i) % vocab for i in range(n)]
                engine.step(StepBatch([SeqChunk(LONG, toks, depth, False)]))
                depth += n
            at = depth
            times: dict[int, list[float]] = {c: [] for c in [0, *args.chunks]}
            for _ in range(args.rounds):
                for c in times:
                    times[c].append(step(c))
            base = statistics.median(times[0])
            for c, ts in times.items():
                med = statistics.median(ts)
                per = f"{1000 * (med - base) / c:.2f}" if c else "-"
                print(f"| {at} | {c} | {1000 * med:.1f} | {per} |", flush=True)


if __name__ == "__main__":
    main()
