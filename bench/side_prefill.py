"""Can a long prompt prefill beside the decoders instead of between their steps?

With the experts in host RAM, every physical batch of 32 or more prompt rows copies the
experts it uses to the GPU (on a model whose tokens use all of them, ~16 GB and ~1 s a
batch), so a step that carries prompt rows stalls the decoders for that long whatever the
chunk. The decoders' own steps compute their experts on the CPU and use little of the PCIe
link; the prompt's use the link and the GPU. This measures, engine alone, whether the two
overlap: a second context on the same weights prefills the prompt on a thread of its own
while the main context keeps decoding, then the prompt's KV moves over
(`llama_state_seq_get_data_ext` / `set_data_ext`, as preemption's swap does). Printed: the
decoders' step times alone, with the prompt's chunks in their steps (the server today),
and beside the second context; the move's cost; and whether the moved sequence samples
the token the in-place prefill does.

    python -m bench.side_prefill --model moe30.gguf --cpu-moe --prompt-tokens 16384
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time

from engine.config import EngineConfig
from engine.model import Model
from engine.placement import CPU_MOE
from engine.runner import Engine
from engine.step_types import SamplingParams, SeqChunk, SeqStart, StepBatch

GREEDY = SamplingParams(temperature=0.0)
DECODERS = [1, 2, 3, 4]
IN_PLACE, MOVED, SOLO = 5, 6, 7  # the prompt in the decoders' steps, moved, alone here


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"median {1000 * statistics.median(xs):.0f} ms, max {1000 * max(xs):.0f} ms, n {len(xs)}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--cpu-moe", action="store_true")
    p.add_argument("--side-threads", type=int, default=2, help="the second context's threads")
    p.add_argument("--ubatch", type=int, default=512, help="physical batch, both contexts")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    n = args.prompt_tokens
    cfg = EngineConfig(
        args.model, n_ctx=3 * n + 8192, n_seq_max=8, n_ubatch=args.ubatch, n_batch=args.chunk + 8,
        cpu_tensors=(CPU_MOE,) if args.cpu_moe else (),
    )  # fmt: skip
    with Model(cfg) as model:
        main_engine = Engine(model)
        side_ctx = model.open_context(
            n_ctx=n + 1024, n_seq_max=1, unified=True, device_greedy=False
        )
        ll = model.ll
        ll.llama_set_n_threads(side_ctx.ctx, args.side_threads, args.side_threads)
        side = Engine(model, side_ctx)
        vocab = model.n_vocab
        prompt = [(7 + 31 * i) % vocab for i in range(n)]
        nxt = (7 + 31 * n) % vocab
        starts = [SeqStart(s, GREEDY) for s in [*DECODERS, IN_PLACE, MOVED, SOLO]]
        res = main_engine.step(
            StepBatch([SeqChunk(s, [(100 + s) % vocab] * 16, 0, True) for s in DECODERS], starts)
        )
        last = {s: res.sampled[s].token for s in DECODERS}
        pos = dict.fromkeys(DECODERS, 16)

        def decode(extra: list[SeqChunk] | None = None) -> float:
            chunks = [SeqChunk(s, [last[s]], pos[s], True) for s in DECODERS] + (extra or [])
            t0 = time.perf_counter()
            r = main_engine.step(StepBatch(chunks))
            dt = time.perf_counter() - t0
            for s in DECODERS:
                last[s], pos[s] = r.sampled[s].token, pos[s] + 1
            return dt

        alone = [decode() for _ in range(20)]
        print(f"model {args.model}, cpu-moe {args.cpu_moe}, threads {cfg.threads()}, "
              f"side threads {args.side_threads}, prompt {n}, chunk {args.chunk}")  # fmt: skip
        print(f"decoders alone: {_ms(alone)}")

        in_place, t0 = [], time.perf_counter()
        for d in range(0, n, args.chunk):
            in_place.append(decode([SeqChunk(IN_PLACE, prompt[d : d + args.chunk], d, False)]))
        in_place_s = time.perf_counter() - t0
        print(f"prompt chunks in the decoders' steps: {_ms(in_place)}; prompt {in_place_s:.1f} s")

        done, side_steps = threading.Event(), []

        def prefill() -> None:
            for d in range(0, n, args.chunk):
                t = time.perf_counter()
                new = [SeqStart(0, GREEDY)] if d == 0 else []
                side.step(StepBatch([SeqChunk(0, prompt[d : d + args.chunk], d, False)], new))
                side_steps.append(time.perf_counter() - t)
            done.set()

        beside, t0 = [], time.perf_counter()
        worker = threading.Thread(target=prefill)
        worker.start()
        while not done.is_set():
            beside.append(decode())
        worker.join()
        side_s = time.perf_counter() - t0
        print(f"decoders beside the second context: {_ms(beside)}; "
              f"its steps {_ms(side_steps)}; prompt {side_s:.1f} s")  # fmt: skip

        own = side.step(StepBatch([SeqChunk(0, [nxt], n, True)])).sampled[0].token
        # the move as the server makes it: the side store saves, the main store restores
        t = time.perf_counter()
        size = side.swap.save(0, side.llama_seq(0))
        get_s = time.perf_counter() - t
        moved = side.swap.take(0)
        assert moved is not None
        main_engine.swap.put(0, moved)
        t = time.perf_counter()
        put = main_engine.swap.restore(0, main_engine.llama_seq(MOVED))
        put_s = time.perf_counter() - t
        print(f"move: {size / 2**20:.0f} MiB, read {1000 * get_s:.0f} ms ({size > 0}), "
              f"write {1000 * put_s:.0f} ms ({put == size})")  # fmt: skip

        for d in range(0, n, args.chunk):  # alone here, chunked as in the second context
            main_engine.step(StepBatch([SeqChunk(SOLO, prompt[d : d + args.chunk], d, False)]))
        solo = main_engine.step(StepBatch([SeqChunk(SOLO, [nxt], n, True)])).sampled[SOLO]
        a1 = main_engine.step(StepBatch([SeqChunk(IN_PLACE, [nxt], n, True)])).sampled[IN_PLACE]
        after = [SeqChunk(s, [solo.token], n + 1, True) for s in (IN_PLACE, MOVED, SOLO)]
        r = main_engine.step(StepBatch(after)).sampled
        a, b, c = (r[s].token for s in (IN_PLACE, MOVED, SOLO))
        print(f"next token: in the decoders' steps {a1.token}, in the second context {own}, "
              f"alone here {solo.token}; the one after: in the decoders' steps {a}, moved {b}, "
              f"alone here {c}: moved and alone {'same' if b == c else 'DIFFERENT'}")  # fmt: skip


if __name__ == "__main__":
    main()
