"""The prefix index against a model of llama.cpp's unified KV cache.

`Cache` keeps cells as (position, token, set of sequence ids), applies the index's ops the
way llama.cpp's `seq_cp` / `seq_rm` do, and frees a cell when no id tags it. After every
operation: what each holder and each running sequence sees is exactly its tokens, and the
index's cell count is what the cache holds beyond the running sequences' own cells.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine.step_types import (
    KVOp,
    Release,
    SamplingParams,
    SeqChunk,
    SeqStart,
    Share,
    StepBatch,
    Trim,
)
from scheduler.prefix import Lease, PrefixIndex
from tests.fake_engine import FakeEngine


@dataclass
class Cache:
    cells: list[tuple[int, int, set[int]]] = field(default_factory=list)  # pos, token, ids

    def compute(self, seq: int, tokens: list[int], p0: int) -> None:
        """`seq` computes its own cells for positions p0.."""
        self.cells += [(p0 + i, t, {seq}) for i, t in enumerate(tokens[p0:])]

    def apply(self, ops: list[KVOp]) -> None:
        for op in ops:
            if isinstance(op, Share):
                for pos, _, ids in self.cells:
                    if op.src in ids and op.p0 <= pos < op.p1:
                        ids.add(op.dst)
            elif isinstance(op, Trim):
                end = op.p1 if op.p1 >= 0 else 1 << 60
                for pos, _, ids in self.cells:
                    if op.p0 <= pos < end:
                        ids.discard(op.seq)
            else:
                assert isinstance(op, Release)
                for _, _, ids in self.cells:
                    ids.discard(op.seq)
        self.cells = [c for c in self.cells if c[2]]

    def seen_by(self, seq: int) -> list[int]:
        """The tokens `seq` attends to, by position (it must see each position once)."""
        mine = sorted((pos, tok) for pos, tok, ids in self.cells if seq in ids)
        assert [p for p, _ in mine] == list(range(len(mine))), f"seq {seq}: positions {mine}"
        return [t for _, t in mine]


@dataclass
class Running:
    seq: int
    tokens: list[int]
    lease: Lease


def check(index: PrefixIndex, cache: Cache, running: dict[int, Running]) -> None:
    index.sanity_checks()
    private = 0
    for r in running.values():
        assert cache.seen_by(r.seq) == r.tokens
        private += len(r.tokens) - r.lease.length
    assert len(cache.cells) == index.cells + private
    for leaf in [n for n in index._nodes() if n.holder is not None]:
        assert leaf.holder is not None
        path, n = [], leaf
        while n is not None and n.parent is not None:
            path = n.tokens + path
            n = n.parent
        assert cache.seen_by(leaf.holder) == path


def start(index: PrefixIndex, cache: Cache, seq: int, tokens: list[int]) -> Running:
    lease, ops = index.acquire(tokens, seq, len(tokens) - 1)
    cache.apply(ops)
    cache.compute(seq, tokens, lease.length)
    return Running(seq, tokens, lease)


def finish(index: PrefixIndex, cache: Cache, r: Running) -> int:
    given_up, ops = index.insert(r.tokens, r.seq, r.lease.length)
    index.release(r.lease)
    cache.apply(ops)
    return given_up


def test_a_second_request_reads_the_first_ones_prefix() -> None:
    index, cache = PrefixIndex(), Cache()
    system = [7] * 20
    a = start(index, cache, 0, [*system, 1, 2, 3])
    assert a.lease.length == 0
    assert finish(index, cache, a) == 0 and index.cells == 23
    b = start(index, cache, 1, [*system, 4, 5])
    assert b.lease.length == 20  # the shared system prompt, not the other question
    check(index, cache, {1: b})
    assert index.match([*system, 1, 2]) == 22
    assert finish(index, cache, b) == 0
    check(index, cache, {})
    assert index.cells == 25  # 20 shared + 3 + 2


def test_a_whole_prompt_cached_still_computes_its_last_token() -> None:
    index, cache = PrefixIndex(), Cache()
    finish(index, cache, start(index, cache, 0, [1, 2, 3, 4]))
    r = start(index, cache, 1, [1, 2, 3, 4])
    assert r.lease.length == 3
    check(index, cache, {1: r})
    assert finish(index, cache, r) == 4 - 3  # its last cell was a copy: released
    check(index, cache, {})
    assert index.cells == 4


def test_prefixes_in_use_are_never_evicted_and_lru_goes_first() -> None:
    index, cache = PrefixIndex(), Cache()
    for seq, tail in enumerate([[1, 1], [2, 2], [3, 3]]):
        finish(index, cache, start(index, cache, seq, [9, 9, *tail]))
    reader = start(index, cache, 5, [9, 9, 2, 2, 8])  # reads [9 9 2 2]
    assert reader.lease.length == 4
    freed, ops = index.evict(2)
    cache.apply(ops)
    assert freed == 2 and index.match([9, 9, 1, 1]) == 2  # the oldest leaf went
    check(index, cache, {5: reader})
    freed, ops = index.evict(100)  # everything it may: [9 9 3 3]'s leaf
    cache.apply(ops)
    assert freed == 2 and index.cells == 4 and index.evictable == 0
    check(index, cache, {5: reader})
    finish(index, cache, reader)
    assert index.evictable == index.cells == 5
    freed, ops = index.evict(100)
    cache.apply(ops)
    assert freed == 5 and index.cells == 0 and cache.cells == []


def test_a_request_that_computed_a_cached_prefix_itself_shares_it_on_finish() -> None:
    """Two requests with the same prompt started before either finished: the second's
    copy of the prompt is given up for the first one's cells."""
    index, cache = PrefixIndex(), Cache()
    a = start(index, cache, 0, [4, 4, 4, 1])
    b = start(index, cache, 1, [4, 4, 4, 2])
    finish(index, cache, a)
    assert finish(index, cache, b) == 3
    check(index, cache, {})
    assert index.cells == len(cache.cells) == 5


def test_seeded_random_workloads_keep_the_cache_and_the_index_in_step() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        index, cache = PrefixIndex(), Cache()
        running: dict[int, Running] = {}
        prefixes = [[rng.randrange(3) for _ in range(rng.randint(1, 6))] for _ in range(4)]
        free_seqs = list(range(64))
        for _ in range(120):
            op = rng.random()
            if op < 0.45 and free_seqs:
                tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 6))]
                seq = free_seqs.pop()
                before = index.match(tokens)
                r = start(index, cache, seq, tokens)
                assert r.lease.length == min(before, len(tokens) - 1)
                running[seq] = r
            elif op < 0.85 and running:
                r = running.pop(rng.choice(list(running)))
                finish(index, cache, r)
            else:
                _, ops = index.evict(rng.randint(1, 8))
                cache.apply(ops)
            check(index, cache, running)
            held = {n.holder for n in index._nodes() if n.holder is not None}
            live = set(running) | held
            free_seqs = [s for s in range(64) if s not in live]
            assert all(not ids - live for _, _, ids in cache.cells), "an id tags cells unknown"
        for r in running.values():
            finish(index, cache, r)
        assert index.evictable == index.cells
        _, ops = index.evict(10**9)
        cache.apply(ops)
        assert index.cells == 0 and cache.cells == []


def test_the_fake_engine_follows_the_index_like_llama_cpp() -> None:
    """The scheduler's tests run the index's ops on the fake engine: a kept sequence lends
    its prefix, the reader continues after it, and the shared cells count once."""
    fake, index = FakeEngine(), PrefixIndex()
    greedy = SamplingParams(temperature=0)
    first = [5, 6, 7, 8, 9]
    fake.step(StepBatch([SeqChunk(0, first, 0, True)], starts=[SeqStart(0, greedy)]))
    _, ops = index.insert(first, 0, 0)
    fake.step(StepBatch([], retained=[0], kv_ops=ops))
    second = [5, 6, 7, 1]
    lease, ops = index.acquire(second, 1, len(second) - 1)
    assert lease.length == 3
    fake.step(
        StepBatch([SeqChunk(1, second[3:], 3, True)], starts=[SeqStart(1, greedy)], kv_ops=ops)
    )
    assert fake.history(1) == second and fake.history(0) == first
    assert fake.kv_used == 5 + 1
    _, ops = index.insert(second, 1, lease.length)
    index.release(lease)
    fake.step(StepBatch([], retained=[1], kv_ops=ops))
    _, ops = index.evict(100)
    fake.step(StepBatch([], kv_ops=ops))
    assert fake.kv == {} and fake.kv_used == 0


def test_with_a_window_a_leaf_that_gets_a_child_keeps_what_a_read_at_its_end_attends_to() -> None:
    """A token at position L attends to [L - window + 1, L] on the window layers, and
    llama.cpp may already have reused the cell a full window back. When a cached leaf
    gets a child, its holder stays as the pin of its end with exactly those cells, and a
    read ending there stays possible; the cell a window back is not claimed as intact."""
    window = 8
    index = PrefixIndex(window)
    first = list(range(1, 41))
    index.insert(first, 1, 0)
    assert index.reach(40) == 33
    _, ops = index.insert([*first, 50, 51], 2, 0)
    assert Trim(1, 0, 33) in ops  # the pin keeps [33, 40)
    assert index.readable([*first, 60, 61], 41) == 40
    # a finishing sequence may take the tree's cells only where they are certainly intact:
    # a read at the end of [*first, 70] needs [34, 41), covered by the pin from 34 on
    assert index.keeps([*first, 70], 0, 34)
    assert not index.keeps([*first, 70], 0, 32)
