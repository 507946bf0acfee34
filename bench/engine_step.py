"""Step time of our engine alone (no HTTP, no scheduler): where a decode step's time goes.

N sequences prefill a prompt together, then decode in lockstep; per step it reports the
median of the time in `llama_decode` (synchronised) and the time sampling, for greedy on
the host (the native step's argmax), device greedy and typical sampling (the native
step's top-k / top-p / temperature draw). This separates what the server adds from what
the engine's sampling path costs, on the same model and machine as `make bench`.

    python -m bench.engine_step --model M.gguf --concurrency 1 8 32
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

MODES = {
    "host-greedy": (False, SamplingParams(temperature=0.0)),
    "device-greedy": (True, SamplingParams(temperature=0.0)),
    "typical": (False, SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=1)),
}


def prefill_all(engine: Engine, n: int, params: SamplingParams, isl: int) -> dict[int, int]:
    """Start sequences 0..n-1 on an isl-token prompt; their first sampled tokens."""
    prompt = [(1000 + i) % engine.model.n_vocab for i in range(isl)]
    last: dict[int, int] = {}
    group = max(1, engine.n_batch // isl)  # prompts per prefill step, within n_batch
    for g in range(0, n, group):
        seqs = range(g, min(n, g + group))
        starts = [SeqStart(s, params) for s in seqs]
        res = engine.step(StepBatch([SeqChunk(s, prompt, 0, True) for s in seqs], starts))
        last |= {s: res.sampled[s].token for s in seqs}
    return last


def measure(
    engine: Engine, n: int, params: SamplingParams, isl: int, steps: int
) -> dict[str, float]:
    last = prefill_all(engine, n, params, isl)
    pos = isl
    wall, dec, smp = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        res = engine.step(StepBatch([SeqChunk(s, [last[s]], pos, True) for s in range(n)]))
        wall.append(time.perf_counter() - t0)
        dec.append(res.decode_s)
        smp.append(res.sample_s)
        last = {s: res.sampled[s].token for s in range(n)}
        pos += 1
    engine.step(StepBatch([], released=list(range(n))))
    step_ms = 1000 * statistics.median(wall)
    return {
        "step_ms": step_ms,
        # The mean counts the rare slow steps (sampled telemetry) that the median hides.
        "mean_ms": 1000 * statistics.fmean(wall),
        "mean_tok_s": n * len(wall) / sum(wall),
        "decode_ms": 1000 * statistics.median(dec),
        "sample_ms": 1000 * statistics.median(smp),
        "tok_s": n / (step_ms / 1000),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--n-ctx", type=int, default=16384)
    p.add_argument(
        "--expert-sample-rates", type=float, nargs="+", default=[0.0],
        help="router telemetry rates to compare (engine.expert_tap; 0 = off)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="alternate the rates this many times")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    n_max = max(args.concurrency)
    print(
        "| mode | expert sample rate | N | step ms | llama_decode ms | sample ms | tok/s "
        "| mean step ms | tok/s over all steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for _ in range(args.repeats):
        for mode in args.modes:
            for rate in args.expert_sample_rates:
                device, params = MODES[mode]
                cfg = EngineConfig(
                    args.model, n_ctx=args.n_ctx, n_seq_max=n_max, n_batch=2048,
                    device_greedy=device, expert_sample_rate=rate,
                )  # fmt: skip
                with Model(cfg) as model:
                    engine = Engine(model)
                    measure(engine, 1, params, args.isl, 4)  # warm-up: graph allocation
                    for n in args.concurrency:
                        r = measure(engine, n, params, args.isl, args.steps)
                        print(
                            f"| {mode} | {rate:g} | {n} | {r['step_ms']:.2f} | "
                            f"{r['decode_ms']:.2f} | {r['sample_ms']:.3f} | {r['tok_s']:.1f} | "
                            f"{r['mean_ms']:.2f} | {r['mean_tok_s']:.1f} |",
                            flush=True,
                        )
                    engine.close()


if __name__ == "__main__":
    main()
