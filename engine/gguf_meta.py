"""What the planner needs from a GGUF file, read from its header alone.

`engine.gguf_header` memory-maps the file, so reading a 264 GB model's header touches a few
megabytes: the key/value metadata and the tensor directory (name, type, shape, byte size),
never the weights (nor, unlike `gguf.GGUFReader`, a Python object per vocabulary string).
Everything here is plain data so that `engine.plan` stays pure.

The KV cache per token is what llama.cpp allocates at the default f16 cache type:
`n_layer x n_head_kv x (key_length + value_length) x 2` bytes. A GGUF converted for
DeepSeek's compressed attention (MLA: it carries `attention.key_length_mla`) stores the
latent and the rope part as K only, `key_length` wide per KV head; an older DeepSeek GGUF
without that key gets the full per-head cache.

A model split over several files (`name-00001-of-00003.gguf`, llama.cpp's `gguf-split`)
is read from all of them. Multi-token-prediction blocks (`nextn_predict_layers`, the last
blocks) are left out: llama.cpp skips them unless asked to load them.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.gguf_header import read_header

F16_BYTES = 2
_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


class TensorInfo(msgspec.Struct, frozen=True):
    name: str
    ggml_type: str  # e.g. "Q4_0", "F32"
    nbytes: int
    shape: tuple[int, ...]  # ggml order: ne[0] first

    @property
    def n_params(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class ModelMeta(msgspec.Struct, frozen=True):
    arch: str
    name: str
    n_layer: int
    n_expert: int  # routed experts per MoE layer (0: dense model)
    n_expert_used: int
    n_embd: int
    n_vocab: int
    kv_bytes_per_token: int  # all layers, f16 cache
    tensors: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_params(self) -> int:
        return sum(t.n_params for t in self.tensors)


def kv_bytes_per_token(
    n_layer: int,
    n_head_kv: int | list[int],
    key_length: int,
    value_length: int,
    k_only: bool = False,
) -> int:
    """Bytes of f16 KV cache one token takes over all layers (see the module doc)."""
    heads = n_head_kv if isinstance(n_head_kv, list) else [n_head_kv] * n_layer
    width = key_length if k_only else key_length + value_length
    return sum(heads[:n_layer]) * width * F16_BYTES


def split_parts(path: Path) -> list[Path]:
    """Every file of a split GGUF given its first part (just `path` when not split)."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    prefix, count = m.group(1), int(m.group(3))
    return [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def read_meta(path: str | Path) -> ModelMeta:
    """The header of the GGUF at `path` (raises OSError/ValueError on a file that is not one)."""
    path = Path(path)
    headers = [read_header(p) for p in split_parts(path)]
    fields = headers[0].fields

    def get(key: str, default: object = None) -> object:
        v = fields.get(key, default)
        return default if v == [] else v

    arch = str(get("general.architecture", "unknown"))

    def num(key: str, default: int = 0) -> int:
        v = get(f"{arch}.{key}", default)
        return int(max(v)) if isinstance(v, list) else int(v)  # type: ignore[call-overload]

    n_layer = num("block_count")
    n_embd = num("embedding_length")
    n_head = num("attention.head_count", 1) or 1
    raw_kv = get(f"{arch}.attention.head_count_kv", n_head)
    head_kv: int | list[int] = raw_kv if isinstance(raw_kv, list) else int(str(raw_kv))
    key_length = num("attention.key_length", n_embd // n_head)
    value_length = num("attention.value_length", key_length)
    n_mtp = num("nextn_predict_layers")
    mtp = re.compile(rf"^blk\.({'|'.join(str(n_layer - 1 - i) for i in range(n_mtp))})\.")
    tensors = tuple(
        TensorInfo(
            name=t.name,
            ggml_type=GGMLQuantizationType(t.ggml_type).name,
            nbytes=_nbytes(t.ggml_type, t.shape),
            shape=t.shape,
        )
        for h in headers
        for t in h.tensors
        if not (n_mtp and mtp.match(t.name))
    )
    vocab = get("tokenizer.ggml.tokens")
    if not isinstance(vocab, int):
        embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
        vocab = embd.shape[-1] if embd else 0
    return ModelMeta(
        arch=arch,
        name=str(get("general.name", Path(path).stem)),
        n_layer=n_layer,
        n_expert=num("expert_count"),
        n_expert_used=num("expert_used_count"),
        n_embd=n_embd,
        n_vocab=vocab,
        kv_bytes_per_token=kv_bytes_per_token(
            n_layer - n_mtp,
            head_kv,
            key_length,
            value_length,
            k_only=f"{arch}.attention.key_length_mla" in fields,
        ),
        tensors=tensors,
    )
