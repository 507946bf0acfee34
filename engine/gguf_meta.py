"""What the planner needs from a GGUF file, read from its header alone.

`gguf.GGUFReader` memory-maps the file, so reading a 264 GB model's header touches a few
megabytes: the key/value metadata and the tensor directory (name, type, shape, byte size),
never the weights. Everything here is plain data so that `engine.plan` stays pure.

The KV cache per token is what llama.cpp allocates at the default f16 cache type:
`n_layer x n_head_kv x (key_length + value_length) x 2` bytes, or with DeepSeek's
multi-head latent attention (a `kv_lora_rank` in the header) the compressed latent plus
the rope part, `n_layer x (kv_lora_rank + rope_dim) x 2`.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
from gguf import GGUFReader, GGUFValueType

F16_BYTES = 2


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
    kv_lora_rank: int = 0,
    rope_dim: int = 0,
) -> int:
    """Bytes of f16 KV cache one token takes over all layers (see the module doc)."""
    if kv_lora_rank:
        return n_layer * (kv_lora_rank + rope_dim) * F16_BYTES
    heads = n_head_kv if isinstance(n_head_kv, list) else [n_head_kv] * n_layer
    return sum(heads[:n_layer]) * (key_length + value_length) * F16_BYTES


def read_meta(path: str | Path) -> ModelMeta:
    """The header of the GGUF at `path` (raises OSError/ValueError on a file that is not one)."""
    reader = GGUFReader(str(path), "r")
    fields = reader.fields

    def get(key: str, default: object = None) -> object:
        f = fields.get(key)
        if f is None or not f.types:
            return default
        if f.types[0] == GGUFValueType.ARRAY:
            if len(f.types) > 1 and f.types[-1] == GGUFValueType.STRING:
                return len(f.data)  # only string arrays' lengths are wanted (the vocabulary)
            return [int(f.parts[i][0]) for i in f.data]
        if f.types[0] == GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
        return f.parts[f.data[0]][0].item()

    arch = str(get("general.architecture", "unknown"))

    def num(key: str, default: int = 0) -> int:
        v = get(f"{arch}.{key}", default)
        return int(max(v)) if isinstance(v, list) else int(str(v))

    n_layer = num("block_count")
    n_embd = num("embedding_length")
    n_head = num("attention.head_count", 1) or 1
    raw_kv = get(f"{arch}.attention.head_count_kv", n_head)
    head_kv: int | list[int] = raw_kv if isinstance(raw_kv, list) else int(str(raw_kv))
    key_length = num("attention.key_length", n_embd // n_head)
    value_length = num("attention.value_length", key_length)
    tensors = tuple(
        TensorInfo(
            name=t.name,
            ggml_type=t.tensor_type.name,
            nbytes=int(t.n_bytes),
            shape=tuple(int(x) for x in t.shape),
        )
        for t in reader.tensors
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
            n_layer,
            head_kv,
            key_length,
            value_length,
            num("attention.kv_lora_rank"),
            num("rope.dimension_count") if num("attention.kv_lora_rank") else 0,
        ),
        tensors=tensors,
    )
