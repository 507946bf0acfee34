"""Patch 0002, the routed-expert cache (`engine.moe_cache`), on the library this checkout
runs. There is no GPU here: the cache's bank goes on the CPU device, which runs the same
graph a CUDA bank would (ids remapped to slots or per-position zero pads, -1 ids for the
host chain, the two chains added).

The model is a tiny random qwen3moe, 3 layers of 8 experts (3 used a token), with its expert
tensors in host RAM as `--cpu-moe` places them; f32, f16 and Q4_0 experts (the benchmarks'
type). The answers with the cache on must equal those with it off: each pick is computed by
exactly one chain (the other gives an exact zero row), a bank slot is a byte copy of the
host slice, and the CPU's dot products do not depend on which other rows share the matmul,
so the same float operations run in the same order — TOL only leaves room for kernels that
tile by row count.

On a GPU host `ONEGPU_CACHE_TEST_DEVICE=CUDA0` puts the bank on the GPU (the model's other
weights go there too, as llama.cpp places them by default): the cached picks then run
CUDA's kernels and the rest the CPU's, which round differently. The yardstick is llama.cpp's
own GPU computation of the same experts: the model loaded again with every expert on the
GPU answers the same prompts, and its distance from the experts-in-RAM answers (measured in
the same test, on the same token sequences: each computation is fed the reference's greedy
tokens) is what the cache may differ by, with the same greedy choice at every step that is
not a near tie of the reference.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine import moe_cache
from engine._capi import llama
from engine.placement import CPU_MOE, CpuOverrides
from tests.tiny_gguf import Shape, write_qwen3moe

SHAPE = Shape(n_layer=3, n_embd=64, n_expert=8, n_expert_used=3, n_ff_exp=32)
DEVICE = os.environ.get("ONEGPU_CACHE_TEST_DEVICE", "CPU")
TOL = 1e-4  # the CPU bank: the same operations in the same order
PROMPTS = [
    "the capital of france is paris and the",
    "hello world, how are you",
    "water is a very good thing to have in a house near the earth",
    "one two three",
]
TYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
         "q4_0": GGMLQuantizationType.Q4_0}  # fmt: skip


class Tiny:
    """The model and its raw llama.cpp handles (a context per test)."""

    def __init__(self, path: Path, wtype: str) -> None:
        block, size = GGML_QUANT_SIZES[TYPES[wtype]]
        per_matrix = SHAPE.n_embd * SHAPE.n_ff_exp // block * size
        self.expert_bytes = 3 * per_matrix  # gate, up, down
        self.path = path
        self.quantized = wtype == "q4_0"
        self.ll = ll = llama()
        self.model = self._load([CPU_MOE])
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self._gpu_distance: float | None = None

    def _load(self, patterns: list[str]) -> Any:
        overrides = CpuOverrides(self.ll, patterns)
        mp = self.ll.llama_model_default_params()
        mp.tensor_buft_overrides = overrides.pointer
        mp.use_extra_bufts = False  # as the server loads for the cache: no repacked Q4_0
        model = self.ll.llama_model_load_from_file(str(self.path).encode(), mp)
        assert model, "model load failed"
        return model

    def context(self, model: Any = None) -> Any:
        cp = self.ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 1024, 256, 256, 1
        cp.n_threads = cp.n_threads_batch = 2
        ctx = self.ll.llama_init_from_model(model or self.model, cp)
        assert ctx
        return ctx

    def tolerance(self, prompts: list[list[int]], without: list[tuple[list[int], Any]]) -> float:
        """How far the cache's answers may be from the experts-in-RAM ones: TOL on the CPU;
        on a GPU, how far llama.cpp's own GPU computation of every expert is (the model
        loaded again with no override) on the same token sequences."""
        if DEVICE == "CPU":
            return TOL
        if self._gpu_distance is None:
            model = self._load([])
            ctx = self.context(model)
            try:
                dist = 0.0
                for p, (toks0, rows0) in zip(prompts, without, strict=True):
                    _, rows = self.generate(ctx, p, len(toks0), 4, forced=toks0)
                    dist = max(dist, float(np.max(np.abs(rows - rows0))))
            finally:
                self.ll.llama_free(ctx)
                self.ll.llama_model_free(model)
            print(f"experts on the GPU vs in RAM: max |logit difference| {dist:.2e}")
            self._gpu_distance = dist
        return self._gpu_distance

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.ll.llama_token * 512)()
        n = self.ll.llama_tokenize(self.vocab, raw, len(raw), buf, 512, True, False)
        assert n > 0
        return list(buf[:n])

    def decode(self, ctx: Any, toks: list[int]) -> np.ndarray:
        """The last row's logits after `toks`."""
        arr = (self.ll.llama_token * len(toks))(*toks)
        assert self.ll.llama_decode(ctx, self.ll.llama_batch_get_one(arr, len(toks))) == 0
        row = self.ll.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy()

    def generate(
        self, ctx: Any, prompt: list[int], n: int, chunk: int, forced: list[int] | None = None
    ) -> tuple[list[int], np.ndarray]:
        """Greedy: the prompt in chunks of `chunk` tokens (small enough for the cache too),
        then n one-token steps; the tokens and every step's logits. With `forced`, those
        tokens are fed instead of the greedy ones (the returned tokens are still the greedy
        picks of each row): two computations are then compared on the same sequence, where
        one rounding-level flip of a near tie does not send the rest down another path."""
        self.ll.llama_memory_clear(self.ll.llama_get_memory(ctx), True)
        for i in range(0, len(prompt), chunk):
            logits = self.decode(ctx, prompt[i : i + chunk])
        out, rows = [], [logits]
        for i in range(n):
            out.append(int(np.argmax(logits)))
            logits = self.decode(ctx, [out[-1] if forced is None else forced[i]])
            rows.append(logits)
        return out, np.stack(rows)


def same_choices(toks: list[int], toks0: list[int], rows0: np.ndarray, tol: float) -> bool:
    """The greedy choices agree at every step where the reference's own choice is decided
    by more than twice the allowed difference (a near tie may flip under any rounding)."""
    for i, (a, b) in enumerate(zip(toks, toks0, strict=True)):
        top2 = np.sort(rows0[i])[-2:]
        if a != b and top2[1] - top2[0] > 2 * tol:
            return False
    return True


def picks(n_tokens: int) -> int:
    """Routed picks of a batch with one output row (the last layer computes only it)."""
    return ((SHAPE.n_layer - 1) * n_tokens + 1) * SHAPE.n_expert_used


@pytest.fixture(scope="module", params=list(TYPES))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tiny]:
    path = write_qwen3moe(
        tmp_path_factory.mktemp("moe") / f"moe-{request.param}.gguf",
        shape=SHAPE, wtype=request.param, seed=3,
    )  # fmt: skip
    m = Tiny(path, request.param)
    yield m
    m.ll.llama_model_free(m.model)


def test_the_cache_counts_every_small_batch_pick_and_uploads_what_missed(tiny: Tiny) -> None:
    ctx = tiny.context()
    try:
        with pytest.raises(moe_cache.ExpertCacheError):
            moe_cache.configure(ctx, 3, max_uploads=2, max_tokens=8, device="NOPE")
        assert moe_cache.configure(ctx, 3, max_uploads=2, max_tokens=8, device=DEVICE) == 3
        prompt = tiny.tokenize(PROMPTS[2])
        assert len(prompt) > 8
        logits = tiny.decode(ctx, prompt)  # over max_tokens: llama.cpp's usual path
        assert moe_cache.stats(ctx) == moe_cache.CacheStats(0, 0, 0, 0)
        for _ in range(40):
            logits = tiny.decode(ctx, [int(np.argmax(logits))])
        s = moe_cache.stats(ctx)
        assert s.hits + s.misses == 40 * SHAPE.n_layer * SHAPE.n_expert_used
        assert s.hits > 0 and s.uploads > 0
        assert s.upload_bytes == s.uploads * tiny.expert_bytes
        layers = [moe_cache.layer_stats(ctx, il) for il in range(SHAPE.n_layer)]
        assert all(st is not None and sum(st) == 40 * SHAPE.n_expert_used for st in layers)
        assert sum(st[0] for st in layers if st) == s.hits  # patch 0003: per-layer counters
        assert moe_cache.layer_stats(ctx, SHAPE.n_layer) is None  # no such layer
        # a decode graph with the cache on is still reused from step to step
        assert tiny.ll.llama_perf_context(ctx).n_reused >= 38
        moe_cache.reset_stats(ctx)
        assert moe_cache.stats(ctx).hits == 0 and moe_cache.layer_stats(ctx, 0) == (0, 0)
        # every expert of layer 0 pinned: uploaded at once
        assert moe_cache.configure(ctx, 8, max_uploads=2, max_tokens=8, device=DEVICE) == 3
        for e in range(SHAPE.n_expert):
            moe_cache.pin(ctx, 0, e)
        with pytest.raises(moe_cache.ExpertCacheError):
            moe_cache.pin(ctx, SHAPE.n_layer, 0)
        assert moe_cache.stats(ctx).uploads == SHAPE.n_expert
        assert moe_cache.configure(ctx, 0, max_uploads=0, max_tokens=0, device=DEVICE) == 0
        tiny.decode(ctx, [5])
        assert moe_cache.stats(ctx) == moe_cache.CacheStats(0, 0, 0, 0)
    finally:
        tiny.ll.llama_free(ctx)


def test_the_default_upload_cap_lets_one_step_bring_in_a_token_s_whole_pick(
    tiny: Tiny,
) -> None:
    """The server's default cap (`--expert-cache-uploads 0`) is the experts one token uses:
    after one step on an empty bank each layer holds every expert that step missed; a cap
    of 1 would take as many steps as a token has picks."""
    assert moe_cache.upload_cap(0, SHAPE.n_expert_used) == SHAPE.n_expert_used
    assert moe_cache.upload_cap(2, SHAPE.n_expert_used) == 2  # asked for: kept
    ctx = tiny.context()
    try:
        for requested, per_layer in ((0, SHAPE.n_expert_used), (1, 1)):
            cap = moe_cache.upload_cap(requested, SHAPE.n_expert_used)
            n = SHAPE.n_expert_used
            assert moe_cache.configure(ctx, n, max_uploads=cap, max_tokens=8, device=DEVICE) > 0
            tiny.ll.llama_memory_clear(tiny.ll.llama_get_memory(ctx), True)
            tiny.decode(ctx, tiny.tokenize(PROMPTS[2]))  # over max_tokens: not counted
            tiny.decode(ctx, [5])  # one token: every layer misses all of its picks
            s = moe_cache.stats(ctx)
            assert s.misses == SHAPE.n_layer * SHAPE.n_expert_used
            assert s.uploads == SHAPE.n_layer * per_layer
    finally:
        tiny.ll.llama_free(ctx)


def test_a_batch_over_max_tokens_takes_llama_cpp_s_usual_path(tiny: Tiny) -> None:
    ctx = tiny.context()
    try:
        assert moe_cache.configure(ctx, 2, max_uploads=2, max_tokens=4, device=DEVICE) == 3
        toks = tiny.tokenize(PROMPTS[2])
        tiny.decode(ctx, toks[:5])
        assert moe_cache.stats(ctx).hits + moe_cache.stats(ctx).misses == 0
        tiny.decode(ctx, toks[5:9])
        s = moe_cache.stats(ctx)
        assert s.hits + s.misses == picks(4)
        tiny.decode(ctx, toks[9:])
        assert moe_cache.stats(ctx) == s
    finally:
        tiny.ll.llama_free(ctx)


@pytest.mark.parametrize(
    ("slots", "uploads", "pin_all", "misses_on_device"),
    [(1, 1, False, False), (3, 2, False, False), (8, 2, False, False), (8, 0, True, False),
     (3, 2, False, True), (8, 0, True, True)],
)  # fmt: skip
def test_answers_with_the_cache_equal_answers_without_it(
    tiny: Tiny, slots: int, uploads: int, pin_all: bool, misses_on_device: bool
) -> None:
    """Greedy tokens and every step's logits, four prompts of 64 tokens, prompts fed in
    4-token chunks so that batches of several tokens (several pad slots a row) go through
    the cache too; one slot, a few, all learned by LRU, all pinned. With the misses asked
    of the device (patch 0006): on a GPU, quantized experts' misses read from host RAM by
    its kernels, which must skip the cached picks (-1 ids) exactly; on the CPU, and for
    unquantized experts, no layer qualifies and the answers stay the CPU's."""
    ctx = tiny.context()
    try:
        prompts = [tiny.tokenize(p) for p in PROMPTS]
        without = [tiny.generate(ctx, p, 64, 4) for p in prompts]
        tol = tiny.tolerance(prompts, without)
        assert (
            moe_cache.configure(ctx, slots, max_uploads=uploads, max_tokens=8, device=DEVICE) == 3
        )
        if misses_on_device:
            on_gpu = DEVICE != "CPU" and tiny.quantized
            assert moe_cache.set_misses(ctx, 8) == (3 if on_gpu else 0)
        if pin_all:
            for layer in range(SHAPE.n_layer):
                for e in range(SHAPE.n_expert):
                    moe_cache.pin(ctx, layer, e)
            moe_cache.reset_stats(ctx)
        for p, (toks0, rows0) in zip(prompts, without, strict=True):
            toks, rows = tiny.generate(ctx, p, 64, 4, forced=toks0)
            diff = float(np.max(np.abs(rows - rows0)))
            assert same_choices(toks, toks0, rows0, tol), f"max |logit difference| {diff:.2e}"
            assert diff <= tol, f"max |logit difference| {diff:.2e} (allowed {tol:.2e})"
        s = moe_cache.stats(ctx)
        assert s.hits + s.misses == sum(
            sum(picks(len(p[i : i + 4])) for i in range(0, len(p), 4)) + 64 * picks(1)
            for p in prompts
        )
        assert s.hits > 0
        if pin_all:
            assert s.misses == 0 and s.uploads == 0
    finally:
        tiny.ll.llama_free(ctx)


def test_an_admission_margin_stops_the_bank_turning_over(tiny: Tiny) -> None:
    """The same 40 decode steps under three admission rules: LRU (margin 0) uploads on
    most steps; a margin no expert can reach only fills the empty slots (then every later
    miss stays in RAM); a moderate one sits between. The answers do not change."""
    ctx = tiny.context()
    try:
        with pytest.raises(moe_cache.ExpertCacheError):
            moe_cache.set_admission(ctx, 1.0)  # no cache configured yet
        prompt = tiny.tokenize(PROMPTS[2])
        toks, rows0 = tiny.generate(ctx, prompt, 40, 4)
        tol = tiny.tolerance([prompt], [(toks, rows0)])
        uploads = {}
        for margin in (0.0, 2.0, 1e9):
            assert moe_cache.configure(ctx, 3, max_uploads=2, max_tokens=8, device=DEVICE) == 3
            moe_cache.set_admission(ctx, margin)
            out, rows = tiny.generate(ctx, prompt, 40, 4, forced=toks)
            assert same_choices(out, toks, rows0, tol)
            assert float(np.max(np.abs(rows - rows0))) <= tol
            uploads[margin] = moe_cache.stats(ctx).uploads
        assert uploads[1e9] == 3 * SHAPE.n_layer  # the three slots of each layer, filled once
        assert uploads[0.0] > uploads[2.0] > uploads[1e9]
    finally:
        tiny.ll.llama_free(ctx)
