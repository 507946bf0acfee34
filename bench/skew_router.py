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
`attn_output` may be F32, F16, Q4_0 or Q8_0 (whose blocks' scales are scaled). Works on
qwen3moe and on deepseek2 (whose latent query norm, `attn_q_a_norm`, is the one flattened).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from engine.gguf_meta import read_meta

log = logging.getLogger(__name__)
# bytes a block of 32 weights, its f16 scale first: Q4_0 (16 bytes of nibbles), Q8_0 (int8)
BLOCK = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q8_0: 34}
FLAT = 0.05  # scale of the query norm's weights where there is one (qwen3moe, deepseek2)
Q_NORMS = ("attn_q_norm", "attn_q_a_norm")  # qwen3moe's per head, deepseek2's latent one


@dataclass(frozen=True, slots=True)
class Routing:
    """A setting of the rewrite (module doc); skew 0 and locality 0 leave the model as written."""

    skew: float
    locality: float
    context: float = 64  # channels, or below 1 a share of the width (skew_router)
    boost: float = 8.0


# `uniform`: as written, the worst case for a cache. `skewed`: the bound on the other side,
# hot experts and strong locality. `measured`: the LRU hit curve of a real model's traffic
# (a Qwen MoE of 512 experts, 10 used, in llama.cpp's expert-cache pull request #27861:
# no exploitable static skew; LRU of 12.5% of a layer's experts ~67% of picks, of 25% ~81%),
# matched by bench.routing_curve (docs/benchmarks.md, "Routing model").
PRESETS = {
    "uniform": Routing(0.0, 0.0),
    "skewed": Routing(1.0, 0.5),
    "measured": Routing(0.0, 0.5, context=0.25, boost=3.0),
}
# The same random weights route more locally in some architectures than in others (as
# written, a 384-expert deepseek2 keeps 37% of picks in an LRU of 12.5% of its experts, a
# 256-expert qwen3moe 17%), so `measured` is fitted per architecture. Its one lever is the
# boost (locality moves the curve by a few points, the boost by tens): the value whose LRU
# curve passes the real model's points on a narrow copy of the architecture's measured
# shape (routing_curve's generated qwen3moe, 256 experts of 4; synth_moe's
# reference-narrow with 7 layers of 384 experts, 6 used — width was shown not to move it).
MEASURED_BOOST = {"qwen3moe": 3.0, "deepseek2": 2.4}


def preset(name: str, model: Path) -> Routing:
    """The named routing for this model: `measured` with its architecture's fitted boost."""
    r = PRESETS[name]
    if name != "measured":
        return r
    arch = read_meta(str(model)).arch
    return replace(r, boost=MEASURED_BOOST.get(arch, r.boost))


def skew_router(
    path: Path, *, skew: float, locality: float, context: float, boost: float, seed: int = 0
) -> int:
    """Rewrite `path`'s routers (and attention outputs) in place; the MoE layers edited.
    `context`: the channels that carry the context, a count, or below 1 a share of the
    model's width (the same share gives models of any width alike locality)."""
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
        channels = round(context * n_embd) if context < 1 else int(context)
        ctx = rng.choice(n_embd, size=min(channels, n_embd), replace=False)
        rest = np.setdiff1d(np.arange(n_embd), ctx)
        if locality > 0:
            _scale_rows(tensors[f"blk.{n}.attn_output.weight"], ctx, boost)
            for name in Q_NORMS:  # flat attention: a mean over the whole context
                q_norm = tensors.get(f"blk.{n}.{name}.weight")
                if q_norm is not None:
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


def routing_tensors(path: Path) -> list[str]:
    """The tensors a rewrite may edit: each MoE layer's router, attention output and
    query norm."""
    names = {t.name for t in GGUFReader(path).tensors}
    layers = [n.split(".")[1] for n in names if n.endswith(".ffn_gate_inp.weight")]
    edited = ["ffn_gate_inp", "attn_output", *Q_NORMS]
    return sorted(f"blk.{i}.{e}.weight" for i in layers for e in edited
                  if f"blk.{i}.{e}.weight" in names)  # fmt: skip


def set_routing(path: Path, routing: Routing, originals: Path, seed: int = 0) -> int:
    """Give `path` this routing in place, starting from the model as written: its routing
    tensors are saved to `originals` (a .npy archive, ~1% of the model) the first time and
    restored from it every later time — one copy of a model on disk serves every routing.
    The MoE layers edited."""
    reader = GGUFReader(path, "r+")
    tensors = {t.name: t for t in reader.tensors}
    names = routing_tensors(path)
    if originals.exists():
        with np.load(originals) as saved:
            for n in names:
                tensors[n].data.reshape(-1).view(np.uint8)[:] = saved[n]
        reader.data.flush()
    else:
        tmp = originals.with_name(originals.name + ".tmp.npz")
        saved = {n: np.array(tensors[n].data).reshape(-1).view(np.uint8) for n in names}
        np.savez(tmp, **saved)
        tmp.rename(originals)
    del reader, tensors
    if routing.skew == 0 and routing.locality == 0:
        return len([n for n in names if n.endswith("ffn_gate_inp.weight")])
    return skew_router(path, skew=routing.skew, locality=routing.locality,
                       context=routing.context, boost=routing.boost, seed=seed)  # fmt: skip


def _scale_rows(t: object, rows: np.ndarray, factor: float) -> None:
    """Multiply output rows `rows` of a weight matrix by `factor`, in place."""
    kind = t.tensor_type  # type: ignore[attr-defined]
    data = t.data  # type: ignore[attr-defined]
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data[rows] = (data[rows].astype(np.float32) * factor).astype(data.dtype)
    elif kind in BLOCK:
        blocks = data.reshape(data.shape[0], -1, BLOCK[kind])
        scale = blocks[rows, :, :2].copy().view(np.float16)
        blocks[rows, :, :2] = (scale.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(f"attn_output of type {kind.name}: F32, F16, Q4_0 and Q8_0 are scaled")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="a random-weight MoE GGUF, rewritten in place")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a named setting (the flags below are then ignored)")  # fmt: skip
    p.add_argument("--originals", type=Path,
                   help="with --preset: start from the model as written, its routing tensors "
                        "saved here the first time (switch routings in place)")  # fmt: skip
    p.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of router row norms")
    p.add_argument("--locality", type=float, default=0.5,
                   help="share of each router row reading the context channels (0-1)")  # fmt: skip
    p.add_argument("--context", type=float, default=64,
                   help="residual channels that carry it (below 1: a share of all)")  # fmt: skip
    p.add_argument("--boost", type=float, default=8.0,
                   help="scale of the attention's writes to those channels")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    r = preset(a.preset, a.model) if a.preset else Routing(a.skew, a.locality, a.context, a.boost)
    if a.originals:
        n = set_routing(a.model, r, a.originals, seed=a.seed)
    else:
        n = skew_router(a.model, skew=r.skew, locality=r.locality, context=r.context,
                        boost=r.boost, seed=a.seed)  # fmt: skip
    log.info("%s: routers of %d MoE layers rewritten (%s)", a.model, n, r)


if __name__ == "__main__":
    main()
