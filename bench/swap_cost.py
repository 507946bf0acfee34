"""Swap or recompute? What preempting and resuming a sequence costs each way, measured on
the engine itself (no server, no scheduler): a sequence of N tokens is prefilled, then

- swapped: its KV saved to host RAM and its cells released, then restored into a new
  sequence id (`engine.kv_swap`) — the time of the save plus the restore;
- recomputed: its prompt prefilled again from position 0 in full-batch chunks, as a
  resumed request runs alone at best.

Each is repeated and the median reported, with the copy rate the scheduler's prior
(`scheduler.kv.SwapCost`) should not overstate.

    python -m bench.swap_cost --tokens 4096 12288                     # CPU, embedded model
    python -m bench.swap_cost --model M.gguf --n-gpu-layers 99 --tokens 4096 12288
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass

from engine.config import EngineConfig
from engine.default_model import default_model_path
from engine.model import Model
from engine.runner import Engine
from engine.step_types import SamplingParams, SeqChunk, SeqStart, StepBatch

log = logging.getLogger("bench.swap_cost")
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Cost:
    tokens: int
    bytes: int
    save_s: float
    restore_s: float
    recompute_s: float

    @property
    def swap_s(self) -> float:
        return self.save_s + self.restore_s

    @property
    def copy_gb_s(self) -> float:
        return 2 * self.bytes / self.swap_s / 1e9


def prefill(eng: Engine, seq: int, tokens: list[int]) -> float:
    """Feed `tokens` to a new sequence in full-batch chunks; the seconds it took."""
    t0 = time.perf_counter()
    starts = [SeqStart(seq, GREEDY)]
    for p0 in range(0, len(tokens), eng.n_batch):
        part = tokens[p0 : p0 + eng.n_batch]
        eng.step(StepBatch([SeqChunk(seq, part, p0, p0 + len(part) == len(tokens))], starts))
        starts = []
    return time.perf_counter() - t0


def measure(eng: Engine, n: int, repeats: int, rng: random.Random) -> Cost:
    tokens = [rng.randrange(100, eng.model.n_vocab - 100) for _ in range(n)]
    prefill(eng, 0, tokens)  # warm
    eng.step(StepBatch([], released=[0]))
    saves, restores, redo, nbytes = [], [], [], 0
    for i in range(repeats):
        redo.append(prefill(eng, 0, tokens))
        res = eng.step(StepBatch([], released=[0], swap_out=[(0, i)]))
        if res.swap_out_failed:
            raise RuntimeError(f"saving {n} tokens failed")
        back = eng.step(StepBatch([], starts=[SeqStart(1, GREEDY)], swap_in=[(i, 1)]))
        if back.swap_in_failed or eng.seq_pos_max(1) != n - 1:
            raise RuntimeError(f"restoring {n} tokens failed")
        saves.append(res.swap_out_s)
        restores.append(back.swap_in_s)
        nbytes = res.swap_out_bytes
        eng.step(StepBatch([], released=[1]))
    med = statistics.median
    return Cost(n, nbytes, med(saves), med(restores), med(redo))


def report(costs: list[Cost], model: str) -> str:
    lines = [
        f"model: {model}",
        "| tokens | KV MB | save ms | restore ms | swap ms | recompute ms | recompute/swap | "
        "copy GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in costs:
        lines.append(
            f"| {c.tokens} | {c.bytes / 1e6:.0f} | {1e3 * c.save_s:.1f} | "
            f"{1e3 * c.restore_s:.1f} | {1e3 * c.swap_s:.1f} | {1e3 * c.recompute_s:.0f} | "
            f"{c.recompute_s / c.swap_s:.1f}x | {c.copy_gb_s:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 12288])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n-batch", type=int, default=2048)
    p.add_argument("--n-gpu-layers", type=int, default=-1, help="-1: all, on a GPU")
    p.add_argument("--threads", type=int, default=0, help="0: every core")
    p.add_argument("--json", help="write the measurements here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    path = args.model or default_model_path()
    n_ctx = -(-2 * max(args.tokens) // 256) * 256
    cfg = EngineConfig(
        str(path), n_ctx=n_ctx, n_seq_max=2, n_batch=args.n_batch,
        n_gpu_layers=args.n_gpu_layers, n_threads=args.threads,
    )  # fmt: skip
    model = Model(cfg)
    eng = Engine(model)
    rng = random.Random(0)
    try:
        costs = []
        for n in args.tokens:
            costs.append(measure(eng, n, args.repeats, rng))
            log.info("%d tokens: %s", n, costs[-1])
    finally:
        eng.close()
        model.close()
    print(report(costs, str(path)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(c) | {"swap_s": c.swap_s} for c in costs], f, indent=1)


if __name__ == "__main__":
    main()
