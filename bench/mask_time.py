"""How long a grammar's token mask takes on the served model's vocabulary (llguidance).

For each schema: compile time, then a greedy walk through a valid answer — at every token
the matcher computes the mask of allowed next tokens (the work the engine does per
constrained sequence per step, on its mask thread while `llama_decode` runs) and takes the
next token of the answer. Reports the distribution of mask times (median, p99, max).

    python -m bench.mask_time                       # the embedded model
    python -m bench.mask_time --model M.gguf
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import numpy as np

from bench.server_proc import served_model
from engine.config import EngineConfig
from engine.grammar import mask_words
from engine.model import Model

log = logging.getLogger("bench.mask_time")

SCHEMAS: dict[str, tuple[dict[str, object], object]] = {
    "json_object": ({"type": "object"}, {"name": "Ada", "tags": ["a", "b"], "n": 3}),
    "flat": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "lamp": {"enum": ["red", "green", "blue"]},
            },
            "required": ["name", "age", "lamp"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "lamp": "green"},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "owner": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
                    "required": ["id", "admin"],
                    "additionalProperties": False,
                },
            },
            "required": ["title", "tags", "owner"],
            "additionalProperties": False,
        },
        {
            "title": "The lamp is out",
            "tags": ["urgent", "light"],
            "owner": {"id": 42, "admin": False},
        },
    ),
}


def measure(model: Model, schema: dict[str, object], answer: object) -> dict[str, float]:
    grammars = model.grammars
    t0 = time.perf_counter()
    grammar = grammars.json_schema(schema)
    c = grammars.constraint(grammar)
    compile_s = time.perf_counter() - t0
    text = json.dumps(answer, separators=(",", ":"))
    tokens = model.tokenize(text, add_special=False, parse_special=False)
    row = np.zeros(mask_words(model.n_vocab), dtype=np.uint32)
    times = []
    for tok in tokens:
        t = time.perf_counter()
        c.fill(row)
        times.append(time.perf_counter() - t)
        c.consume([tok])
    times.sort()
    return {
        "compile_ms": compile_s * 1e3,
        "tokens": float(len(tokens)),
        "mask_p50_us": statistics.median(times) * 1e6,
        "mask_p99_us": times[min(len(times) - 1, round(0.99 * (len(times) - 1)))] * 1e6,
        "mask_max_us": times[-1] * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF (default: the embedded model)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    path = served_model(args.model)
    model = Model(EngineConfig(str(path), n_ctx=256, n_seq_max=1, n_batch=64, n_threads=1))
    t0 = time.perf_counter()
    _ = model.grammars.tokenizer
    print(f"model {path.name}, vocabulary {model.n_vocab:,} tokens; "
          f"grammar tokenizer built in {time.perf_counter() - t0:.2f} s")  # fmt: skip
    print("\n| schema | compile ms | answer tokens | mask p50 us | mask p99 us | mask max us |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (schema, answer) in SCHEMAS.items():
        m = measure(model, schema, answer)
        print(f"| {name} | {m['compile_ms']:.1f} | {m['tokens']:.0f} | {m['mask_p50_us']:.0f} "
              f"| {m['mask_p99_us']:.0f} | {m['mask_max_us']:.0f} |")  # fmt: skip
    model.close()


if __name__ == "__main__":
    main()
