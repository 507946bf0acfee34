"""Write a random-weight GGUF of a real model's shape for the GPU benchmarks: the compute
and memory traffic of a real model of that shape and those quantisation types, in about a
minute for 30B-A3B. Three architectures:

- `qwen3moe` (and `llama`, its dense twin): every matrix Q4_0, as the Qwen3-30B-A3B rows of
  docs/benchmarks.md were measured.
- `deepseek2`: the reference model's layer (`--shape reference`, the table of
  tests/test_plan.py's `deepseek_like`): multi-head latent attention (F16 projections, a
  Q8_0 output), leading dense layers and a shared expert in Q8_0, 384 routed experts of
  7168x2048 (6 used, sigmoid gating, normalised weights scaled 2.5) in Q2_K — 14 MB an
  expert. Any number of layers: a slice of the 61-layer model at its true width.

Tensors are generated and written one at a time (the largest routed-expert tensor of the
reference shape is 1.9 GB), whole blocks at once with numpy: tens of GB in minutes.

Every quantised block has a random scale sign. The sign matters: Q4_0 nibbles 0..15 stand
for -8..7, so blocks of one sign have a mean of -0.5 steps, every matrix then has a common
component along the all-ones direction, and layer after layer the residual stream collapses
onto it — every token routes to the same experts (a cache of any size hits ~100%) and
sampling repeats one token. With signs drawn per block the weights have mean zero and
routing depends on the token and its context, spread about uniformly over the experts
(`bench.skew_router` then gives it traffic's skew). Q8_0, Q2_K and F16 weights are scaled so
that a row's output has about unit variance (1/sqrt(fan-in)); Q4_0 keeps its fixed 0.02
scale, which the earlier Qwen-shape tables were measured with (the same seed writes the
same weights).

    python -m bench.synth_moe OUT.gguf --shape qwen3-30b-a3b --layers 48
    python -m bench.synth_moe OUT.gguf --shape reference --layers 7 --dense 1
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

log = logging.getLogger(__name__)

SCALE = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)  # little-endian f16: low, high
Kind = Literal["q4_0", "q8_0", "q2_k", "f16", "router", "ones", "zeros"]
QUANT = {"q4_0": Q.Q4_0, "q8_0": Q.Q8_0, "q2_k": Q.Q2_K}

# Named shapes (argparse defaults; any flag given still wins).
SHAPES: dict[str, dict[str, object]] = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", layers=48, embd=2048, heads=32, kv_heads=4,
                          head_dim=128, ff=6144, experts=128, used=8, ff_exp=768,
                          vocab=151936),
    # DeepSeek-V3-class, as tests/test_plan.py's deepseek_like: 128 heads of 128 (+64 rope)
    # from a 1536 query and a 512 key/value latent; dense FFN 18432; 384 experts of 2048
    "reference": dict(arch="deepseek2", layers=61, dense=3, embd=7168, heads=128,
                      head_dim=128, rope_dim=64, q_lora=1536, kv_lora=512, ff=18432,
                      experts=384, used=6, ff_exp=2048, shared=1, vocab=129280),
    # the same table, every width small: the test suite's and the GPU kit's check that
    # llama.cpp loads, decodes and caches the architecture
    "reference-narrow": dict(arch="deepseek2", layers=3, dense=1, embd=256, heads=4,
                             head_dim=32, rope_dim=16, q_lora=64, kv_lora=64, ff=512,
                             experts=16, used=2, ff_exp=256, shared=1, vocab=2048, ctx=4096),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of the table: its name, ggml shape (ne0 first) and how it is filled."""

    name: str
    ne: tuple[int, ...]
    kind: Kind

    @property
    def fan_in(self) -> int:
        return self.ne[0]

    @property
    def ggml_type(self) -> str:
        return "F32" if self.kind in ("router", "ones", "zeros") else self.kind.upper()


def q4_0_blocks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Q4_0 bytes for a tensor of numpy shape (..., ne0): random nibbles, +-0.02 scales."""
    *outer, ne0 = shape
    if ne0 % 32:
        raise ValueError(f"Q4_0 needs rows of a multiple of 32 values, not {ne0}")
    blocks = rng.integers(0, 256, size=(*outer, ne0 // 32, 18), dtype=np.uint8)
    blocks[..., 0] = SCALE[0]
    sign = rng.integers(0, 2, size=blocks.shape[:-1], dtype=np.uint8) << 7
    blocks[..., 1] = SCALE[1] | sign
    return blocks.reshape(*outer, ne0 // 32 * 18)


def _random_blocks(
    rng: np.random.Generator, shape: tuple[int, ...], per_block: int, size: int, d: float,
    at: int,
) -> np.ndarray:  # fmt: skip
    """Random bytes in blocks of `size` bytes (`per_block` weights), the f16 scale at byte
    `at` set to +-d with a random sign per block."""
    *outer, ne0 = shape
    if ne0 % per_block:
        raise ValueError(f"rows of {ne0} values: not whole blocks of {per_block}")
    n = math.prod(outer) * (ne0 // per_block)
    blocks = np.frombuffer(bytearray(rng.bytes(n * size)), np.uint8).reshape(n, size)
    sign = rng.integers(0, 2, size=n, dtype=np.uint16) << np.uint16(15)
    scale = np.float16(d).view(np.uint16) | sign
    blocks[:, at : at + 2] = scale.view(np.uint8).reshape(n, 2)
    return blocks.reshape(*outer, ne0 // per_block * size)


def q8_0_blocks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Q8_0 (a f16 scale, 32 int8): random int8 (rms ~74 steps), rows of unit output."""
    return _random_blocks(rng, shape, 32, 34, 1 / (74 * math.sqrt(shape[-1])), at=0)


def q2_k_blocks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Q2_K (16 bytes of 4-bit scales and mins, 64 bytes of 2-bit quants, f16 d and dmin):
    random scales and quants, dmin 0, d +-1/(16.5 sqrt(fan-in)) — a weight d*scale*q has an
    rms of ~16.5 d (scale 0..15, q 0..3), so a row's output has about unit variance."""
    blocks = _random_blocks(rng, shape, 256, 84, 1 / (16.5 * math.sqrt(shape[-1])), at=80)
    blocks.reshape(-1, 84)[:, 82:84] = 0  # dmin
    return blocks


def data(rng: np.random.Generator, t: Tensor) -> np.ndarray:
    """The bytes (or values) of `t`, numpy shape the reverse of ggml's."""
    shape = tuple(reversed(t.ne))
    if t.kind == "q4_0":
        return q4_0_blocks(rng, shape)
    if t.kind == "q8_0":
        return q8_0_blocks(rng, shape)
    if t.kind == "q2_k":
        return q2_k_blocks(rng, shape)
    if t.kind == "f16":
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(t.fan_in))
        return w.astype(np.float16)
    if t.kind == "router":  # F32, as bench.skew_router edits it
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return np.full(shape, 1.0 if t.kind == "ones" else 0.0, dtype=np.float32)


def _info(t: Tensor) -> tuple[tuple[int, ...], np.dtype, int, Q | None]:
    """What GGUFWriter.add_tensor_info takes: numpy (byte) shape, dtype, bytes, raw type."""
    shape = tuple(reversed(t.ne))
    if t.kind in QUANT:
        per_block, size = gguf.GGML_QUANT_SIZES[QUANT[t.kind]]
        shape = (*shape[:-1], shape[-1] // per_block * size)
        return shape, np.dtype(np.uint8), math.prod(shape), QUANT[t.kind]
    dtype = np.dtype(np.float16 if t.kind == "f16" else np.float32)
    return shape, dtype, math.prod(shape) * dtype.itemsize, None


def qwen_table(a: argparse.Namespace) -> Iterator[Tensor]:
    """qwen3moe (or llama): every matrix Q4_0, the router F32."""
    yield Tensor("token_embd.weight", (a.embd, a.vocab), "q4_0")
    yield Tensor("output_norm.weight", (a.embd,), "ones")
    yield Tensor("output.weight", (a.embd, a.vocab), "q4_0")
    hq, hkv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    for i in range(a.layers):
        b = f"blk.{i}."
        yield Tensor(b + "attn_norm.weight", (a.embd,), "ones")
        yield Tensor(b + "attn_q.weight", (a.embd, hq), "q4_0")
        yield Tensor(b + "attn_k.weight", (a.embd, hkv), "q4_0")
        yield Tensor(b + "attn_v.weight", (a.embd, hkv), "q4_0")
        yield Tensor(b + "attn_output.weight", (hq, a.embd), "q4_0")
        yield Tensor(b + "ffn_norm.weight", (a.embd,), "ones")
        if a.arch == "qwen3moe":
            yield Tensor(b + "attn_q_norm.weight", (a.head_dim,), "ones")
            yield Tensor(b + "attn_k_norm.weight", (a.head_dim,), "ones")
            yield Tensor(b + "ffn_gate_inp.weight", (a.embd, a.experts), "router")
            yield Tensor(b + "ffn_gate_exps.weight", (a.embd, a.ff_exp, a.experts), "q4_0")
            yield Tensor(b + "ffn_up_exps.weight", (a.embd, a.ff_exp, a.experts), "q4_0")
            yield Tensor(b + "ffn_down_exps.weight", (a.ff_exp, a.embd, a.experts), "q4_0")
        else:
            yield Tensor(b + "ffn_gate.weight", (a.embd, a.ff), "q4_0")
            yield Tensor(b + "ffn_up.weight", (a.embd, a.ff), "q4_0")
            yield Tensor(b + "ffn_down.weight", (a.ff, a.embd), "q4_0")


def deepseek2_table(a: argparse.Namespace) -> Iterator[Tensor]:
    """deepseek2 with MLA in llama.cpp's current form (the key/value up-projection split
    into attn_k_b and attn_v_b): the reference model's types."""
    E, H, X = a.embd, a.heads, a.experts
    yield Tensor("token_embd.weight", (E, a.vocab), "q8_0")
    yield Tensor("output_norm.weight", (E,), "ones")
    yield Tensor("output.weight", (E, a.vocab), "q8_0")
    for i in range(a.layers):
        b = f"blk.{i}."
        yield Tensor(b + "attn_norm.weight", (E,), "ones")
        yield Tensor(b + "attn_q_a_norm.weight", (a.q_lora,), "ones")
        yield Tensor(b + "attn_kv_a_norm.weight", (a.kv_lora,), "ones")
        yield Tensor(b + "attn_q_a.weight", (E, a.q_lora), "f16")
        yield Tensor(b + "attn_q_b.weight", (a.q_lora, H * (a.head_dim + a.rope_dim)), "f16")
        yield Tensor(b + "attn_kv_a_mqa.weight", (E, a.kv_lora + a.rope_dim), "f16")
        yield Tensor(b + "attn_k_b.weight", (a.head_dim, a.kv_lora, H), "f16")
        yield Tensor(b + "attn_v_b.weight", (a.kv_lora, a.head_dim, H), "f16")
        yield Tensor(b + "attn_output.weight", (H * a.head_dim, E), "q8_0")
        yield Tensor(b + "ffn_norm.weight", (E,), "ones")
        if i < a.dense:
            yield Tensor(b + "ffn_gate.weight", (E, a.ff), "q8_0")
            yield Tensor(b + "ffn_up.weight", (E, a.ff), "q8_0")
            yield Tensor(b + "ffn_down.weight", (a.ff, E), "q8_0")
            continue
        fs = a.ff_exp * a.shared
        yield Tensor(b + "ffn_gate_inp.weight", (E, X), "router")
        yield Tensor(b + "exp_probs_b.bias", (X,), "zeros")
        yield Tensor(b + "ffn_gate_shexp.weight", (E, fs), "q8_0")
        yield Tensor(b + "ffn_up_shexp.weight", (E, fs), "q8_0")
        yield Tensor(b + "ffn_down_shexp.weight", (fs, E), "q8_0")
        yield Tensor(b + "ffn_gate_exps.weight", (E, a.ff_exp, X), "q2_k")
        yield Tensor(b + "ffn_up_exps.weight", (E, a.ff_exp, X), "q2_k")
        yield Tensor(b + "ffn_down_exps.weight", (a.ff_exp, E, X), "q2_k")


def _header(w: gguf.GGUFWriter, a: argparse.Namespace) -> None:
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_head_count(a.heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_feed_forward_length(a.ff)
    if a.arch == "deepseek2":
        w.add_head_count_kv(1)  # MLA: one latent key/value head, K only in the cache
        w.add_key_length(a.kv_lora + a.rope_dim)
        w.add_value_length(a.kv_lora)
        w.add_key_length_mla(a.head_dim + a.rope_dim)
        w.add_value_length_mla(a.head_dim)
        w.add_rope_dimension_count(a.rope_dim)
        w.add_rope_freq_base(1e4)
        w.add_q_lora_rank(a.q_lora)
        w.add_kv_lora_rank(a.kv_lora)
        w.add_leading_dense_block_count(a.dense)
        w.add_expert_shared_count(a.shared)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q2_K)
    else:
        w.add_head_count_kv(a.kv_heads)
        w.add_key_length(a.head_dim)
        w.add_value_length(a.head_dim)
        w.add_rope_freq_base(1e6)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    if a.arch != "llama":
        w.add_expert_count(a.experts)
        w.add_expert_used_count(a.used)
        w.add_expert_feed_forward_length(a.ff_exp)
    # an SPM vocabulary with byte fallback: special, 256 bytes, then words
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = a.vocab - len(tokens)
    tokens += [f"\u2581w{i}".encode() for i in range(words)]
    types += [1] * words
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_vocab_size(a.vocab)


def write(a: argparse.Namespace) -> int:
    """Write the model; its bytes of tensor data."""
    rng = np.random.default_rng(a.seed)
    table = list(deepseek2_table(a) if a.arch == "deepseek2" else qwen_table(a))
    w = gguf.GGUFWriter(a.out, a.arch)
    _header(w, a)
    total = 0
    for t in table:
        shape, dtype, nbytes, raw = _info(t)
        w.add_tensor_info(t.name, shape, dtype, nbytes, raw_dtype=raw)
        total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in table:  # one tensor in memory at a time
        w.write_tensor_data(data(rng, t))
    w.close()
    return total


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a named shape (flags still win)")
    p.add_argument("--arch", choices=["qwen3moe", "llama", "deepseek2"], default="qwen3moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64,
                   help="a head's size (deepseek2: non-rotary query/key, value)")  # fmt: skip
    p.add_argument("--ff", type=int, default=512, help="dense FFN width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--used", type=int, default=2)
    p.add_argument("--ff-exp", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    ds = p.add_argument_group("deepseek2")
    ds.add_argument("--dense", type=int, default=1, help="leading dense layers")
    ds.add_argument("--rope-dim", type=int, default=32, help="rotary dims of a head")
    ds.add_argument("--q-lora", type=int, default=128, help="query latent rank")
    ds.add_argument("--kv-lora", type=int, default=64, help="key/value latent rank")
    ds.add_argument("--shared", type=int, default=1, help="shared experts")
    first, _ = p.parse_known_args(argv)
    if first.shape:
        p.set_defaults(**SHAPES[first.shape])
    return p.parse_args(argv)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse()
    n = write(a)
    log.info("wrote %s: %.2f GB of tensors", a.out, n / 1e9)


if __name__ == "__main__":
    main()
