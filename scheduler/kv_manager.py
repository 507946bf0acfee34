"""The KV manager: the books the scheduler keeps on the engine's KV cache, behind an
interface in the scheduler's words.

The scheduler decides what runs (its queues, the admission order, fair share, the chunk
policy, whom to preempt); this object keeps what that means for KV: the pool of cells and
sequence ids (`KVPool`), the prefix cache (`PrefixIndex`) with the leases running requests
read it through, the holder ids that keep its leaves and their release one step late,
eviction, the host-RAM swap space with its keys and its cost, the running requests'
expected growth, and the backoff after the engine refused cells these books allowed. The
scheduler asks "what can this prompt read?", "cells for this chunk?", "keep or free this
finished sequence?"; it never sees a lease's node or a holder id.

It is as pure as the scheduler: it never calls the engine. Every change the engine must
make is collected as data for the next batch (`take_ops`), the way `PrefixIndex` returns
its ops; a holder id whose release is in a batch is free only once that batch ran
(`begin_step`), so no id is handed out while the engine still tags cells with it. (vLLM
v1 splits its scheduler from its KVCacheManager the same way; the cache here is SGLang's
kind, a radix tree over one unified llama.cpp cache.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.step_types import KVOp, Release, Share, StepBatch, StepResult, Trim
from scheduler.config import SchedulerConfig
from scheduler.kv import GrowthEstimate, KVPool, SwapCost, SwapSpace
from scheduler.prefix import Lease, PrefixIndex
from scheduler.request import Request, RequestStatus
from scheduler.stats import StepStats
from scheduler.step_cost import StepCostModel


@dataclass(slots=True)
class KVBatchOps:
    """What the next batch must carry for the engine's KV, by `StepBatch` field."""

    released: list[int] = field(default_factory=list)  # seq ids closed
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (seq id, swap key)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap key, seq id)
    swap_drop: list[int] = field(default_factory=list)  # swap keys nobody resumes
    retained: list[int] = field(default_factory=list)  # finished seq ids kept as cache
    kv_ops: list[KVOp] = field(default_factory=list)  # the prefix cache's, in order
    side_prefill: list[tuple[int, list[int]]] = field(default_factory=list)  # (key, tokens)

    @property
    def needs_batch(self) -> bool:
        """A batch must go out for these even when nothing is to be computed."""
        return bool(
            self.released or self.swap_drop or self.kv_ops or self.retained or self.side_prefill
        )


class KVManager:
    def __init__(self, cfg: SchedulerConfig, cost: StepCostModel) -> None:
        self.cfg = cfg
        self._cost = cost  # read only: what recomputing a victim would cost
        holders = cfg.max_cached_seqs if cfg.prefix_cache else 0
        self._pool = KVPool(cfg.kv_capacity, cfg.max_num_seqs + holders)
        self._prefix = PrefixIndex(cfg.sliding_window) if cfg.prefix_cache else None
        self._growth = GrowthEstimate(cfg.reserve_growth)
        self._swap = SwapSpace(cfg.swap_cells)
        self._swap_cost = SwapCost(cfg.kv_bytes_per_cell)
        self._swapped: dict[int, Request] = {}  # swap key -> its (waiting) request
        self._aside: set[int] = set()  # swap keys a side context is prefilling into
        self.pending = KVBatchOps()  # for the next batch (read-only outside)
        self._unhold_after: list[int] = []  # holder ids released by ops not yet sent
        self._unhold_ready: list[int] = []  # ... sent: free at the next step
        self._release_next: list[int] = []  # seq ids a pending op copies from: next batch
        # Set when the engine refused KV these books allowed: admit nobody new until a
        # request finishes (real room) or nothing runs, or the refusal repeats forever.
        self._backoff = False
        self._prefix_query = 0  # since the last stats: prompt tokens looked up,
        self._prefix_hit = 0  # ... of which read from the cache,
        self._prefix_evicted = 0  # ... and cached cells evicted;
        self._recomputed = 0  # tokens preemption threw away,
        self._swapped_out = 0  # victims whose KV went to host RAM
        self._aside_tokens = 0  # prompt tokens prefilled aside that came back

    # ---- what the books say ----------------------------------------------------------
    @property
    def used(self) -> int:
        return self._pool.used

    @property
    def cached(self) -> int:
        """Of `used`, cells of the prefix cache (read by none or many)."""
        return self._pool.cached

    @property
    def evictable(self) -> int:
        """Cached cells no running request reads."""
        return self._prefix.evictable if self._prefix is not None else 0

    @property
    def swap_used(self) -> int:
        return self._swap.used

    @property
    def num_free_seqs(self) -> int:
        return self._pool.num_free_seqs

    def own_cells(self, req: Request) -> int:
        """The cells a running request owns: what it computed beyond the prefix it reads."""
        assert req.seq_id is not None
        return self._pool.cells(req.seq_id)

    @property
    def engine_holders(self) -> set[int]:
        """Holder ids the engine keeps once the last batch ran (its releases applied)."""
        return self._pool.held - set(self._unhold_ready)

    @property
    def num_holders(self) -> int:
        """Sequence ids holding the cache, not counting those whose release is under way."""
        return self._pool.num_held - len(self._unhold_after) - len(self._unhold_ready)

    @property
    def _num_running(self) -> int:
        """Sequence ids open for running requests (every one holds exactly one)."""
        return self._pool.num_seqs - self._pool.num_free_seqs - self._pool.num_held

    # ---- reading the cache, and what fits --------------------------------------------
    def looks_up(self, req: Request) -> bool:
        """A new request (not one resuming) that may read the cache."""
        return self._prefix is not None and req.may_read_cache

    def cached_prefix(self, req: Request) -> int:
        """How much of a new request's prompt it can read from the cache (one token is
        always left to compute: its logits give the first output token)."""
        if self._prefix is None or not req.may_read_cache:
            return 0
        return self._prefix.readable(req.prompt_ids, req.num_prompt - 1)

    def room_for(self, req: Request, cached: int) -> int:
        """Cells `req`, reading `cached` tokens of its prompt from the cache, may take:
        free now or once the unread cache is evicted — the cache never keeps out a request
        that would fit without it — less the cells it reads, which then stay."""
        return self._free() - self._unread(req, cached)

    def growth_cells(self, req: Request) -> int:
        """Cells `req` is still expected to take as it generates (`GrowthEstimate`)."""
        return self._growth.cells(req.max_tokens - len(req.output_ids))

    def committed(self, running: Iterable[Request]) -> int:
        """Cells the running requests will still take beyond what they hold: the rest of
        their prompts and their expected growth."""
        return sum(
            max(0, r.num_tokens - r.shared - self.own_cells(r)) + self.growth_cells(r)
            for r in running
        )

    def short_of_kv(self, waiting: Iterable[Request], committed: int) -> bool:
        """KV pressure: the waiting requests need more cells than are left beside what the
        running will still take (the unread prefix cache counts as room: it gives way).
        What a waiting request would read from the cache it does not need again; the cells
        it would read that nobody reads yet stop being room then (counted once: requests
        behind one system prompt read the same cells)."""
        room, read = self._free() - committed, 0
        for req in waiting:
            cached = self.cached_prefix(req)
            read = max(read, self._unread(req, cached))
            room -= req.num_tokens - cached + self.growth_cells(req)
            if room - read < 0:
                return True
        return False

    def admits_new(self, anyone_running: bool) -> bool:
        """False while backing off from a refusal of the engine's (`engine_refused`); the
        backoff ends when a running request finishes, or when nothing runs."""
        if not anyone_running:
            self._backoff = False
        return not self._backoff

    def decode_step(self) -> None:
        """A step decodes: the share of their rest the running are expected to need decays."""
        self._growth.step()

    # ---- cells for a chunk -----------------------------------------------------------
    def start(self, req: Request, cached: int, cells: int) -> int:
        """Admit `req`: a sequence id (returned), its swapped KV restored into it or the
        `cached` prefix lent to it, `cells` more reserved (the caller asked `room_for`)."""
        seq = req.seq_id = self._pool.open()
        if req.swap_key is not None:  # it leaves the swap space once restored
            self.pending.swap_in.append((req.swap_key, seq))
        if self.looks_up(req):
            self._prefix_query += req.num_prompt
            self._prefix_hit += cached
        if cached:
            assert self._prefix is not None
            lease, ops = self._prefix.acquire(req.prompt_ids, seq, req.num_prompt - 1)
            req.lease, req.shared, req.num_computed = lease, lease.length, lease.length
            req.num_cached = lease.length
            self._note_ops(ops)
        self.make_room(cells)
        self._pool.grow(seq, cells)
        return seq

    def make_room(self, n: int) -> bool:
        """Evict cached prefixes nobody reads until `n` cells are free (or none is left);
        whether they are. If not, only a preemption frees more: the scheduler picks whom."""
        if self._prefix is not None and self._pool.free < n:
            self._evict(n - self._pool.free)
        return self.has_room(n)

    def has_room(self, n: int) -> bool:
        return self._pool.free >= n

    def reserve(self, req: Request, n: int) -> None:
        """`n` more cells for `req`'s next chunk (the caller made room)."""
        assert req.seq_id is not None
        self._pool.grow(req.seq_id, n)

    def reserve_fell_short(self) -> None:
        """A running request is preempted for another's cells: the growth kept for the
        running was too little, so it goes back to all they may still generate."""
        self._growth.preempted()

    # ---- preemption and swap ---------------------------------------------------------
    def preempt(self, req: Request) -> None:
        """A victim gives its cells back. Its KV goes to host RAM when that is cheaper than
        computing it again (`_swap_is_cheaper`); else it recomputes prompt + output."""
        assert req.seq_id is not None
        self._drop_lease(req)  # a swap saves the prefix it read too: it comes back its own
        self._drop_pin(req)
        if self._swap_is_cheaper(req.num_computed):
            key = self._swap.take(req.num_computed)
            self.pending.swap_out.append((req.seq_id, key))
            self._swapped[key] = req
            req.swap_key = key
            self._swapped_out += 1
        else:
            self._recomputed += req.num_computed
            req.num_computed = 0
        self._release_seq(req)

    def _swap_is_cheaper(self, cells: int) -> bool:
        """Swap a victim's `cells` out and back in, or recompute them? By the two cost
        models: the copy rate learned from swaps, the prefill time learned from steps (in
        full-budget chunks, as a resumed prompt runs alone at best). Before any prompt
        step was measured, swap: it keeps the work. No room in the swap space: recompute."""
        if not self._swap.fits(cells):
            return False
        if not self._cost.knows_prompts:
            return True
        b = self.cfg.max_num_batched_tokens
        redo = sum(self._cost.chunk_time(min(b, cells - d), d) for d in range(0, cells, b))
        return self._swap_cost.seconds(cells) < redo

    def swaps_ran(
        self, swap_in: list[tuple[int, int]], result: StepResult | None = None
    ) -> list[Request]:
        """A batch's swaps ran: restored sequences leave the swap space; one the engine
        could not save or restore recomputes, and those that were running (their restore
        failed) are returned, their ids released, for the scheduler to queue again."""
        lost = result.swap_out_failed + result.swap_in_failed if result is not None else []
        if result is not None:
            self._swap_cost.observe(result.swap_out_bytes, result.swap_out_s)
            self._swap_cost.observe(result.swap_in_bytes, result.swap_in_s)
        requeue = []
        for key in lost:
            req = self._swapped.get(key)
            if req is None:
                continue
            self._unswap(req)
            if req.status is RequestStatus.RUNNING:
                self._release_seq(req)
                requeue.append(req)
            self._recomputed += req.num_computed
            req.num_computed = 0
        for key, _ in swap_in:
            req = self._swapped.get(key)
            if req is not None:
                self._unswap(req)
        return requeue

    def _unswap(self, req: Request) -> None:
        """Its KV left the swap space (restored, dropped, or lost)."""
        assert req.swap_key is not None
        self._swap.give(req.swap_key)
        del self._swapped[req.swap_key]
        req.swap_key = None

    # ---- prompts prefilled aside -----------------------------------------------------
    def set_aside(self, req: Request) -> bool:
        """A new request's prompt, all but its last token, goes to the side context
        (engine.side_prefill), its KV to come back under a swap key of its own: swap space
        is held for it from now on. False when the space has no room (it runs in place)."""
        cells = req.num_prompt - 1
        if req.num_computed or req.swap_key is not None or not self._swap.fits(cells):
            return False
        key = req.swap_key = self._swap.take(cells)
        self._swapped[key] = req
        self._aside.add(key)
        self.pending.side_prefill.append((key, req.prompt_ids[:cells]))
        return True

    @property
    def num_aside(self) -> int:
        return len(self._aside)

    def aside_ran(self, done: list[tuple[int, bool]]) -> list[Request]:
        """Side prefills ended: a request whose KV came back is now a swapped-out one with
        its prompt computed but the last token (a step restores it, `start`); one whose
        prefill failed recomputes. Returned, to be queued again; one that ended meanwhile
        is not, and its bytes go."""
        back = []
        for key, saved in done:
            self._aside.discard(key)
            req = self._swapped.get(key)
            if req is None:  # aborted while aside (`finish` gave its space back)
                if saved:
                    self.pending.swap_drop.append(key)
                continue
            if saved:
                req.num_computed = req.num_prompt - 1
                self._aside_tokens += req.num_computed
            else:
                self._unswap(req)
                req.side_failed = True
            back.append(req)
        return back

    def engine_refused(self, batch: StepBatch, reqs: list[Request]) -> None:
        """The engine found no KV slot despite these books (its cache left as before): the
        restores ran, the chunks' cells come back, nobody new is admitted (`admits_new`)."""
        self.swaps_ran(batch.swap_in)
        for req, chunk in zip(reqs, batch.chunks, strict=True):
            if req.seq_id is not None:
                self._pool.shrink(req.seq_id, len(chunk.tokens))
        self._backoff = True

    # ---- finishing -------------------------------------------------------------------
    def finish(self, req: Request, keep: bool) -> None:
        """`req` ends (before its status says so). `keep` (it ended by its tokens or text):
        its KV joins the cache where it may; else it is freed. A copy in host RAM goes."""
        if req.status is RequestStatus.RUNNING:
            self._backoff = False  # real room: the engine's refusal may not repeat
        if req.swap_key is not None:
            # (a restore already sent, or a prefill aside whose bytes are still to come:
            # nothing to drop now; `aside_ran` drops those when they come)
            if req.status is RequestStatus.WAITING and req.swap_key not in self._aside:
                self.pending.swap_drop.append(req.swap_key)
            self._unswap(req)
        if keep and self._prefix is not None and req.seq_id is not None and req.cache_prompt:
            self._keep_as_cache(req)
        else:
            self._drop_lease(req)
            self._drop_pin(req)
            self._release_seq(req)

    def _release_seq(self, req: Request) -> None:
        """Its id and cells go with the next batch; where that batch copies from it into a
        holder (a prompt just offered), with the one after: releases run before copies."""
        if (seq := req.seq_id) is not None:
            if any(isinstance(op, Share) and op.src == seq for op in self.pending.kv_ops):
                self._release_next.append(seq)
            else:
                self._pool.close(seq)
                self.pending.released.append(seq)
            req.seq_id = None

    # ---- the prefix cache's books ----------------------------------------------------
    def chunk_ran(self, req: Request) -> None:
        """`req` computed a chunk: at the point it offers its prompt at (`split_at`), or at
        its prompt's end, what it computed joins the cache while it runs on (`_publish`)."""
        if (
            self._prefix is not None
            and req.cache_prompt
            and (
                req.num_computed == req.split_at
                or (not req.published and req.num_computed == req.num_prompt)
            )
        ):
            self._publish(req)

    def _free(self) -> int:
        """Cells free now or once the unread part of the prefix cache is evicted."""
        return self._pool.free + self.evictable

    def _unread(self, req: Request, cached: int) -> int:
        """Of the `cached` prefix `req` would read, the cells nobody reads yet: evictable
        now (room in `_free`), not once `req` reads them."""
        if not cached:
            return 0
        assert self._prefix is not None
        return self._prefix.unlocked(req.prompt_ids, cached)

    def _publish(self, req: Request) -> None:
        """`req` computed its prompt, or the stretch others wait for (`split_at`): a fresh
        holder tags the same cells as a cache leaf, so requests arriving while it decodes
        (or computes on) read them. Past the prompt but its last token, it offers no more."""
        assert self._prefix is not None and req.seq_id is not None
        n = req.num_computed
        if req.split_at == n:
            req.split_at = None
        req.published = n >= req.num_prompt - 1
        lease = req.lease or Lease(None, 0)
        tokens = req.prompt_ids[:n]
        if n == lease.length:
            return
        if self._holder_room():
            ids: list[int] = []

            def new_id() -> int:
                ids.append(self._pool.open())
                return ids[-1]

            out = self._prefix.publish(tokens, req.seq_id, lease, new_id)
            if out is not None:
                new_lease, given_up, ops = out
                self._pool.shrink(req.seq_id, n - lease.length)
                self._pool.hold(ids[0], n - lease.length - given_up)
                req.lease, req.shared = new_lease, n
                self._note_ops(ops)
                # a pin from an offer that failed earlier may tag cells it just gave up
                self._drop_pin(req)
                return
        # It cannot be offered now (with a window: the cache holds more of it than it read,
        # in no intact copy). A pin keeps its last window for when the request finishes and
        # its path joins the cache (`_keep_as_cache`).
        if (
            self._prefix.window
            and req.pin is None
            and self._prefix.match(tokens) > lease.length
            and self.num_holders < self.cfg.max_cached_seqs
            and (self._pool.num_free_seqs > self.cfg.max_num_seqs - self._num_running)
        ):  # (a free id: a pin that may come to nothing evicts nothing)
            pin = self._pool.open()
            self._pool.hold(pin, 0)
            req.pin = (pin, n)
            self.pending.kv_ops.append(Share(req.seq_id, pin, self._prefix.reach(n), n))

    def _holder_room(self) -> bool:
        """Make room for one more holder (`_free_an_id`), keeping an id for every request
        that may still be admitted; False if there is none."""
        while self.num_holders >= self.cfg.max_cached_seqs:
            if not self._free_an_id():
                return False
        # ids whose release is under way are free from the next step: for admissions,
        # which may wait a step, they count; the holder needs one free now
        pending = len(self._unhold_after) + len(self._unhold_ready)
        free = self._pool.num_free_seqs
        return free >= 1 and free - 1 + pending >= self.cfg.max_num_seqs - self._num_running

    def _free_an_id(self) -> bool:
        """Give up the least useful holder id: a pin inside a path first (it only keeps
        reads ending exactly there possible, e.g. at an older turn), then a leaf."""
        assert self._prefix is not None
        ops = self._prefix.unpin()
        if ops:
            self._note_ops(ops)
            return True
        return self._evict(1)

    def _evict(self, cells: int) -> bool:
        assert self._prefix is not None
        freed, ops = self._prefix.evict(cells)
        self._pool.cache(-freed)
        self._prefix_evicted += freed
        self._note_ops(ops)
        return bool(ops)

    def _note_ops(self, ops: list[KVOp]) -> None:
        self.pending.kv_ops += ops
        self._unhold_after += [op.seq for op in ops if isinstance(op, Release)]

    def _drop_pin(self, req: Request) -> None:
        if req.pin is not None:
            self._note_ops([Release(req.pin[0])])
            req.pin = None

    def _drop_lease(self, req: Request) -> None:
        if req.lease is not None:
            assert self._prefix is not None
            self._prefix.release(req.lease)
        req.lease, req.shared = None, 0

    def _keep_as_cache(self, req: Request) -> None:
        """A finished request's KV joins the cache: what is new becomes a leaf its sequence
        holds; what the cache had already is given up (the ops say which)."""
        assert self._prefix is not None and req.seq_id is not None
        tokens = req.tokens_from(0, req.num_computed)
        # Its pin keeps the window before the end of its prompt; once its path is cached the
        # pin is made to tag that path's cells there (the cache's own where it takes them),
        # which must then be intact: else the pin goes.
        pin, req.pin = req.pin, None
        keep = None
        if pin is not None and self._prefix.keeps(tokens, req.shared, self._prefix.reach(pin[1])):
            keep = self._prefix.reach(pin[1])
        given_up, ops = self._prefix.insert(tokens, req.seq_id, req.shared, keep)
        if pin is not None:
            kept = keep is not None and not any(
                isinstance(op, Release) and op.seq == req.seq_id for op in ops
            )
            if kept and self._prefix.pin(req.prompt_ids[: pin[1]], pin[0]):
                ops += [Trim(pin[0], 0, -1), Share(req.seq_id, pin[0], keep or 0, pin[1])]
            else:
                ops.append(Release(pin[0]))
        new = req.num_computed - req.shared - given_up
        self._drop_lease(req)
        self._pool.hold(req.seq_id, new)
        if not any(isinstance(op, Release) and op.seq == req.seq_id for op in ops):
            self.pending.retained.append(req.seq_id)
        self._note_ops(ops)
        req.seq_id = None
        while self.num_holders > self.cfg.max_cached_seqs and self._free_an_id():
            pass

    # ---- the batch -------------------------------------------------------------------
    def begin_step(self) -> None:
        """A step is planned: holder ids whose release went out in the last batch are free."""
        for seq in self._unhold_ready:
            self._pool.unhold(seq)
        self._unhold_ready = []

    def take_ops(self) -> KVBatchOps:
        """What the next batch must carry; the holder ids it releases are free once it ran."""
        ops, self.pending = self.pending, KVBatchOps(released=self._release_next)
        self._unhold_ready, self._unhold_after = self._unhold_after, []
        for seq in self._release_next:  # (their copies go out in `ops`)
            self._pool.close(seq)
        self._release_next = []
        return ops

    def report(self, stats: StepStats, running: Iterable[Request]) -> None:
        """Fill in the KV figures of a step's stats; the counts restart."""
        stats.kv_used = self._pool.used
        stats.kv_capacity = self._pool.capacity
        stats.kv_reserved = self.committed(running)
        stats.num_recomputed_tokens, self._recomputed = self._recomputed, 0
        stats.num_swapped_out, self._swapped_out = self._swapped_out, 0
        stats.kv_cached = self._pool.cached
        stats.prefix_query_tokens, self._prefix_query = self._prefix_query, 0
        stats.prefix_hit_tokens, self._prefix_hit = self._prefix_hit, 0
        stats.prefix_evicted_cells, self._prefix_evicted = self._prefix_evicted, 0
        stats.aside_prompt_tokens, self._aside_tokens = self._aside_tokens, 0
        stats.swap_used_cells = self._swap.used
        stats.swap_capacity_cells = self._swap.capacity

    def sanity_checks(self, num_running: int) -> None:
        self._pool.sanity_checks()
        self._swap.sanity_checks()
        assert self._num_running == num_running, "a running request without its own seq id"
        if self._prefix is not None:
            self._prefix.sanity_checks()
            assert self._pool.cached == self._prefix.cells, "cache cells drifted"
