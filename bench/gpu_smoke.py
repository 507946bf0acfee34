"""Load a model on the GPU through our engine and run a few steps (GPU host check)."""

import sys
import time

from engine.config import EngineConfig
from engine.model import Model
from engine.runner import Engine
from engine.step_types import SamplingParams, SeqChunk, SeqStart, StepBatch

t = time.perf_counter()
m = Model(EngineConfig(sys.argv[1], n_ctx=4096, n_seq_max=4, n_batch=512))
e = Engine(m)
print(f"loaded in {time.perf_counter() - t:.1f}s, n_vocab {m.n_vocab}")
ids = m.tokenize("hello world " * 20, add_special=True, parse_special=False)
starts = [SeqStart(s, SamplingParams(temperature=0.0 if s % 2 else 0.8, seed=s)) for s in range(4)]
r = e.step(StepBatch([SeqChunk(s, ids, 0, True) for s in range(4)], starts))
pos = len(ids)
for _ in range(20):
    r = e.step(StepBatch([SeqChunk(s, [r.sampled[s].token], pos, True) for s in range(4)]))
    pos += 1
print(f"decode step {1000 * r.decode_s:.2f} ms, sample {1000 * r.sample_s:.2f} ms, ok")
