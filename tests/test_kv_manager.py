"""The KV manager on its own, driven the way the scheduler drives it, its batch ops applied
to the model of llama.cpp's unified cache (`Cache`, from the prefix index's tests) as the
engine applies them: what each running sequence sees is exactly its tokens, what a new
prompt reads is exactly its prefix, and the books count every cell the cache holds once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine.step_types import Release, SeqChunk, StepBatch, StepResult
from scheduler.config import SchedulerConfig
from scheduler.kv_manager import KVManager
from scheduler.request import Request, RequestStatus
from scheduler.stats import StepStats
from scheduler.step_cost import StepCostModel
from tests.fake_engine import make_request
from tests.test_prefix_index import Cache


def config(**kw: int | bool) -> SchedulerConfig:
    base: dict[str, int | bool] = dict(
        max_num_seqs=4, kv_capacity=200, max_num_batched_tokens=16, prefix_cache=True,
        max_cached_seqs=4,
    )  # fmt: skip
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


@dataclass
class Engine:
    """The KV manager and the cache model, with what the scheduler and the engine do to
    them around it: admit, compute chunks, sample, preempt, finish, send a batch."""

    kv: KVManager
    cache: Cache = field(default_factory=Cache)
    running: list[Request] = field(default_factory=list)
    saved: dict[int, list[int]] = field(default_factory=dict)  # swap key -> tokens

    def send(self, check: bool = True) -> None:
        """The next batch, applied in the engine's order: saves, releases, cache ops,
        restores (`engine.runner`); then the books and the cache agree (`check`) unless
        cells are reserved for a chunk not computed yet."""
        ops = self.kv.take_ops()
        for seq, key in ops.swap_out:
            self.saved[key] = self.cache.seen_by(seq)
        self.cache.apply([Release(seq) for seq in ops.released])
        self.cache.apply(ops.kv_ops)
        for key, seq in ops.swap_in:
            self.cache.compute(seq, self.saved.pop(key), 0)
        for key in ops.swap_drop:
            del self.saved[key]
        assert not self.kv.swaps_ran(ops.swap_in, StepResult({}))  # (the model loses none)
        self.kv.begin_step()
        if check:
            self.check()

    def admit(self, req: Request, n: int) -> bool:
        """Start `req` with a first chunk of `n` tokens after what it reads, if it fits."""
        cached = self.kv.cached_prefix(req)
        cells = req.num_computed + n
        if not self.kv.num_free_seqs or self.kv.room_for(req, cached) < cells:
            return False
        self.kv.start(req, cached, cells)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.send(check=False)  # its lease's Share (or its restore) goes before its chunk
        assert self.cache.seen_by(req.seq_id or 0) == req.tokens_from(0, req.num_computed)
        self.compute(req, n)
        return True

    def chunk(self, req: Request, n: int) -> bool:
        """The next `n` tokens of a running request, if room can be made for them."""
        if not self.kv.make_room(n):
            return False
        self.kv.reserve(req, n)
        self.send(check=False)
        self.compute(req, n)
        return True

    def compute(self, req: Request, n: int) -> None:
        assert req.seq_id is not None
        end = req.num_computed + n
        self.cache.compute(req.seq_id, req.tokens_from(0, end), req.num_computed)
        req.num_computed = end
        self.kv.chunk_ran(req)
        if end == req.num_tokens:  # it samples its next token
            req.output_ids.append(1 + end % 7)
        self.send()

    def preempt(self, req: Request) -> None:
        self.kv.preempt(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        self.send()

    def finish(self, req: Request, keep: bool) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv.finish(req, keep)
        req.status = RequestStatus.FINISHED_STOPPED if keep else RequestStatus.FINISHED_ABORTED
        self.send()

    def check(self) -> None:
        self.kv.sanity_checks(len(self.running))
        for r in self.running:
            assert r.seq_id is not None
            assert self.cache.seen_by(r.seq_id) == r.tokens_from(0, r.num_computed)
            assert self.kv.own_cells(r) == r.num_computed - r.shared
        assert len(self.cache.cells) == self.kv.used, "a cell counted twice, or not at all"
        ids = {i for _, _, tagged in self.cache.cells for i in tagged}
        closing = set(self.kv.pending.released)  # (their release goes with the next batch)
        assert ids <= {r.seq_id for r in self.running} | self.kv.engine_holders | closing, (
            "id leaked"
        )


def engine(**kw: int | bool) -> Engine:
    return Engine(KVManager(config(**kw), StepCostModel()))


def test_a_finished_prompt_is_read_by_the_next_one_and_counted_once() -> None:
    e = engine()
    system = list(range(1, 21))
    a = make_request("a", [*system, 30, 31], 4)
    assert e.admit(a, 16) and e.chunk(a, 6)
    e.finish(a, keep=True)
    assert e.kv.cached == 22 and e.kv.evictable == e.kv.cached  # (its last token: not computed)
    b = make_request("b", [*system, 40], 4)
    assert e.kv.cached_prefix(b) == 20
    assert e.admit(b, 1)
    assert b.num_cached == 20 and e.kv.cached == 23  # b's prompt was offered as computed
    assert e.kv.evictable == 2  # a's own two tokens: the 21 cells b reads are locked
    e.finish(b, keep=False)
    assert e.kv.evictable == e.kv.cached == 23


def test_a_prompt_is_offered_to_the_cache_while_its_request_decodes() -> None:
    e = engine()
    a = make_request("a", list(range(1, 31)), 8)
    assert e.admit(a, 16) and e.chunk(a, 14)  # the prompt's end: offered (`chunk_ran`)
    assert a.published and a.shared == 30 and e.kv.num_holders == 1
    b = make_request("b", [*range(1, 31), 50], 2)
    assert e.kv.cached_prefix(b) == 30 and e.admit(b, 1)
    e.finish(a, keep=True)
    e.finish(b, keep=True)


def test_room_is_made_by_evicting_unread_cache_and_never_read_cache() -> None:
    e = engine(kv_capacity=60)
    a = make_request("a", list(range(1, 31)), 1)
    assert e.admit(a, 16) and e.chunk(a, 14)
    e.finish(a, keep=True)
    reader = make_request("r", [*range(1, 21), 9, 9], 1)
    assert e.admit(reader, 2)  # reads 20 cells: they are no longer room
    # all but the 22 cells it reads (its own two were offered to the cache as computed)
    assert e.kv.room_for(make_request("x", [7] * 30, 1), 0) == 60 - 22
    big = make_request("big", [7] * 40, 1)
    assert not e.admit(big, 40)
    assert e.kv.make_room(38) and e.kv.cached == 22  # the unread 10 went
    assert not e.kv.make_room(39)  # the rest is read: only a preemption frees more
    e.send()


def test_a_released_holder_id_is_handed_out_only_after_its_batch_ran() -> None:
    e = engine(max_num_seqs=1, max_cached_seqs=1, kv_capacity=40)
    a = make_request("a", list(range(1, 21)), 1)
    assert e.admit(a, 16) and e.chunk(a, 4)
    e.finish(a, keep=True)
    assert e.kv.num_free_seqs == 1 and e.kv.num_holders == 1
    [holder] = e.kv.engine_holders
    assert e.kv.make_room(40)  # evicts a's leaf: its holder's Release is pending
    assert e.kv.num_holders == 0 and e.kv.num_free_seqs == 1
    ops = e.kv.take_ops()
    assert ops.kv_ops == [Release(holder)] and e.kv.num_free_seqs == 1
    e.cache.apply(ops.kv_ops)
    e.kv.begin_step()
    assert e.kv.num_free_seqs == 2


def test_a_victim_is_swapped_when_it_fits_the_swap_space_and_recomputes_otherwise() -> None:
    e = engine(prefix_cache=False, max_cached_seqs=0, swap_cells=20)
    a = make_request("a", list(range(1, 13)), 4)
    b = make_request("b", list(range(1, 31)), 4)
    assert e.admit(a, 12) and e.admit(b, 16) and e.chunk(b, 14)
    e.preempt(a)
    assert a.swap_key is not None and a.num_computed == 12 and e.kv.swap_used == 12
    e.preempt(b)  # its 30 cells do not fit the 8 left
    assert b.swap_key is None and b.num_computed == 0
    assert e.admit(a, 1)  # restored into a fresh id, then its next token
    assert a.swap_key is None and e.kv.swap_used == 0 and a.num_computed == 13
    stats = _report(e)
    assert (stats.num_swapped_out, stats.num_recomputed_tokens) == (1, 30)


def test_a_failed_restore_is_handed_back_to_recompute() -> None:
    e = engine(prefix_cache=False, max_cached_seqs=0, swap_cells=100)
    a = make_request("a", list(range(1, 11)), 4)
    assert e.admit(a, 10)
    e.preempt(a)
    key = a.swap_key
    assert key is not None
    e.kv.start(a, 0, a.num_computed + 1)
    a.status = RequestStatus.RUNNING
    ops = e.kv.take_ops()
    assert ops.swap_in == [(key, a.seq_id)]
    requeue = e.kv.swaps_ran(ops.swap_in, StepResult({}, swap_in_failed=[key]))
    assert requeue == [a] and a.seq_id is None and a.num_computed == 0
    assert e.kv.swap_used == 0 and e.kv.pending.released


def test_a_waiting_swapped_request_that_ends_drops_its_host_copy() -> None:
    e = engine(prefix_cache=False, max_cached_seqs=0, swap_cells=100)
    a = make_request("a", list(range(1, 11)), 4)
    assert e.admit(a, 10)
    e.preempt(a)
    key = a.swap_key
    e.kv.finish(a, keep=False)
    assert e.kv.pending.swap_drop == [key] and e.kv.swap_used == 0


def test_after_the_engine_refused_cells_nobody_new_is_admitted_until_room_is_real() -> None:
    e = engine(prefix_cache=False, max_cached_seqs=0)
    a = make_request("a", list(range(1, 11)), 4)
    b = make_request("b", list(range(1, 11)), 4)
    assert e.admit(a, 10) and e.admit(b, 10)
    e.kv.reserve(a, 1)
    used = e.kv.used
    e.kv.engine_refused(StepBatch([_chunk(a, 1)]), [a])
    assert e.kv.used == used - 1
    assert not e.kv.admits_new(anyone_running=True)
    e.finish(b, keep=False)  # a running request finished: its cells are real room
    assert e.kv.admits_new(anyone_running=True)
    e.kv.engine_refused(StepBatch([]), [])
    assert e.kv.admits_new(anyone_running=False)


def test_committed_counts_the_rest_of_the_prompts_and_the_expected_growth() -> None:
    e = engine(prefix_cache=False, max_cached_seqs=0)
    a = make_request("a", list(range(1, 31)), 100)
    assert e.admit(a, 10)
    grow = e.kv.growth_cells(a)
    assert 0 < grow < 100 and e.kv.committed([a]) == 20 + grow
    e.kv.reserve_fell_short()  # a preemption: the reserve is everything they may generate
    assert e.kv.growth_cells(a) == 100
    waiting = [make_request("w", list(range(1, 50)), 1)]  # 50 of the 70 cells left
    assert not e.kv.short_of_kv(waiting, e.kv.committed([a]))
    assert e.kv.short_of_kv(waiting * 2, e.kv.committed([a]))


def test_a_prompt_offered_just_before_its_request_ends_is_still_cached() -> None:
    """A request offers its prompt to the cache in one step's postprocess (a Share from its
    id to a new holder) and is aborted before the next batch goes out: that batch releases
    its id before the Share runs (the engine applies `released` first), so the holder
    would tag nothing while the books say it holds the prompt: the release waits a batch."""
    e = engine()
    ids = e.kv.num_free_seqs
    a = make_request("a", list(range(1, 21)), 4)
    assert e.admit(a, 16)
    e.kv.reserve(a, 4)
    e.send(check=False)
    end = a.num_computed + 4
    e.cache.compute(a.seq_id or 0, a.tokens_from(0, end), a.num_computed)
    a.num_computed = end
    e.kv.chunk_ran(a)  # offered: its Share is pending
    e.running.remove(a)
    e.kv.finish(a, keep=False)  # aborted before the batch that carries it
    e.send()
    e.send()  # then its id goes: only the holder's is taken
    assert e.kv.num_free_seqs == ids - 1


@pytest.mark.parametrize("seed", range(30))
def test_random_workloads_keep_the_books_and_the_cache_in_step(seed: int) -> None:
    """Admissions that read cached prefixes, chunks that must make room, preemptions that
    swap or recompute, requests kept as cache or freed, in a pool that forces eviction:
    after every batch each sequence sees exactly its tokens, each prompt read exactly its
    prefix, no id the books let go tags a cell, and every cell is counted once."""
    rng = random.Random(seed)
    capacity = rng.choice([60, 120])
    e = engine(
        kv_capacity=capacity, max_cached_seqs=rng.choice([1, 3]), swap_cells=rng.choice([0, 60])
    )
    heads = [[1 + (5 * i + s) % 30 for i in range(rng.randint(3, 25))] for s in range(3)]
    waiting: list[Request] = []
    for n in range(rng.randint(15, 30)):
        p = rng.choice(heads) + [rng.randrange(1, 30) for _ in range(rng.randint(1, 10))]
        waiting.append(make_request(f"r{n}", p, rng.randint(1, 6)))
    for _ in range(400):
        if not waiting and not e.running:
            break
        if waiting and rng.random() < 0.4:
            req = waiting[0]
            rest = req.num_uncomputed - e.kv.cached_prefix(req)
            if e.admit(req, min(rest, rng.randint(1, 16))):
                waiting.pop(0)
        elif e.running:
            req = rng.choice(e.running)
            if len(req.output_ids) >= req.max_tokens:
                e.finish(req, keep=rng.random() < 0.8)
            elif not e.chunk(req, min(req.num_uncomputed, rng.randint(1, 16))):
                victim = min(reversed(e.running), key=lambda r: r.num_computed)
                e.kv.reserve_fell_short()
                e.preempt(victim)
                waiting.insert(0, victim)
    for req in list(e.running):
        e.finish(req, keep=True)
    assert e.kv.evictable == e.kv.cached
    assert e.kv.make_room(capacity)
    e.send()
    assert e.kv.used == 0 and not e.cache.cells


def _chunk(req: Request, n: int) -> SeqChunk:
    assert req.seq_id is not None
    return SeqChunk(req.seq_id, req.tokens_from(req.num_computed, n), req.num_computed, False)


def _report(e: Engine) -> StepStats:
    stats = StepStats()
    e.kv.report(stats, e.running)
    return stats
