"""Give a random-weight MoE GGUF routing that looks like traffic: skewed, drifting and
temporally local. Rewrites the file in place.

A random model routes uniformly — each token's picks independent of the last token's and
every expert as likely as any other — which hides both what a cache of hot experts gains
and what it costs. Real routing is neither: some experts take many more picks than others,
and consecutive tokens of one conversation pick overlapping sets. Two edits per MoE layer
produce both, without any training:

- Skew: the router's row of expert e is scaled by w_e, w ~ 1/rank^skew in a random order
  per layer. A larger row gives its expert a wider spread of logits, so it lands in the
  top-k more often: popularity without a fixed bias, varying with the input.
- Locality and drift: `context` channels of the residual stream are made to carry the
  attention's output (the rows of `attn_output` that write them are scaled up `boost`
  times), and `locality` of each router row's weight reads those channels. Random
  attention is close to a mean over the context's values, so those channels change slowly
  from token to token and differ between conversations: consecutive tokens route alike,
  and the hot set moves as a conversation grows.

`--skew 0 --locality 0` leaves the routing as uniform as the random weights made it (the
worst case for a cache). The hit-rate curve these settings give under the routed-expert
cache's LRU is measured by `bench.routing_curve` (docs/benchmarks.md, "Routing model").
Router tensors must be F32 or F16 (as tests.tiny_gguf and bench.synth_moe write them);
`attn_output` may be F32, F16 or Q4_0 (whose blocks' scales are scaled).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

log = logging.getLogger(__name__)
Q4_0_BLOCK = 18  # bytes: an f16 scale, 16 bytes of nibbles (32 weights)
FLAT = 0.05  # scale of the query norm's weights where there is one (qwen3moe)


def skew_router(
    path: Path, *, skew: float, locality: float, context: int, boost: float, seed: int = 0
) -> int:
    """Rewrite `path`'s routers (and attention outputs) in place; the MoE layers edited."""
    rng = np.random.default_rng(seed)
    reader = GGUFReader(path, "r+")
    tensors = {t.name: t for t in reader.tensors}
    layers = sorted(
        int(n.split(".")[1]) for n in tensors if n.endswith(".ffn_gate_inp.weight")
    )  # fmt: skip
    for n in layers:
        router = tensors[f"blk.{n}.ffn_gate_inp.weight"]
        if router.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            raise ValueError(f"blk.{n}.ffn_gate_inp.weight is {router.tensor_type.name}")
        w = router.data  # [n_expert, n_embd], a writable map of the file
        n_expert, n_embd = w.shape
        ctx = rng.choice(n_embd, size=min(context, n_embd), replace=False)
        rest = np.setdiff1d(np.arange(n_embd), ctx)
        if locality > 0:
            _scale_rows(tensors[f"blk.{n}.attn_output.weight"], ctx, boost)
            q_norm = tensors.get(f"blk.{n}.attn_q_norm.weight")
            if q_norm is not None:  # flat attention: a mean over the whole context
                q_norm.data[:] = q_norm.data * np.float32(FLAT)
            rows = np.array(w, dtype=np.float64)
            spread = np.linalg.norm(rows[:, rest], axis=1, keepdims=True) + 1e-12
            along = rng.standard_normal((n_expert, len(ctx)))
            along *= spread / np.linalg.norm(along, axis=1, keepdims=True)
            rows[:, rest] *= np.sqrt(1 - locality)
            rows[:, ctx] = along * np.sqrt(locality)
            w[:] = rows.astype(w.dtype)
        if skew > 0:
            weight = 1.0 / np.arange(1, n_expert + 1) ** skew
            factor = (rng.permutation(weight) / weight.mean())[:, None]
            w[:] = (w.astype(np.float64) * factor).astype(w.dtype)
    reader.data.flush()
    return len(layers)


def _scale_rows(t: object, rows: np.ndarray, factor: float) -> None:
    """Multiply output rows `rows` of a weight matrix by `factor`, in place."""
    kind = t.tensor_type  # type: ignore[attr-defined]
    data = t.data  # type: ignore[attr-defined]
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data[rows] = (data[rows].astype(np.float32) * factor).astype(data.dtype)
    elif kind == GGMLQuantizationType.Q4_0:
        blocks = data.reshape(data.shape[0], -1, Q4_0_BLOCK)
        scale = blocks[rows, :, :2].copy().view(np.float16)
        blocks[rows, :, :2] = (scale.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(f"attn_output of type {kind.name}: only F32, F16 and Q4_0 are scaled")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="a random-weight MoE GGUF, rewritten in place")
    p.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of router row norms")
    p.add_argument("--locality", type=float, default=0.5,
                   help="share of each router row reading the context channels (0-1)")  # fmt: skip
    p.add_argument("--context", type=int, default=64, help="residual channels that carry it")
    p.add_argument("--boost", type=float, default=8.0,
                   help="scale of the attention's writes to those channels")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    n = skew_router(a.model, skew=a.skew, locality=a.locality, context=a.context, boost=a.boost,
                    seed=a.seed)  # fmt: skip
    log.info("%s: routers of %d MoE layers rewritten", a.model, n)


if __name__ == "__main__":
    main()
