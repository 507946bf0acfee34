"""The native sampler (engine/native/decode_sample.c) against a numpy reference of
llama.cpp's chain top_k -> top_p -> min_p -> temperature -> dist.

Greedy must equal numpy's argmax exactly; a draw must come from exactly the tokens the
chain would keep, with their probabilities (checked on 40,000 draws); a seed must give the
same tokens again, and skipping draws must continue a sequence where it left off.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.native_step import ROW_GREEDY, ROW_PYTHON, ROW_SAMPLE, NativeStep, seed_state
from engine.step_types import SamplingParams

SLOTS = 64


def _native(n_vocab: int) -> NativeStep:
    return NativeStep(None, None, None, SLOTS, n_vocab, 1)


def reference(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The chain's distribution over the vocabulary, computed the slow, obvious way."""
    x = row.astype(np.float64)
    order = np.lexsort((np.arange(len(x)), -x))  # largest first, lower id among equals
    keep = order[: p.top_k] if 0 < p.top_k < len(x) else order
    if p.top_p < 1.0:
        w = np.exp(x[keep] - x[keep].max())
        cum = np.cumsum(w / w.sum())
        keep = keep[: int(np.searchsorted(cum, p.top_p)) + 1]
    if p.min_p > 0.0:
        keep = keep[x[keep] >= x[keep].max() + np.log(p.min_p)]
    probs = np.zeros(len(x))
    w = np.exp((x[keep] - x[keep].max()) / p.temperature)
    probs[keep] = w / w.sum()
    return probs


def draw_many(ns: NativeStep, row: np.ndarray, p: SamplingParams, n: int) -> np.ndarray:
    for s in range(SLOTS):
        ns.set_slot(s, SamplingParams(**{**_fields(p), "seed": 1000 + s}), ROW_SAMPLE)
    rows = np.repeat(row[None, :], SLOTS, axis=0)
    return np.concatenate([ns.sample(rows, list(range(SLOTS))) for _ in range(n // SLOTS)])


def _fields(p: SamplingParams) -> dict[str, object]:
    return {f: getattr(p, f) for f in SamplingParams.__dataclass_fields__}


@pytest.mark.parametrize("n_vocab", [1, 7, 128, 1000, 151_936])
def test_greedy_is_numpy_argmax_first_index(n_vocab: int) -> None:
    ns = _native(n_vocab)
    rng = np.random.default_rng(n_vocab)
    x = rng.standard_normal((SLOTS, n_vocab)).astype(np.float32)
    x[3, :] = 0.5  # all equal: the first index
    x[5, n_vocab // 2 :] = 9.0  # a tie at the top past a block boundary
    x[6, :] = -np.inf
    for s in range(SLOTS):
        ns.set_slot(s, SamplingParams(temperature=0.0), ROW_GREEDY)
    assert (ns.sample(x, list(range(SLOTS))) == x.argmax(axis=1)).all()


def test_rows_left_to_python_come_back_as_minus_one() -> None:
    ns = _native(100)
    ns.set_slot(0, SamplingParams(temperature=0.0), ROW_GREEDY)
    ns.set_slot(1, SamplingParams(temperature=0.0, repetition_penalty=1.1), ROW_PYTHON)
    x = np.random.default_rng(0).standard_normal((2, 100)).astype(np.float32)
    assert ns.sample(x, [0, 1]).tolist() == [int(x[0].argmax()), -1]


CASES = [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95),  # the benchmark's "typical"
    SamplingParams(temperature=0.7),  # OpenAI clients: temperature only
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=100),  # more than blocks: threshold from the row
    SamplingParams(temperature=1.0, top_k=699),  # nearly all: collected and sorted whole
]


@pytest.mark.parametrize(
    "p", CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
def test_draws_follow_the_chain_distribution(p: SamplingParams) -> None:
    n_vocab, n = 700, 40_000
    row = (np.random.default_rng(7).standard_normal(n_vocab) * 2.0).astype(np.float32)
    want = reference(row, p)
    got = np.bincount(draw_many(_native(n_vocab), row, p, n), minlength=n_vocab) / (
        n // SLOTS * SLOTS
    )
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want)), "drew a token the chain cuts"
    # Tokens likely enough to be counted well: within five standard errors each.
    common = want >= 0.005
    tol = 5 * np.sqrt(want * (1 - want) / n)
    assert (np.abs(got - want)[common] <= tol[common]).all(), np.abs(got - want).max()
    assert np.abs(got - want).sum() / 2 < 0.05  # total variation over all tokens


def test_top_p_on_a_large_flat_vocabulary_keeps_exactly_the_nucleus() -> None:
    """The histogram path (top_p without top_k) over a real vocabulary size."""
    n_vocab = 151_936
    row = (np.random.default_rng(3).standard_normal(n_vocab) * 3.0).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.5)
    allowed = set(np.flatnonzero(reference(row, p)))
    drawn = draw_many(_native(n_vocab), row, p, 2048)
    assert set(drawn.tolist()) <= allowed
    assert len(set(drawn.tolist())) > 100  # a draw, not a constant


def test_degenerate_settings_and_rows_give_a_real_token() -> None:
    """What an API client or a broken model can send must not crash the engine or yield
    an id outside the vocabulary: such rows fall back to numpy's argmax."""
    n_vocab = 1000
    ns = _native(n_vocab)
    row = np.zeros(n_vocab, dtype=np.float32)
    row[123] = 20.0

    def one(x: np.ndarray, p: SamplingParams) -> int:
        ns.set_slot(0, p, ROW_SAMPLE)
        return int(ns.sample(x[None, :], [0])[0])

    for t in (1e-39, 1e-46):  # 1/t overflows float32
        assert one(row, SamplingParams(temperature=t)) == 123
    for m in (2.0, float("nan")):  # nothing would survive min_p
        assert one(row, SamplingParams(temperature=1.0, min_p=m)) == 123
    assert one(row, SamplingParams(temperature=1.0, top_k=2**40)) in range(n_vocab)
    for bad in (np.nan, np.inf):
        x = np.random.default_rng(2).standard_normal(n_vocab).astype(np.float32)
        x[[200, 640]] = bad
        assert one(x, SamplingParams(temperature=0.8, top_k=40)) == int(x.argmax())
        ns.set_slot(0, SamplingParams(temperature=0.0), ROW_GREEDY)
        assert int(ns.sample(x[None, :], [0])[0]) == int(x.argmax())


def test_a_seed_repeats_and_skipping_continues_the_sequence() -> None:
    ns = _native(500)
    row = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=42)

    def tokens(skip: int, n: int) -> list[int]:
        ns.set_slot(0, p, ROW_SAMPLE, skip=skip)
        return [int(ns.sample(row[None, :], [0])[0]) for _ in range(n)]

    first = tokens(0, 30)
    assert tokens(0, 30) == first
    assert tokens(12, 18) == first[12:]
    other = SamplingParams(temperature=1.0, seed=43)
    ns.set_slot(0, other, ROW_SAMPLE)
    assert [int(ns.sample(row[None, :], [0])[0]) for _ in range(30)] != first
    assert seed_state(None) != seed_state(None)  # no seed: a random state each time


def test_threads_do_not_change_a_token() -> None:
    """Rows split over sampling threads give exactly what one thread gives."""
    n_vocab, rows = 151_936, 24
    x = (np.random.default_rng(5).standard_normal((rows, n_vocab)) * 2).astype(np.float32)
    one, four = (
        NativeStep(None, None, None, SLOTS, n_vocab, 1),
        NativeStep(None, None, None, SLOTS, n_vocab, 4),
    )
    try:
        for s in range(rows):
            p = CASES[s % len(CASES)]
            for ns in (one, four):
                ns.set_slot(s, SamplingParams(**{**_fields(p), "seed": s}), ROW_SAMPLE)
        for _ in range(3):
            assert (one.sample(x, list(range(rows))) == four.sample(x, list(range(rows)))).all()
    finally:
        four.close()
        four.close()  # twice is harmless


@pytest.mark.parametrize("n_vocab", [40, 1000, 262_144])
def test_a_masked_row_samples_only_allowed_tokens(n_vocab: int) -> None:
    """A constrained slot's mask (bit t % 32 of word t // 32: token t allowed) applies to
    its row before any sampling: greedy is the argmax over the allowed tokens, draws come
    only from them; an unmasked slot in the same call samples its whole row."""
    ns = _native(n_vocab)
    rng = np.random.default_rng(n_vocab)
    allowed = rng.random(n_vocab) < 0.01
    allowed[rng.integers(n_vocab)] = True  # at least one
    bits = np.zeros(ns.mask.shape[1] * 32, dtype=bool)
    bits[:n_vocab] = allowed
    row = np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32)
    x = rng.standard_normal((SLOTS, n_vocab)).astype(np.float32)
    x[:, ~allowed] += 100.0  # what the grammar forbids is what the model likes best
    for s in range(SLOTS):
        mode = ROW_GREEDY if s % 2 == 0 else ROW_SAMPLE
        ns.set_slot(s, SamplingParams(temperature=0.0 if s % 2 == 0 else 1.0, seed=s), mode)
        if s < SLOTS - 2:
            ns.mask[s] = row[:, 0]
            ns.masked[s] = 1
    got = ns.sample(x, list(range(SLOTS)))
    masked_best = np.where(allowed, x, -np.inf).argmax(axis=1)
    for s in range(0, SLOTS - 2, 2):
        assert got[s] == masked_best[s]
    assert allowed[got[: SLOTS - 2]].all()
    assert not allowed[got[SLOTS - 2]] and got[SLOTS - 2] == x[SLOTS - 2].argmax()


def test_logit_bias_and_banned_end_tokens_change_the_row_before_sampling() -> None:
    """A slot's logit_bias entries are added to its row (+100 makes a token the greedy
    pick, -100 bans the one that was), and while min_tokens is not met its end tokens
    are never picked; other slots in the call are untouched."""
    n_vocab = 5000
    ns = _native(n_vocab)
    ns.set_eog([7, 11])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, n_vocab)).astype(np.float32)
    x[:, 7] = 50.0  # an end token is everyone's favourite
    plain = SamplingParams(temperature=0.0)
    ns.set_slot(0, SamplingParams(temperature=0.0, logit_bias=((123, 100.0),)), ROW_GREEDY)
    ns.set_slot(1, SamplingParams(temperature=0.0, logit_bias=((7, -100.0),)), ROW_GREEDY)
    ns.set_slot(2, SamplingParams(temperature=0.0, min_tokens=3), ROW_GREEDY)
    ns.set_slot(3, plain, ROW_GREEDY)
    got = ns.sample(x, [0, 1, 2, 3])
    assert got[0] == 123
    banned = np.isin(np.arange(n_vocab), [7, 11])
    assert got[1] == np.where(np.arange(n_vocab) == 7, x[1] - 100.0, x[1]).argmax()
    assert got[2] not in (7, 11) and got[2] == np.where(banned, -np.inf, x[2]).argmax()
    assert got[3] == 7
    ns.set_slot(2, SamplingParams(temperature=0.0, min_tokens=3), ROW_GREEDY, skip=3)
    assert ns.sample(x, [2])[0] == 7  # min_tokens met: the end token is allowed again
