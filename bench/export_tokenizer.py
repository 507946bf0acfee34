"""Write a Hugging Face tokenizer (tokenizer.json) for a GGUF's vocabulary.

Load generators such as aiperf count tokens with a Hugging Face tokenizer and cannot
download one on an offline host, so `make bench` builds it from the GGUF itself:
SentencePiece-style vocabularies (`tokenizer.ggml.model = llama`) become a BPE whose merges
rank each pair by the score of the piece it makes — what llama.cpp's SPM tokenizer does —
with byte fallback; GPT-2 style ones (`gpt2`) a byte-level BPE from the GGUF's merges.
Token counts then match llama.cpp's; the benchmark still takes generated-token counts from
the servers.

    python -m bench.export_tokenizer MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal piece into two pieces, best piece score first."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] != 1 or len(t) < 2:
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def export(model: Path, out: Path) -> Path:
    r = gguf.GGUFReader(model)
    kind = _field(r, "tokenizer.ggml.model")
    tokens = [str(t) for t in _field(r, "tokenizer.ggml.tokens")]
    types = _field(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
    bos = _field(r, "tokenizer.ggml.bos_token_id")
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    if kind == "llama":
        scores = _field(r, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        tok = Tokenizer(
            models.BPE(
                {t: i for i, t in enumerate(tokens)},
                _spm_merges(tokens, [float(s) for s in scores], types),
                byte_fallback=True,
            )
        )
        norm: list[normalizers.Normalizer] = [normalizers.Replace(" ", "▁")]
        if _field(r, "tokenizer.ggml.add_space_prefix"):
            norm.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(norm)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    elif kind == "gpt2":
        merges: list[tuple[str, str]] = []
        for m in _field(r, "tokenizer.ggml.merges"):
            left, right = str(m).split(" ", 1)
            merges.append((left, right))
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        raise SystemExit(f"unsupported tokenizer model {kind!r}")
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]
    tok.add_special_tokens(specials)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos] if isinstance(bos, int) else None,
        "eos_token": tokens[eos] if isinstance(eos, int) else None,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


if __name__ == "__main__":
    print(export(Path(sys.argv[1]), Path(sys.argv[2])))
