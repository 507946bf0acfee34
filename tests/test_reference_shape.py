"""The reference model's layer, narrow: `bench.synth_moe --arch deepseek2` writes what
llama.cpp loads and decodes (multi-head latent attention, a leading dense layer, a shared
expert, sigmoid-gated routed experts in Q2_K), the routed-expert cache serves it on the CPU
with the answers of a server without one, and `bench.skew_router` gives it skewed routing.

The GPU benchmarks write the same table at the reference width (7168 wide, 384 experts of
14 MB); here every width is small enough for a test, the types and tensor names are the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from openai import OpenAI

from bench import synth_moe
from bench.reference_model import deepseek_like
from bench.server_proc import Server
from bench.skew_router import PRESETS, set_routing, skew_router
from engine.gguf_meta import read_meta
from tests.test_expert_cache_e2e import cached_and_plain
from tests.test_kv_pressure_e2e import _metric

NARROW = ["--shape", "reference-narrow", "--seed", "3"]
N_LAYER, N_DENSE, N_EXPERT, N_USED = 3, 1, 16, 2  # as the shape says (checked below)
PROMPTS = [[300 + 7 * i + j for j in range(12)] for i in range(3)]  # words ▁w…


def _write(path: Path) -> Path:
    synth_moe.write(synth_moe.parse([str(path), *NARROW]))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("ref") / "deepseek2.gguf")


def test_the_reference_shape_is_the_planner_s_table() -> None:
    """At the reference width the writer's table is tests/test_plan.py's deepseek_like
    (tensor for tensor, names, shapes and types, for the layers written): what the GPU run
    measures is the model the planner plans."""
    a = synth_moe.parse(["x.gguf", "--shape", "reference", "--layers", "5"])
    table = {t.name: t for t in synth_moe.deepseek2_table(a)}
    planned = {t.name: t for t in deepseek_like().tensors if not t.name.startswith("blk.")
               or int(t.name.split(".")[1]) < 5}  # fmt: skip
    # the planner's table has the unsplit key/value up-projection (same bytes)
    kv_b = [n for n in planned if n.endswith("attn_kv_b.weight")]
    assert {n.replace("attn_kv_b", "attn_k_b") for n in kv_b} <= table.keys()
    extra = {n for n in table if n.endswith(("_a_norm.weight", "attn_v_b.weight",
                                              "attn_k_b.weight", "exp_probs_b.bias"))}  # fmt: skip
    assert table.keys() - extra == planned.keys() - set(kv_b)
    for name, t in planned.items():
        if name in table:
            assert (table[name].ne, table[name].ggml_type) == (t.shape, t.ggml_type), name
    expert = table["blk.4.ffn_gate_exps.weight"]
    assert expert.ne == (7168, 2048, 384)
    per_expert = 3 * 7168 * 2048 * 84 / 256  # gate, up and down, Q2_K
    assert 14e6 < per_expert < 14.6e6  # the issue's ~14 MB an expert


def test_written_blocks_are_valid_and_zero_mean(model: Path) -> None:
    """Q2_K and Q8_0 blocks dequantise to finite weights of mean ~0 and rms ~1/sqrt(fan-in)
    (random scale signs: no common direction for the residual stream to collapse onto)."""
    reader = GGUFReader(model)
    tensors = {t.name: t for t in reader.tensors}
    for name, kind in [("blk.1.ffn_down_exps.weight", GGMLQuantizationType.Q2_K),
                       ("blk.1.ffn_up_shexp.weight", GGMLQuantizationType.Q8_0),
                       ("blk.0.attn_output.weight", GGMLQuantizationType.Q8_0)]:  # fmt: skip
        t = tensors[name]
        assert t.tensor_type == kind, name
        w = dequantize(np.asarray(t.data), kind).astype(np.float64)
        fan_in = int(t.shape[0])
        assert np.isfinite(w).all(), name
        rms = float(np.sqrt(np.mean(w**2)))
        assert 0.7 < rms * math.sqrt(fan_in) < 1.4, (name, rms)
        assert abs(float(w.mean())) < 0.05 * rms, name
    meta = read_meta(str(model))
    assert (meta.arch, meta.n_layer, meta.n_expert, meta.n_expert_used) == (
        "deepseek2", N_LAYER, N_EXPERT, N_USED)  # fmt: skip


@pytest.fixture(scope="module")
def servers(model: Path) -> Iterator[tuple[Server, Server]]:
    yield from cached_and_plain(model, served="ref")


def _answers(server: Server) -> list[list[str]]:
    client = OpenAI(base_url=server.base_url, api_key="x", _strict_response_validation=True)
    out = []
    for p in PROMPTS:
        r = client.completions.create(model="ref", prompt=p, max_tokens=16, temperature=0,
                                      logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
        lp = r.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and len(lp.tokens) == 16
        out.append(lp.tokens)
    return out


def test_the_cache_serves_the_reference_layer_with_the_same_answers(
    servers: tuple[Server, Server],
) -> None:
    """Greedy answers through a 4-slot cache of the 16 experts equal the plain server's,
    and every routed pick of every MoE layer (not the dense one) went through the cache."""
    cached, plain = servers
    n_moe = N_LAYER - N_DENSE
    assert _metric(cached, "onegpu_expert_cache_layers") == n_moe
    got = _answers(cached)
    assert got == _answers(plain)
    assert len({tuple(a) for a in got}) == len(PROMPTS)  # the prompts decode differently
    hits = _metric(cached, "onegpu_expert_cache_picks_total", result="hit")
    misses = _metric(cached, "onegpu_expert_cache_picks_total", result="miss")
    assert hits > 0 and misses > 0
    assert hits + misses >= len(PROMPTS) * 15 * N_USED * n_moe


def test_skew_router_gives_the_reference_layer_traffic_s_skew(tmp_path: Path) -> None:
    """deepseek2's router rows take the Zipf weights, its Q8_0 attention output writes the
    context channels `boost` times louder and its latent query norm is flattened."""
    path = _write(tmp_path / "skewed.gguf")
    before = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
    assert skew_router(path, skew=1.0, locality=0.5, context=16, boost=8.0, seed=1) == 2
    after = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
    norms = np.linalg.norm(after["blk.1.ffn_gate_inp.weight"], axis=1)
    ratio = np.sort(norms)[::-1] / np.sort(norms)[::-1][-1]
    assert ratio[0] > 0.5 * N_EXPERT**1.0  # the top row ~ n_expert^skew times the last
    q_a = after["blk.2.attn_q_a_norm.weight"]
    assert np.allclose(q_a, 0.05 * before["blk.2.attn_q_a_norm.weight"])
    out_b = dequantize(before["blk.1.attn_output.weight"], GGMLQuantizationType.Q8_0)
    out_a = dequantize(after["blk.1.attn_output.weight"], GGMLQuantizationType.Q8_0)
    scaled = np.abs(out_a).sum(axis=1) / np.abs(out_b).sum(axis=1)
    assert (np.isclose(scaled, 8.0, rtol=0.01).sum(), np.isclose(scaled, 1.0).sum()) == (16, 240)
    assert np.array_equal(after["blk.0.attn_output.weight"], before["blk.0.attn_output.weight"])


def test_routings_switch_in_place_from_the_model_as_written(tmp_path: Path) -> None:
    """One copy of a model serves every routing (the reference-width slice fills most of
    a GPU host's disk): each preset starts from the tensors as written, so switching back
    to `uniform` gives the written bytes again, and a preset twice gives the same file."""
    path = _write(tmp_path / "m.gguf")
    written = path.read_bytes()
    originals = tmp_path / "originals.npz"
    assert set_routing(path, PRESETS["skewed"], originals) == N_LAYER - N_DENSE
    skewed = path.read_bytes()
    assert skewed != written and originals.exists()
    set_routing(path, PRESETS["measured"], originals)
    assert path.read_bytes() not in (written, skewed)
    set_routing(path, PRESETS["skewed"], originals)
    assert path.read_bytes() == skewed
    set_routing(path, PRESETS["uniform"], originals)
    assert path.read_bytes() == written
