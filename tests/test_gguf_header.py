"""The lean GGUF header reader against the gguf package's own reader, and what it costs."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import gguf
import numpy as np

from engine.default_model import default_model_path
from engine.gguf_header import MAX_ARRAY, read_header
from engine.gguf_meta import read_meta


def test_fields_and_tensors_match_the_gguf_package(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("general.name", "tiny ünïcode")
    w.add_bool("llama.flag", True)
    w.add_array("llama.attention.head_count_kv", [4, 2, 1])
    w.add_token_list([f"tok{i}" for i in range(1000)])
    w.add_array("tokenizer.ggml.scores", [0.5] * (MAX_ARRAY + 1))
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    h = read_header(path)
    ref = gguf.GGUFReader(str(path))
    assert h.fields["llama.block_count"] == 3
    assert h.fields["llama.rope.freq_base"] == 10000.0
    assert h.fields["general.name"] == "tiny ünïcode"
    assert h.fields["llama.flag"] is True
    assert h.fields["llama.attention.head_count_kv"] == [4, 2, 1]
    assert h.fields["tokenizer.ggml.tokens"] == 1000  # strings: their count
    assert h.fields["tokenizer.ggml.scores"] == MAX_ARRAY + 1  # long arrays: their length
    assert set(h.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}
    got = [(t.name, t.ggml_type, t.shape) for t in h.tensors]
    want = [(t.name, int(t.tensor_type), tuple(int(x) for x in t.shape)) for t in ref.tensors]
    assert got == want


def test_reading_the_embedded_models_header_stays_small() -> None:
    """Every server start reads the header (planning, gauges): for a 262K-token vocabulary
    `gguf.GGUFReader` allocated ~600 MB on the way, more than the model's own weights."""
    path = default_model_path()
    tracemalloc.start()
    try:
        meta = read_meta(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta.n_vocab == 262_144 and meta.n_layer == 18
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB"
