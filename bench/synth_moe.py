"""Write a random-weight Q4_0 GGUF of a real model's shape (qwen3moe or llama) for the
GPU benchmarks: the compute and memory traffic of a real Q4_0 model of that shape, in
about a minute for 30B-A3B.

Every Q4_0 block is random nibbles with a scale of +-0.02, the sign drawn per block. The
sign matters: nibbles 0..15 stand for -8..7, so blocks of one sign have a mean of -0.5
steps, every matrix then has a common component along the all-ones direction, and layer
after layer the residual stream collapses onto it — every token routes to the same experts
(a cache of any size hits ~100%) and sampling repeats one token. With signs drawn per block
the weights have mean zero and routing depends on the token and its context, spread about
uniformly over the experts (`bench.skew_router` then gives it traffic's skew).

    python -m bench.synth_moe OUT.gguf --arch qwen3moe --layers 48 --embd 2048 --heads 32 \\
        --kv-heads 4 --head-dim 128 --ff 6144 --experts 128 --used 8 --ff-exp 768 --vocab 151936
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf import GGMLQuantizationType

SCALE = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)  # little-endian f16: low, high


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


def write(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    w = gguf.GGUFWriter(args.out, args.arch)
    w.add_context_length(args.ctx)
    w.add_embedding_length(args.embd)
    w.add_block_count(args.layers)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_feed_forward_length(args.ff)
    moe = args.arch == "qwen3moe"
    if moe:
        w.add_expert_count(args.experts)
        w.add_expert_used_count(args.used)
        w.add_expert_feed_forward_length(args.ff_exp)
    # an SPM vocabulary with byte fallback: special, 256 bytes, then words
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = args.vocab - len(tokens)
    tokens += [f"\u2581w{i}".encode() for i in range(words)]
    types += [1] * words
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_vocab_size(args.vocab)

    def q4(name: str, *ne: int) -> None:  # ggml order (ne0, ne1, ...)
        w.add_tensor(name, q4_0_blocks(rng, tuple(reversed(ne))),
                     raw_dtype=GGMLQuantizationType.Q4_0)  # fmt: skip

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    q4("token_embd.weight", args.embd, args.vocab)
    ones("output_norm.weight", args.embd)
    q4("output.weight", args.embd, args.vocab)
    hq, hkv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    for i in range(args.layers):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", args.embd)
        q4(b + "attn_q.weight", args.embd, hq)
        q4(b + "attn_k.weight", args.embd, hkv)
        q4(b + "attn_v.weight", args.embd, hkv)
        q4(b + "attn_output.weight", hq, args.embd)
        ones(b + "ffn_norm.weight", args.embd)
        if moe:
            ones(b + "attn_q_norm.weight", args.head_dim)
            ones(b + "attn_k_norm.weight", args.head_dim)
            router = rng.standard_normal((args.experts, args.embd)) * 0.02
            w.add_tensor(b + "ffn_gate_inp.weight", router.astype(np.float32))
            q4(b + "ffn_gate_exps.weight", args.embd, args.ff_exp, args.experts)
            q4(b + "ffn_up_exps.weight", args.embd, args.ff_exp, args.experts)
            q4(b + "ffn_down_exps.weight", args.ff_exp, args.embd, args.experts)
        else:
            q4(b + "ffn_gate.weight", args.embd, args.ff)
            q4(b + "ffn_up.weight", args.embd, args.ff)
            q4(b + "ffn_down.weight", args.ff, args.embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out")
    p.add_argument("--arch", choices=["qwen3moe", "llama"], default="qwen3moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--used", type=int, default=2)
    p.add_argument("--ff-exp", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write(args)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
