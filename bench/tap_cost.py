"""What router telemetry costs, measured step by step instead of as a throughput difference.

At a 0.5% sample rate the cost is far below the run-to-run noise of a throughput figure on a
shared machine (±10% on the 2-core CPU box), so this benchmark runs the engine with the
tap sampling one step in five and times each step, classed as: a sampled step; the two
steps after one (on the GPU, ggml-cuda re-captures its CUDA graph after a sampled step's
cut-up graph); and the rest (base). Paired in one run, drift cancels. The cost at rate r is
then r x (extra time of a sampled step and of the steps after it) / base step time.

    python -m bench.tap_cost --model M.gguf --concurrency 1 8 32 --steps 400 --rate 0.005
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from bench.engine_step import prefill_all
from engine.config import EngineConfig
from engine.model import Model
from engine.runner import Engine
from engine.step_types import SamplingParams, SeqChunk, StepBatch

GREEDY = SamplingParams(temperature=0.0)


def classed_step_times(engine: Engine, n: int, isl: int, steps: int) -> dict[str, list[float]]:
    """Step times of n decoding sequences, by class (see the module doc)."""
    tap = engine.model.tap
    assert tap is not None
    last = prefill_all(engine, n, GREEDY, isl)
    pos = isl
    out: dict[str, list[float]] = {"sampled": [], "after": [], "base": []}
    since = 99  # steps since the last sampled one
    for _ in range(steps):
        before = tap.sampled_steps
        t0 = time.perf_counter()
        res = engine.step(StepBatch([SeqChunk(s, [last[s]], pos, True) for s in range(n)]))
        dt = time.perf_counter() - t0
        sampled = tap.sampled_steps > before
        out["sampled" if sampled else "after" if since < 2 else "base"].append(dt)
        since = 0 if sampled else since + 1
        last = {s: res.sampled[s].token for s in range(n)}
        pos += 1
    engine.step(StepBatch([], released=list(range(n))))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--n-ctx", type=int, default=24576)
    p.add_argument("--rate", type=float, default=0.005, help="the rate to cost (the default's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = EngineConfig(
        args.model, n_ctx=args.n_ctx, n_seq_max=max(args.concurrency), n_batch=2048,
        expert_sample_rate=0.2,  # 1 sampled, 2 after, 2 base in every 5 steps: interleaved
    )  # fmt: skip
    print(
        "| N | base step ms | sampled step ms | next 2 steps ms | "
        f"cost at rate {args.rate:g} |\n|---|---|---|---|---|"
    )
    with Model(cfg) as model:
        if model.tap is None:
            raise SystemExit("not an MoE model: no router to read")
        engine = Engine(model)
        classed_step_times(engine, 1, args.isl, 8)  # warm-up: graph allocation
        for n in args.concurrency:
            t = {k: statistics.median(v) for k, v in classed_step_times(
                engine, n, args.isl, args.steps).items() if v}  # fmt: skip
            base = t["base"]
            extra = (t["sampled"] - base) + 2 * (t.get("after", base) - base)
            print(
                f"| {n} | {1000 * base:.2f} | {1000 * t['sampled']:.2f} | "
                f"{1000 * t.get('after', base):.2f} | {100 * args.rate * extra / base:.2f}% |",
                flush=True,
            )
        engine.close()


if __name__ == "__main__":
    main()
