"""Tiny random-weight GGUF models that llama.cpp loads, for engine tests.

Two architectures: a dense `llama` and an MoE `qwen3moe`, both a few hundred KB, written in
milliseconds. The tokenizer is a small SentencePiece ("llama") vocabulary: `<unk> <s> </s>`,
the 256 byte-fallback tokens `<0x00>`..`<0xFF>`, a few ChatML control tokens, then word pieces
(letters, `▁`+letter and every prefix of some common words, so that SPM's bigram merges can
reach whole words). Text outside the pieces falls back to bytes, which is what the
detokenizer tests need: a multi-byte character split over several tokens.

numpy shapes are the reverse of ggml's `ne` order: ggml `{n_embd, n_vocab}` is numpy
`(n_vocab, n_embd)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

WeightType = Literal["f32", "f16", "q4_0"]  # q4_0: the routed experts (the rest f32)

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
N_BYTE_TOKENS = 256
FIRST_BYTE_ID = 3
CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>")

_WORDS = (
    "the hello world capital france paris is of and to in that it was for on are with as his "
    "they be at one have this from or had by word but what some we can out other were all "
    "there when up use your how said an each she which do their time if will way about many "
    "then them write would like so these her long make thing see him two has look more day "
    "could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back "
    "little only round man year came show every good me give our under name very through just "
    "form sentence great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went "
    "light kind off need house picture try us again animal point mother near build self earth"
)

# A ChatML-style template: tests check it is read back from the GGUF and rendered.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Shape:
    """Hyperparameters of a tiny model (ggml names)."""

    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_ctx_train: int = 4096


def vocab(user_tokens: tuple[str, ...] = ()) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the tiny SPM vocabulary (ids are list indices);
    `user_tokens` are added last as USER_DEFINED (how converters store a model's added,
    non-special tokens, e.g. DeepSeek's tool-call markers)."""
    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(N_BYTE_TOKENS)]
    types += [T.BYTE] * N_BYTE_TOKENS
    tokens += list(CONTROL_TOKENS)
    types += [T.CONTROL] * len(CONTROL_TOKENS)
    pieces: list[str] = ["▁"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces += list(letters) + list(letters.upper()) + list("0123456789.,!?'-:;")
    pieces += ["▁" + c for c in letters + letters.upper()]
    for word in _WORDS.split():
        w = "▁" + word
        pieces += [w[:i] for i in range(3, len(w) + 1)]  # "▁he", "▁hel", ... "▁hello"
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(T.NORMAL)
    tokens += list(user_tokens)
    types += [T.USER_DEFINED] * len(user_tokens)
    # SPM merges the adjacent pair with the highest score first: prefer longer pieces.
    scores = [
        0.0 if t != T.NORMAL else float(len(tok)) for tok, t in zip(tokens, types, strict=True)
    ]
    return tokens, scores, [int(t) for t in types]


def write_llama(
    path: str | Path,
    *,
    chat_template: str | None = None,
    seed: int = 0,
    wtype: WeightType = "f32",
    shape: Shape | None = None,
    user_tokens: tuple[str, ...] = (),
    metadata: dict[str, int | float | str] | None = None,
) -> Path:
    """A dense `llama`-arch model; `chat_template` is stored as `tokenizer.chat_template`;
    `metadata`: more keys (an int as INT32, a float as FLOAT32, as llama.cpp's converters
    write `general.sampling.*`)."""
    return _write(
        "llama", Path(path), shape or Shape(), seed, wtype, chat_template,
        user_tokens=user_tokens, metadata=metadata,
    )  # fmt: skip


def write_hollow_llama(path: str | Path, shape: Shape) -> Path:
    """A dense `llama` model of any size written in milliseconds: its weights are a hole in
    a sparse file (all zeros), so it takes no disk, only the time and memory of a load —
    what tests of a long load need."""
    return _write("llama", Path(path), shape, 0, "f16", None, hollow=True)


def write_qwen3moe(
    path: str | Path,
    *,
    chat_template: str | None = None,
    seed: int = 0,
    wtype: WeightType = "f32",
    shape: Shape | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """An MoE `qwen3moe`-arch model (q/k norms, router, stacked expert tensors); with
    `split_max_tensors`, written as llama.cpp's split files `<stem>-0000i-of-0000n.gguf`."""
    return _write(
        "qwen3moe", Path(path), shape or Shape(), seed, wtype, chat_template, split_max_tensors
    )


def _write(
    arch: str,
    path: Path,
    s: Shape,
    seed: int,
    wtype: WeightType,
    chat_template: str | None,
    split_max_tensors: int = 0,
    user_tokens: tuple[str, ...] = (),
    hollow: bool = False,
    metadata: dict[str, int | float | str] | None = None,
) -> Path:
    tokens, scores, types = vocab(user_tokens)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)
    dt = np.float16 if wtype == "f16" else np.float32
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[wtype]

    def mat(*shape: int, std: float | None = None) -> np.ndarray:
        if hollow:  # a zero-stride view: never materialised, never written
            return np.broadcast_to(np.zeros((), dt), shape)
        # Default 1/sqrt(fan_in) (the last numpy axis): every layer moves the residual stream
        # as much as the embedding does, so outputs depend on context, and logits stay O(1).
        scale = shape[-1] ** -0.5 if std is None else std
        return (rng.standard_normal(shape) * scale).astype(dt)

    def experts(t: np.ndarray) -> np.ndarray:
        """An expert tensor in the file's type: Q4_0 blocks (the benchmarks' type) for q4_0;
        `add_tensor` takes the blocks' bytes, rows of bytes for shape."""
        if wtype != "q4_0" or hollow:
            return t
        return gguf.quants.quantize(t.astype(np.float32), gguf.GGMLQuantizationType.Q4_0)

    def put_experts(name: str, t: np.ndarray) -> None:
        q = experts(t)
        if q is t:
            put(name, t)
        else:
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    def norm(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)  # 1-D tensors stay f32, as converters write them

    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)

    def put(name: str, t: np.ndarray) -> None:
        if hollow:
            w.add_tensor_info(name, t.shape, t.dtype, t.nbytes)
        else:
            w.add_tensor(name, t)

    w.add_name(f"tiny-{arch}")
    w.add_file_type(file_type)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    if arch == "qwen3moe":
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_int32(key, value)
        else:
            w.add_float32(key, value)

    E, H, D = s.n_embd, s.n_head, s.head_dim
    kv = s.n_head_kv * D
    put("token_embd.weight", mat(n_vocab, E, std=1.0))  # ggml {E, V}
    put("output_norm.weight", norm(E))
    put("output.weight", mat(n_vocab, E))  # ggml {E, V}
    for i in range(s.n_layer):
        b = f"blk.{i}."
        put(b + "attn_norm.weight", norm(E))
        put(b + "attn_q.weight", mat(H * D, E))  # ggml {E, H*D}
        put(b + "attn_k.weight", mat(kv, E))
        put(b + "attn_v.weight", mat(kv, E))
        put(b + "attn_output.weight", mat(E, H * D))  # ggml {H*D, E}
        put(b + "ffn_norm.weight", norm(E))
        if arch == "qwen3moe":
            X, F = s.n_expert, s.n_ff_exp
            put(b + "attn_q_norm.weight", norm(D))
            put(b + "attn_k_norm.weight", norm(D))
            put(b + "ffn_gate_inp.weight", mat(X, E, std=1.0))  # ggml {E, X}
            put_experts(b + "ffn_gate_exps.weight", mat(X, F, E))  # ggml {E, F, X}
            put_experts(b + "ffn_up_exps.weight", mat(X, F, E))  # ggml {E, F, X}
            put_experts(b + "ffn_down_exps.weight", mat(X, E, F))  # ggml {F, E, X}
        else:
            put(b + "ffn_gate.weight", mat(s.n_ff, E))  # ggml {E, F}
            put(b + "ffn_up.weight", mat(s.n_ff, E))
            put(b + "ffn_down.weight", mat(E, s.n_ff))  # ggml {F, E}

    w.write_header_to_file()
    w.write_kv_data_to_file()
    if hollow:
        w.write_ti_data_to_file()
        out = w.fout[0] if w.fout else None
        assert out is not None
        w.write_padding(out, out.tell())
        size = sum(w.ggml_pad(ti.nbytes, w.data_alignment) for ti in w.tensors[0].values())
        out.truncate(out.tell() + size)
    else:
        w.write_tensors_to_file()
    w.close()
    return path
