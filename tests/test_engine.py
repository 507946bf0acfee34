"""Engine tests on tiny generated GGUFs (dense llama, MoE qwen3moe) and the embedded model.

Every test drives the real `Engine.step` over llama.cpp. Numerics are compared only where they
are robust (FINDINGS, "Determinism"): the same schedule rerun is bit-identical; a different
batch shape or chunking is compared as distributions with a tolerance, never token by token.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import pytest

from engine.chat_template import ChatTemplate, builtin_template
from engine.config import EngineConfig
from engine.default_model import default_model_path
from engine.detok import IncrementalDetokenizer
from engine.errors import InvalidBatch, KVCacheFull
from engine.model import Model
from engine.placement import CPU_MOE
from engine.runner import Engine
from engine.step_types import (
    Release,
    Sampled,
    SamplingParams,
    SeqChunk,
    SeqStart,
    Share,
    StepBatch,
    Trim,
)
from tests.tiny_gguf import CHATML_TEMPLATE, EOS_ID, FIRST_BYTE_ID, N_BYTE_TOKENS, write_llama
from tests.tiny_gguf import write_qwen3moe as write_moe

GREEDY = SamplingParams(temperature=0.0)
PROMPT = "the capital of france is paris and the people there say hello to the world"


class OpenEngine(Protocol):
    def __call__(
        self,
        name: str = ...,
        *,
        n_ctx: int = ...,
        n_seq_max: int = ...,
        n_batch: int = ...,
        device_greedy: bool = ...,
    ) -> Engine: ...


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {
        "llama": write_llama(d / "llama.gguf", chat_template=CHATML_TEMPLATE, seed=1),
        "qwen3moe": write_moe(d / "qwen3moe.gguf", seed=2),
        "llama-f16": write_llama(d / "llama-f16.gguf", seed=3, wtype="f16"),
    }


@pytest.fixture
def open_engine(tiny_models: dict[str, Path]) -> Iterator[OpenEngine]:
    """Load a fresh model + engine per call (a tiny model loads in milliseconds)."""
    opened: list[Engine] = []

    def _open(
        name: str = "llama",
        *,
        n_ctx: int = 1024,
        n_seq_max: int = 8,
        n_batch: int = 256,
        device_greedy: bool = True,
    ) -> Engine:
        cfg = EngineConfig(
            str(tiny_models[name]),
            n_ctx=n_ctx,
            n_seq_max=n_seq_max,
            n_batch=n_batch,
            n_threads=2,
            device_greedy=device_greedy,
        )
        model = Model(cfg)
        eng = Engine(model)
        opened.append(eng)
        return eng

    yield _open
    for eng in opened:
        eng.close()
        eng.model.close()


@pytest.fixture(scope="module")
def gemma() -> Iterator[Engine]:
    model = Model(
        EngineConfig(default_model_path(), n_ctx=512, n_seq_max=2, n_batch=128, n_threads=2)
    )
    eng = Engine(model)
    yield eng
    eng.close()
    model.close()


# ---- helpers --------------------------------------------------------------------------------
def prompt_ids(eng: Engine, text: str = PROMPT) -> list[int]:
    return eng.model.tokenize(text, add_special=True, parse_special=False)


def prefill(
    eng: Engine,
    prompt: list[int],
    params: SamplingParams = GREEDY,
    *,
    seq_id: int = 0,
    chunk: int | None = None,
    history: list[int] | None = None,
) -> Sampled:
    """Start a sequence and feed `prompt` in chunks of `chunk` tokens, one step each."""
    chunk = chunk or len(prompt)
    starts = [SeqStart(seq_id, params, history or [])]
    for p0 in range(0, len(prompt), chunk):
        part = prompt[p0 : p0 + chunk]
        last = p0 + len(part) == len(prompt)
        res = eng.step(StepBatch([SeqChunk(seq_id, part, p0, last)], starts=starts))
        starts = []
        assert set(res.sampled) == ({seq_id} if last else set())
    assert eng.seq_pos_max(seq_id) == len(prompt) - 1
    return res.sampled[seq_id]


def generate(
    eng: Engine,
    prompt: list[int],
    n: int,
    params: SamplingParams = GREEDY,
    *,
    seq_id: int = 0,
    chunk: int | None = None,
    history: list[int] | None = None,
) -> list[int]:
    """Prefill `prompt`, then decode until `n` tokens are sampled."""
    out = [prefill(eng, prompt, params, seq_id=seq_id, chunk=chunk, history=history).token]
    pos = len(prompt)
    while len(out) < n:
        res = eng.step(StepBatch([SeqChunk(seq_id, [out[-1]], pos, True)]))
        out.append(res.sampled[seq_id].token)
        pos += 1
    assert eng.seq_pos_max(seq_id) == pos - 1
    return out


def distribution(eng: Engine, prompt: list[int], *, seq_id: int = 0, chunk: int) -> np.ndarray:
    """Log-probabilities of the whole vocabulary after prefilling `prompt` in `chunk`s."""
    n_vocab = eng.model.n_vocab
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=n_vocab)
    top = prefill(eng, prompt, params, seq_id=seq_id, chunk=chunk).top_logprobs
    assert top is not None and len(top) == n_vocab
    lp = np.empty(n_vocab)  # [V]
    for tok, v in top:
        lp[tok] = v
    return lp


# ---- stepping -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3moe", "llama-f16"])
def test_multi_sequence_prefill_then_decode(open_engine: OpenEngine, arch: str) -> None:
    eng = open_engine(arch)
    m = eng.model
    prompts = {
        0: prompt_ids(eng, "hello world"),
        1: prompt_ids(eng, "the people there"),
        2: prompt_ids(eng, "what is the capital of france"),
        3: prompt_ids(eng, "one two three four five six seven"),
    }
    # Step 1: three full prompts that sample, and the first half of seq 3's prompt that does not.
    half = len(prompts[3]) // 2
    chunks = [SeqChunk(s, prompts[s], 0, True) for s in (0, 1, 2)]
    chunks.append(SeqChunk(3, prompts[3][:half], 0, False))
    res = eng.step(StepBatch(chunks, starts=[SeqStart(s, GREEDY) for s in range(4)]))
    assert set(res.sampled) == {0, 1, 2}
    assert res.decode_s > 0
    assert eng.seq_pos_max(3) == half - 1
    last = {s: res.sampled[s].token for s in res.sampled}
    pos = {s: len(prompts[s]) for s in (0, 1, 2)}
    # Step 2: decode 0, 1, 2 and finish seq 3's prompt; step 3..: decode all four.
    rest = SeqChunk(3, prompts[3][half:], half, True)
    res = eng.step(StepBatch([SeqChunk(s, [last[s]], pos[s], True) for s in last] + [rest]))
    assert set(res.sampled) == {0, 1, 2, 3}
    pos = {s: p + 1 for s, p in pos.items()} | {3: len(prompts[3])}
    last = {s: res.sampled[s].token for s in res.sampled}
    for _ in range(4):
        # seq 1 is fed its token but asks for no sample: it keeps feeding the same one
        chunks = [SeqChunk(s, [last[s]], pos[s], s != 1) for s in sorted(last)]
        res = eng.step(StepBatch(chunks))
        assert set(res.sampled) == {0, 2, 3}
        last |= {s: res.sampled[s].token for s in res.sampled}
        pos = {s: p + 1 for s, p in pos.items()}
    for s, p in pos.items():
        assert eng.seq_pos_max(s) == p - 1
    for sampled in res.sampled.values():
        assert 0 <= sampled.token < m.n_vocab


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_chunked_prefill_is_reproducible_and_matches_unchunked(
    open_engine: OpenEngine, arch: str
) -> None:
    prompt = prompt_ids(open_engine(arch))
    assert len(prompt) > 12
    # The same schedule in a fresh context: bit-identical ids.
    runs = [generate(open_engine(arch), prompt, 12, chunk=5) for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(0 <= t < open_engine(arch).model.n_vocab for t in runs[0])
    # Other chunkings may differ in the last bits (FINDINGS), never in the distribution:
    # a chunk at the wrong position or a lost chunk would move it far more than this.
    whole = distribution(open_engine(arch), prompt, chunk=len(prompt))
    for chunk in (1, 4, 7):
        np.testing.assert_allclose(
            distribution(open_engine(arch), prompt, chunk=chunk), whole, atol=1e-3
        )
    # ...and the prompt matters: a truncated prompt gives a clearly different distribution.
    short = distribution(open_engine(arch), prompt[:-3], chunk=len(prompt))
    assert np.abs(short - whole).max() > 0.1


def test_released_sequence_frees_kv_and_restarts_at_zero(open_engine: OpenEngine) -> None:
    eng = open_engine()
    a, b = prompt_ids(eng), prompt_ids(eng, "hello world")
    generate(eng, a, 6, seq_id=0)
    generate(eng, b, 3, seq_id=1)
    assert eng.seq_pos_max(0) == len(a) + 4
    res = eng.step(StepBatch([], released=[0]))
    assert res.sampled == {}
    assert eng.seq_pos_max(0) == -1
    assert eng.seq_pos_max(1) == len(b) + 1  # a neighbour keeps its cells
    # The recycled id starts over at position 0 and sees none of the old request.
    recycled = distribution(eng, b, seq_id=0, chunk=len(b))
    assert eng.seq_pos_max(0) == len(b) - 1
    fresh = distribution(open_engine(), b, chunk=len(b))
    np.testing.assert_allclose(recycled, fresh, atol=1e-3)
    # Releasing and starting in the same step also works (seq ids are reused at once).
    res = eng.step(StepBatch([SeqChunk(1, a, 0, True)], starts=[SeqStart(1, GREEDY)], released=[0]))
    assert set(res.sampled) == {1}
    assert eng.seq_pos_max(0) == -1
    assert eng.seq_pos_max(1) == len(a) - 1


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_swapped_out_sequence_resumes_from_host_ram(open_engine: OpenEngine, arch: str) -> None:
    """Preemption that keeps the work: a sequence saved to host RAM, its cells released and
    taken by another sequence, restored under a new seq id into whatever cells are free,
    predicts its next token as if it had never left."""
    eng = open_engine(arch)
    n_vocab = eng.model.n_vocab
    lp = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=n_vocab)
    p = prompt_ids(eng)

    def next_distribution(res_sampled: dict[int, Sampled], seq_id: int) -> np.ndarray:
        top = res_sampled[seq_id].top_logprobs
        assert top is not None
        d = np.empty(n_vocab)
        for tok, v in top:
            d[tok] = v
        return d

    first = prefill(eng, p, lp, seq_id=0).token
    ref = eng.step(StepBatch([SeqChunk(0, [first], len(p), True)]))
    want = next_distribution(ref.sampled, 0)

    assert prefill(eng, p, lp, seq_id=1).token == first
    generate(eng, prompt_ids(eng, "hello world"), 2, seq_id=2)
    res = eng.step(StepBatch([], released=[1], swap_out=[(1, 7)]))
    assert res.swap_out_bytes > 0 and res.swap_out_failed == []
    assert eng.seq_pos_max(1) == -1 and eng.swap.nbytes == res.swap_out_bytes
    generate(eng, prompt_ids(eng, "the cells it freed go to someone else"), 2, seq_id=3)
    back = eng.step(
        StepBatch([SeqChunk(4, [first], len(p), True)], starts=[SeqStart(4, lp)],
                  swap_in=[(7, 4)])
    )  # fmt: skip
    assert back.swap_in_bytes == res.swap_out_bytes and back.swap_in_failed == []
    assert eng.seq_pos_max(4) == len(p) and len(eng.swap) == 0
    np.testing.assert_allclose(next_distribution(back.sampled, 4), want, atol=1e-3)

    # A key the store does not hold: the chunk is left out and named, nothing decoded.
    lost = eng.step(
        StepBatch([SeqChunk(5, [first], len(p), True)], starts=[SeqStart(5, lp)],
                  swap_in=[(99, 5)])
    )  # fmt: skip
    assert lost.swap_in_failed == [99] and lost.sampled == {}
    assert eng.seq_pos_max(5) == -1
    # A dropped key frees its bytes.
    eng.step(StepBatch([], swap_out=[(4, 8)]))
    assert len(eng.swap) == 1
    eng.step(StepBatch([], swap_drop=[8]))
    assert len(eng.swap) == 0 and eng.seq_pos_max(4) == len(p)


def test_a_shared_prefix_is_read_without_computing_it(open_engine: OpenEngine) -> None:
    """The prefix cache's ops on a dense model: a finished sequence kept (`retained`), its
    first cells lent to a new sequence (`Share` = seq_cp, no copy), which then predicts
    what it would after computing that prefix itself; `Trim` and `Release` untag only the
    holder. (Sliding-window models differ: see the prefix index.)"""
    eng = open_engine("llama-f16", n_ctx=2048)
    n_vocab = eng.model.n_vocab
    lp = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=n_vocab)
    p, a, b = prompt_ids(eng), prompt_ids(eng, "hello world"), prompt_ids(eng, "and more")
    b = b[1:]  # no second BOS

    def last_distribution(seq: int, tokens: list[int], p0: int, start: bool) -> np.ndarray:
        res = eng.step(
            StepBatch(
                [SeqChunk(seq, tokens, p0, True)], starts=[SeqStart(seq, lp)] if start else []
            )
        )
        top = res.sampled[seq].top_logprobs
        assert top is not None
        d = np.empty(n_vocab)
        for tok, v in top:
            d[tok] = v
        return d

    prefill(eng, p, lp, seq_id=2)
    want = last_distribution(2, b, len(p), start=False)  # p, then b
    prefill(eng, p + a, lp, seq_id=0)
    eng.step(StepBatch([], starts=[SeqStart(1, lp)], retained=[0], kv_ops=[Share(0, 1, 0, len(p))]))
    assert eng.seq_pos_max(1) == len(p) - 1
    got = last_distribution(1, b, len(p), start=False)
    np.testing.assert_allclose(got, want, atol=1e-3)
    eng.step(StepBatch([], kv_ops=[Trim(0, len(p), -1)]))
    assert eng.seq_pos_max(0) == len(p) - 1
    eng.step(StepBatch([], kv_ops=[Release(0)]))
    assert eng.seq_pos_max(0) == -1
    assert eng.seq_pos_max(1) == len(p) + len(b) - 1  # the reader keeps the shared cells


def test_oversized_or_invalid_batch_raises_instead_of_aborting(open_engine: OpenEngine) -> None:
    eng = open_engine(n_batch=32, n_seq_max=4)
    m = eng.model
    assert m.n_batch == 32
    too_long = [FIRST_BYTE_ID + ord("a")] * 33
    with pytest.raises(InvalidBatch):
        eng.step(StepBatch([SeqChunk(0, too_long, 0, True)], starts=[SeqStart(0, GREEDY)]))
    assert eng.seq_pos_max(0) == -1
    # Two sequences together over the limit are refused as well.
    with pytest.raises(InvalidBatch):
        eng.step(
            StepBatch([SeqChunk(0, too_long[:20], 0, True), SeqChunk(1, too_long[:13], 0, True)])
        )
    # More sampled chunks than the context has output rows (llama.cpp would abort the
    # process): refused before it sees them.
    with pytest.raises(InvalidBatch):
        eng.step(StepBatch([SeqChunk(0, [5], i, True) for i in range(9)]))
    assert eng.seq_pos_max(0) == -1
    # llama.cpp's own checks (return code -1): a seq id >= n_seq_max, a token outside the
    # vocabulary, positions that do not continue the sequence.
    with pytest.raises(InvalidBatch):
        eng.step(StepBatch([SeqChunk(m.n_seq_max, [5], 0, False)]))
    with pytest.raises(InvalidBatch):
        eng.step(StepBatch([SeqChunk(0, [m.n_vocab], 0, False)]))
    generate(eng, too_long[:8], 2, seq_id=2)
    with pytest.raises(InvalidBatch):
        eng.step(StepBatch([SeqChunk(2, [5], 20, False)]))
    # The process lives on and the context still works: exactly n_batch tokens are fine.
    res = eng.step(StepBatch([SeqChunk(0, too_long[:32], 0, True)], starts=[SeqStart(0, GREEDY)]))
    assert set(res.sampled) == {0}
    assert eng.seq_pos_max(0) == 31
    assert eng.seq_pos_max(2) == 8


def test_kv_pool_full_raises_and_keeps_the_cache(open_engine: OpenEngine) -> None:
    eng = open_engine(n_ctx=256, n_batch=256, n_seq_max=2)
    m = eng.model
    assert m.n_ctx == 256
    toks = [FIRST_BYTE_ID + ord("x")] * 200
    generate(eng, toks, 1, seq_id=0)
    with pytest.raises(KVCacheFull):
        eng.step(StepBatch([SeqChunk(1, toks[:100], 0, True)], starts=[SeqStart(1, GREEDY)]))
    assert eng.seq_pos_max(1) == -1
    assert eng.seq_pos_max(0) == 199
    # What fits still runs.
    generate(eng, toks[:50], 2, seq_id=1)


def test_a_model_read_into_memory_answers_as_the_mapped_one(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """`use_mmap=False` (serve --no-mmap) loads the file into memory — llama.cpp reports no
    mapped buffer — experts overridden to the CPU included, and computes the same tokens."""
    path = str(tiny_models["qwen3moe"])

    def load(mmap: bool) -> tuple[Model, bool]:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
            m = Model(EngineConfig(path, n_ctx=256, n_threads=2, cpu_tensors=(CPU_MOE,),
                                   use_mmap=mmap))  # fmt: skip
        return m, any("CPU_Mapped" in r.getMessage() for r in caplog.records)

    read, read_mapped = load(False)
    mapped, mapped_mapped = load(True)
    assert mapped_mapped and not read_mapped
    try:
        a, b = Engine(read), Engine(mapped)
        prompt = prompt_ids(a)
        assert generate(a, prompt, 8) == generate(b, prompt, 8)
    finally:
        for m in (read, mapped):
            m.close()


# ---- router telemetry -----------------------------------------------------------------------
def test_expert_tap_counts_exactly_the_sampled_steps(tiny_models: dict[str, Path]) -> None:
    """At a rate of 1/3, the first step and every third after it are read: each adds
    n_used picks per computed row to every layer; the steps between add nothing (the
    callback is off the scheduler, also when llama.cpp reuses the graph), and the tokens
    are those of a model without telemetry."""
    path = str(tiny_models["qwen3moe"])
    model = Model(EngineConfig(path, n_ctx=256, n_threads=2, expert_sample_rate=1 / 3))
    plain = Model(EngineConfig(path, n_ctx=256, n_threads=2))
    try:
        tap = model.tap
        assert tap is not None
        eng, ref = Engine(model), Engine(plain)
        prompt = prompt_ids(eng)
        used = model.n_expert_used
        out = [prefill(eng, prompt).token]
        first = tap.counts.sum(axis=1)
        # All prompt rows pass the first layer; the last computes only the output row.
        assert first[0] == used * len(prompt) and first[-1] == used
        seen, sampled, idle_calls = tap.counts.sum(), [True], []
        for i in range(1, 10):
            calls = tap.calls
            res = eng.step(StepBatch([SeqChunk(0, [out[-1]], len(prompt) + i - 1, True)]))
            out.append(res.sampled[0].token)
            now = tap.counts.sum()
            sampled.append(now > seen)
            assert now - seen in (0, used * model.n_layer)
            seen = now
            if i % 3 and i > 1:  # unarmed, on the graph llama.cpp reuses from the step before
                idle_calls.append(tap.calls - calls)
        assert idle_calls == [0] * 5  # the callback was off the scheduler
        assert sampled == [i % 3 == 0 for i in range(10)]
        assert tap.sampled_steps == 4
        assert out == generate(ref, prompt, 10)
    finally:
        for m in (model, plain):
            m.close()


# ---- placement ------------------------------------------------------------------------------
def test_expert_tensors_stay_in_host_ram_where_asked(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """`cpu_tensors` reaches llama.cpp's loader: its own report names every routed expert
    tensor (gate/up/down of each layer) as overridden to a host buffer, and nothing
    else — the CPU's, or where there is a GPU its page-locked one (CUDA_Host: llama.cpp
    picks it for overrides to the CPU, so a prompt batch copies the experts from pinned
    pages); the model still answers as without the override."""
    path = str(tiny_models["qwen3moe"])
    with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
        placed = Model(EngineConfig(path, n_ctx=256, n_threads=2, cpu_tensors=(CPU_MOE,)))
    overridden = [r.getMessage() for r in caplog.records if "overridden to" in r.getMessage()]
    names = sorted(m.split()[1] for m in overridden)
    n_layer = int(re.findall(r"blk\.(\d+)\.", " ".join(names))[-1]) + 1 if names else 0
    expected = sorted(f"blk.{i}.ffn_{w}_exps.weight" for i in range(n_layer)
                      for w in ("gate", "up", "down"))  # fmt: skip
    assert n_layer >= 1 and names == expected
    assert all(m.split()[-1] in ("CPU", "CUDA_Host") for m in overridden)
    plain = Model(EngineConfig(path, n_ctx=256, n_threads=2))
    try:
        a, b = Engine(placed), Engine(plain)
        prompt = prompt_ids(a)
        np.testing.assert_allclose(
            distribution(a, prompt, chunk=len(prompt)),
            distribution(b, prompt, chunk=len(prompt)),
            atol=1e-3,
        )
        a.close()
        b.close()
    finally:
        placed.close()
        plain.close()


# ---- sampling -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_device_greedy_matches_host_argmax_in_mixed_steps(
    open_engine: OpenEngine, arch: str
) -> None:
    """Plain greedy rows are sampled inside the graph; rows beside them that need their
    logits (greedy with logprobs, a sampler chain) still get them. Same schedule, so every
    row must get the same tokens and logprobs as with host argmax — also in steps where
    only device rows sample (no logits are copied then)."""
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.8, top_k=40, seed=3),
        GREEDY,
    ]

    def run(device: bool) -> list[list[Sampled]]:
        eng = open_engine(arch, device_greedy=device)
        assert eng.context.device_greedy is device
        texts = ["hello world", "the people there", "one two three", "paris and france"]
        prompts = [prompt_ids(eng, t) for t in texts]
        starts = [SeqStart(s, p) for s, p in enumerate(params)]
        res = eng.step(StepBatch([SeqChunk(s, p, 0, True) for s, p in enumerate(prompts)], starts))
        out = [[res.sampled[s]] for s in range(4)]
        pos = [len(p) for p in prompts]
        for step in range(12):
            live = range(4) if step < 6 else (0, 3)  # then device rows only
            res = eng.step(
                StepBatch(
                    [SeqChunk(s, [out[s][-1].token], pos[s], True) for s in live],
                    released=[1, 2] if step == 6 else [],
                )
            )
            for s in live:
                out[s].append(res.sampled[s])
                pos[s] += 1
        for s in (0, 3):
            assert eng.seq_pos_max(s) == pos[s] - 1
        assert eng.seq_pos_max(1) == -1
        return out

    host, device = run(False), run(True)
    assert device == host
    assert device[1][0].top_logprobs is not None  # the logprobs row was really read


def test_seeded_sampling_reproduces(open_engine: OpenEngine) -> None:
    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
        return generate(open_engine(), prompt_ids(open_engine()), 20, params)

    first = sample(123)
    assert sample(123) == first
    # The tiny model's logits are flat-ish (spread O(1) over 836 tokens): another seed or
    # greedy decoding cannot reproduce 20 sampled tokens.
    assert sample(124) != first
    assert generate(open_engine(), prompt_ids(open_engine()), 20) != first
    # The seed belongs to the sequence: a neighbour in the same steps does not consume it.
    eng = open_engine()
    prompt = prompt_ids(eng)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=123)
    other = SamplingParams(temperature=1.0, seed=7)
    res = eng.step(
        StepBatch(
            [SeqChunk(0, prompt, 0, True), SeqChunk(1, prompt, 0, True)],
            starts=[SeqStart(0, params), SeqStart(1, other)],
        )
    )
    assert res.sampled[0].token == first[0]


def test_every_seed_reproduces_with_penalties_too(open_engine: OpenEngine) -> None:
    """Penalties go through llama.cpp's chains, whose 0xFFFFFFFF means "pick a random
    seed": seed -1 (or 2**32 - 1) must not land there."""
    for seed in (-1, 2**32 - 1):
        params = SamplingParams(temperature=1.0, presence_penalty=0.5, seed=seed)
        runs = [generate(open_engine(), prompt_ids(open_engine()), 20, params) for _ in range(3)]
        assert runs[0] == runs[1] == runs[2], seed


def test_logprobs(open_engine: OpenEngine) -> None:
    eng = open_engine()
    prompt = prompt_ids(eng)
    cases = [  # numpy argmax path; llama.cpp chain path (the row is read after the chain)
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.8, seed=5, logprobs=True, top_logprobs=5),
    ]
    for seq_id, params in enumerate(cases):
        res = eng.step(
            StepBatch([SeqChunk(seq_id, prompt, 0, True)], starts=[SeqStart(seq_id, params)])
        )
        s = res.sampled[seq_id]
        assert s.logprob is not None and s.top_logprobs is not None
        values = [lp for _, lp in s.top_logprobs]
        assert len(values) == 5
        assert values == sorted(values, reverse=True)
        assert all(v < 0 for v in values)
        assert float(np.exp(values).sum()) <= 1.0
        assert s.logprob <= values[0]
        if params.is_greedy:
            assert s.top_logprobs[0] == (s.token, s.logprob)
    # Over the whole vocabulary the probabilities sum to one.
    full = distribution(eng, prompt, seq_id=3, chunk=len(prompt))
    assert np.exp(full).sum() == pytest.approx(1.0, abs=1e-6)
    # No logprobs asked: none computed.
    res = eng.step(StepBatch([SeqChunk(4, prompt, 0, True)], starts=[SeqStart(4, GREEDY)]))
    assert res.sampled[4].logprob is None and res.sampled[4].top_logprobs is None


def test_repetition_penalty_goes_through_llama_chain(open_engine: OpenEngine) -> None:
    prompt = prompt_ids(open_engine())
    plain = generate(open_engine(), prompt, 16)
    params = SamplingParams(0.0, repetition_penalty=1.5, logprobs=True, top_logprobs=3)
    first = prefill(open_engine(), prompt, params)
    assert first.token == plain[0]  # nothing generated yet, nothing to penalize
    assert first.top_logprobs is not None and first.top_logprobs[0] == (first.token, first.logprob)
    penalized = generate(open_engine(), prompt, 16, params)
    assert len(penalized) == 16 and all(0 <= t < open_engine().model.n_vocab for t in penalized)
    # SeqStart.history (a preempted request's output) feeds the penalty: with a strong
    # penalty, the token greedy picks first cannot be picked again.
    strong = SamplingParams(0.0, repetition_penalty=100.0)
    again = generate(open_engine(), prompt, 1, strong, history=[plain[0]])
    assert again[0] != plain[0]
    # The same strong penalty without history leaves the first pick alone.
    assert generate(open_engine(), prompt, 1, strong) == plain[:1]


# ---- tokenizer, detokenizer, chat template ------------------------------------------------
def test_detokenizer_round_trips_multibyte_text(open_engine: OpenEngine) -> None:
    m = open_engine().model
    text = "héllo 世界 🙂 the end"
    toks = m.tokenize(text, add_special=False, parse_special=False)
    pieces = [m.token_bytes(t) for t in toks]
    # SPM adds a leading space ("▁"): the first piece renders it.
    assert pieces[0].startswith(b" ")
    assert b"".join(pieces) == (" " + text).encode()
    # Byte fallback splits characters: 'é' is two tokens, '🙂' four.
    byte_toks = [t for t in toks if FIRST_BYTE_ID <= t < FIRST_BYTE_ID + N_BYTE_TOKENS]
    assert len(byte_toks) >= 2 + 6 + 4
    detok = IncrementalDetokenizer(m.token_bytes)
    deltas = [detok.add(t) for t in toks]
    assert "".join(deltas) + detok.flush() == " " + text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token completed no character
    assert " 世" not in deltas and "世" in deltas  # a CJK character arrives whole


def test_detokenizer_flushes_incomplete_tail(open_engine: OpenEngine) -> None:
    m = open_engine().model
    detok = IncrementalDetokenizer(m.token_bytes)
    assert detok.add(FIRST_BYTE_ID + 0xF0) == ""
    assert detok.add(FIRST_BYTE_ID + 0x9F) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_and_eog(open_engine: OpenEngine) -> None:
    m = open_engine().model
    assert m.add_bos
    assert m.tokenize("hello", add_special=True, parse_special=False)[0] == 1
    assert (m.bos_token, m.eos_token) == ("<s>", "</s>")
    assert m.token_bytes(1) == b"" and m.token_text(1) == b"<s>"
    assert m.is_eog(EOS_ID)
    im_end = m.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert len(im_end) == 1 and m.is_eog(im_end[0])  # llama.cpp treats <|im_end|> as EOG
    assert not any(m.is_eog(t) for t in m.tokenize(PROMPT, add_special=True, parse_special=False))


def test_chat_template_from_gguf(open_engine: OpenEngine) -> None:
    m = open_engine("llama").model
    assert m.chat_template() == CHATML_TEMPLATE
    tmpl = ChatTemplate.resolve(None, m.chat_template(), m.bos_token, m.eos_token)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    text = tmpl.render(messages)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    toks = m.tokenize(text, add_special=False, parse_special=True)
    im_start = m.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert toks.count(im_start[0]) == 3


def test_chat_template_falls_back_to_gemma(open_engine: OpenEngine, tmp_path: Path) -> None:
    m = open_engine("qwen3moe").model
    assert m.chat_template() is None
    tmpl = ChatTemplate.resolve(None, m.chat_template(), m.bos_token, m.eos_token)
    assert tmpl.source == builtin_template("gemma")
    text = tmpl.render([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
    assert text == "<s><start_of_turn>user\nsys\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    # An explicit file overrides the GGUF's own template.
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}!")
    override = ChatTemplate.resolve(f, CHATML_TEMPLATE, "", "")
    assert override.render([{"role": "user", "content": "x"}]) == "x!"


# ---- the embedded model ---------------------------------------------------------------------
def test_embedded_model_completes_and_knows_end_of_turn(gemma: Engine) -> None:
    m = gemma.model
    prompt = prompt_ids(gemma, "The capital of France is")
    toks = generate(gemma, prompt, 8)
    detok = IncrementalDetokenizer(m.token_bytes)
    text = "".join(detok.add(t) for t in toks) + detok.flush()
    assert text.strip()
    assert "\ufffd" not in text
    end_of_turn = m.tokenize("<end_of_turn>", add_special=False, parse_special=True)
    assert len(end_of_turn) == 1
    assert m.is_eog(end_of_turn[0])
    assert not m.is_eog(prompt[-1])
    # Gemma 3 270M carries no chat template: the shipped one applies and its tokens parse.
    assert m.chat_template() is None
    tmpl = ChatTemplate.resolve(None, m.chat_template(), m.bos_token, m.eos_token)
    chat = m.tokenize(
        tmpl.render([{"role": "user", "content": "hi"}]), add_special=False, parse_special=True
    )
    assert chat[0] == m.ll.llama_vocab_bos(m.vocab)
    assert end_of_turn[0] in chat


def test_vectorised_greedy_matches_each_row_and_mixes_with_chains(open_engine: OpenEngine) -> None:
    """Greedy rows are reduced together from `llama_get_logits`: each must be the argmax of
    its own sequence's row (`llama_get_logits_ith`), also when chain-sampled rows sit
    between them in the batch."""
    eng = open_engine("llama")
    m = eng.model
    texts = ["hello world", "the people there", "what is", "one two three", "five six"]
    prompts = [prompt_ids(eng, t) for t in texts]
    params = [GREEDY, SamplingParams(temperature=0.0, repetition_penalty=1.3), GREEDY,
              SamplingParams(temperature=0.7, seed=5), GREEDY]  # fmt: skip
    starts = [SeqStart(s, p) for s, p in enumerate(params)]
    res = eng.step(StepBatch([SeqChunk(s, p, 0, True) for s, p in enumerate(prompts)], starts))
    idx = 0
    for s, p in enumerate(prompts):
        idx += len(p)
        if params[s] is GREEDY:
            row = np.ctypeslib.as_array(
                m.ll.llama_get_logits_ith(m.main.ctx, idx - 1), (m.n_vocab,)
            )
            assert res.sampled[s].token == int(row.argmax())
    assert set(res.sampled) == set(range(5))


def test_a_warm_up_leaves_the_engine_as_it_found_it(gemma: Engine) -> None:
    """The GPU loader's warm-up (two sequences, a prompt and decode steps) drops all it made:
    no KV left under their ids, and a greedy generation after it is the one before it."""
    ids = prompt_ids(gemma)
    before = generate(gemma, ids, 6)
    gemma.step(StepBatch([], released=[0]))
    assert gemma.warm_up(prompt_tokens=32) > 0
    assert gemma.seq_pos_max(0) == -1 and gemma.seq_pos_max(1) == -1
    assert generate(gemma, ids, 6) == before
    gemma.step(StepBatch([], released=[0]))
