"""The scheduler core: which tokens go into the next step, and what a step's tokens mean.

Synchronous and pure (no I/O, asyncio, ctypes or metrics): `schedule()` builds the next
`StepBatch`, `postprocess()` folds the engine's `StepResult` back into request state and
returns each request's new tokens plus the step's stats (their text, and stop strings,
are `scheduler.output`'s). Time is passed in, never read.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.step_types import (
    KVOp,
    Release,
    Sampled,
    SeqChunk,
    SeqStart,
    Share,
    StepBatch,
    StepResult,
    Trim,
)
from scheduler.budget import ChunkPolicy, FixedBudget, StallTarget
from scheduler.kv import GrowthEstimate, KVPool, SwapCost, SwapSpace
from scheduler.prefix import Lease, PrefixIndex, common_prefix
from scheduler.request import Request, RequestOutput, RequestStatus
from scheduler.stats import FinishedStats, StepStats
from scheduler.step_cost import StepCostModel, StepDraft


class QueueFull(Exception):
    """The waiting queue, or the sender's share of it, is full; the caller should retry."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int  # sequences decoding at once (llama.cpp seq ids)
    kv_capacity: int  # KV cells shared by all sequences
    max_num_batched_tokens: int  # tokens per step, at most the context's n_batch
    max_waiting: int = 256  # queued sequences beyond which add_group() refuses
    max_prefill_chunk: int | None = None  # cap on one prompt chunk (None = the step budget)
    kv_watermark: int = 0  # cells kept free when admitting, so decoders are not preempted
    reserve_growth: bool = True  # admission keeps cells for the running requests' growth
    max_stall_s: float | None = None  # target step time while others decode (None = off)
    stall_auto: bool = False  # the target is the server's default: chunks stay efficient
    min_prefill_chunk: int = 32  # prompt tokens a step always grants: prefill progresses
    ubatch: int = 0  # llama.cpp's physical batch: bounded steps avoid a short last one
    attention_tile: int = 0  # query rows per attention tile (ggml CPU: 64), the same
    swap_cells: int = 0  # host-RAM pool for preempted sequences' KV, in cells (0 = none)
    kv_bytes_per_cell: int = 0  # what one cell takes there (all layers' K and V)
    prefix_cache: bool = False  # finished sequences' KV stays as a cache new prompts read
    max_cached_seqs: int = 0  # sequence ids kept for the cache, beyond max_num_seqs
    sliding_window: int = 0  # the model's attention window, if it has one (see prefix.py)
    prompt_logprob_rows: int = 64  # a scored prompt's chunk cap (the engine's rows per call)


@dataclass(slots=True)
class SchedulerOutput:
    """The step to run: `batch` for the engine, `reqs[i]` owning `batch.chunks[i]`."""

    batch: StepBatch
    reqs: list[Request] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        b = self.batch
        return not (
            b.chunks or b.released or b.starts or b.swap_out or b.swap_drop or b.kv_ops
            or b.retained
        )  # fmt: skip


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        if cfg.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.cfg = cfg
        holders = cfg.max_cached_seqs if cfg.prefix_cache else 0
        self.pool = KVPool(cfg.kv_capacity, cfg.max_num_seqs + holders)
        self.prefix = PrefixIndex(cfg.sliding_window) if cfg.prefix_cache else None
        self._prefix_query = 0  # since the last stats: prompt tokens looked up,
        self._prefix_hit = 0  # ... of which read from the cache,
        self._prefix_evicted = 0  # ... and cached cells evicted
        self._kv_ops: list[KVOp] = []  # for the next batch
        self._retained: list[int] = []  # finished sequences kept as cache holders
        self._unhold_after: list[int] = []  # holder ids released by ops not yet sent
        self._unhold_ready: list[int] = []  # ... sent: free at the next schedule
        self.growth = GrowthEstimate(cfg.reserve_growth)
        self._recomputed = 0  # tokens preemption threw away since the last stats
        self.swap = SwapSpace(cfg.swap_cells)
        self.swap_cost = SwapCost(cfg.kv_bytes_per_cell)
        self._swapped: dict[int, Request] = {}  # swap key -> its (waiting) request
        self._swap_out: list[tuple[int, int]] = []  # for the next batch: (seq id, key)
        self._swap_drop: list[int] = []
        self._num_preempted = 0  # since the last stats, all kinds
        self._num_swapped_out = 0  # of which swapped
        self._kv_blocked_since: float | None = None  # the queue's head waits for KV since
        self._now = 0.0  # the time of the last schedule()
        cost = StepCostModel(cfg.ubatch, cfg.attention_tile)
        self.policy: ChunkPolicy = (
            FixedBudget(cost) if cfg.max_stall_s is None else StallTarget(
                cost, cfg.max_stall_s, cfg.min_prefill_chunk, cfg.max_num_batched_tokens,
                cfg.stall_auto,
            )
        )  # fmt: skip
        self.cost = cost
        self._draft = StepDraft()  # the step last scheduled, as the policy saw it
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._stops: set[str] = set()  # running requests their text stopped (`stop`)
        self._released: list[int] = []
        self._finished: list[FinishedStats] = []  # finished outside a step (aborts)
        # Set when the backend refused KV our accounting allowed: admit nobody new until a
        # request finishes (real room) or nothing runs, or the refusal repeats forever.
        self._kv_backoff = False

    # ---- inputs ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.add_group([req])

    @property
    def max_group(self) -> int:
        """The most sequences one client may ever hold in the queue: a larger request can
        never be queued (the API refuses it with a 400, not a 429 to retry)."""
        return max(1, self.cfg.max_waiting // 2)

    def add_group(self, reqs: Sequence[Request]) -> None:
        """Queue the sequences of one API call (its prompts × choices) together, or none
        (`QueueFull`, see `check_room`)."""
        self.check_room(reqs[0].client, len(reqs))
        for req in reqs:
            if req.params.prompt_logprobs is not None:
                # every prompt position needs its logit row: computed, never read
                req.cache_prompt = False
            self.waiting.append(req)
            self._by_id[req.req_id] = req

    def check_room(self, client: str, k: int) -> None:
        """Raise `QueueFull` unless `client` may queue `k` more sequences now.

        Fair share: a client (its API key, else its connection) may hold at most
        `max_waiting // (n + 1)` waiting sequences, n being the clients with sequences
        waiting, itself included. One client alone can use half the queue, and a client
        over its share adds nothing while others wait, so a flood fills at most its share
        and delays its sender. What a client took under a larger share is not taken back:
        several clients that each filled their share can still fill the queue between
        them (evicting the newest waiting request of the largest holder would close that).
        """
        total = len(self.waiting)
        if total + k > self.cfg.max_waiting:
            raise QueueFull(f"{total} sequences already waiting (at most {self.cfg.max_waiting})")
        held = Counter(r.client for r in self.waiting)
        share = max(1, self.cfg.max_waiting // (len(held | {client: 1}) + 1))
        if held[client] + k > share:
            raise QueueFull(
                f"this client has {held[client]} sequences waiting; its share of the queue "
                f"is {share} while {len(held)} clients wait"
            )

    def abort(self, req_id: str, now: float) -> None:
        """A waiting request leaves the queue at once (a refused or abandoned request must
        not hold a place others could use); a running one is removed at the next
        `schedule()`, since a step may be running it right now."""
        req = self._by_id.get(req_id)
        if req is None:
            return
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED, now, self._finished)
        else:
            self._aborts.add(req_id)

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running or self._aborts or self._stops or self._released
            or self._swap_drop
            or self._kv_ops or self._retained
        )  # fmt: skip

    # ---- schedule --------------------------------------------------------------------
    def schedule(self, now: float, others_waiting: bool = False) -> SchedulerOutput:
        """The next step. `others_waiting`: requests of another lane wait for this step to
        end (lanes step one after the other), so it is bounded by the stall target as if
        they decoded here, and never a burst's."""
        self._now = now
        for seq in self._unhold_ready:  # their Release went out in the last batch
            self.pool.unhold(seq)
        self._unhold_ready = []
        self._apply_aborts(now)
        budget = self.cfg.max_num_batched_tokens
        plan: dict[str, tuple[Request, int]] = {}  # insertion order = batch order
        preempted = 0
        # Decoders first: every running user gets its token before any prompt chunk.
        for req in [r for r in self.running if r.is_decoding]:
            if budget < 1:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            ok, n_pre = self._reserve(req, 1, plan)
            preempted += n_pre
            if ok:
                plan[req.req_id] = (req, 1)
                budget -= 1
        n_decode = len(plan)
        decode_depth = sum(r.num_computed for r, _ in plan.values())
        budget = self.cfg.max_num_batched_tokens - n_decode
        # Prompt chunks, oldest first (FCFS), sized to keep the step under the stall target
        # — except for a burst: when every decoder has one token so far and no prefill is
        # under way, the decoders came with the prompts now waiting (a closed-loop wave: the
        # first arrival is prefilled alone while the rest arrive). Bounding the step for
        # them would stagger the burst over many steps, and every later step would mix
        # prompt work. A prefill already under way stays bounded for every decoder.
        prefilling = [r for r in self.running if not r.is_decoding and r.req_id not in plan]
        burst = (
            not prefilling
            and not others_waiting
            and all(len(r.output_ids) < 2 for r, _ in plan.values())
        )
        draft = StepDraft(n_decode, decode_depth, n_decode > 0 or others_waiting, burst)
        joined = True
        for i, req in enumerate(prefilling):
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            req.split_at = self._offer_point(req, req.num_computed, req.shared)
            n = self.policy.grant(
                draft,
                min(req.num_uncomputed, budget, self._chunk_cap(req), self._until_split(req)),
                req.num_computed,
                req.num_uncomputed,
            )
            if n < 1:
                break
            behind = len(prefilling) - i - 1 + len(self.waiting)
            if not self.cost.joins(draft, n, req.num_computed, behind):
                joined = False  # it waits for the next step, and everyone behind it
                break
            ok, n_pre = self._reserve(req, n, plan)
            preempted += n_pre
            if ok:
                plan[req.req_id] = (req, n)
                draft.chunks.append((n, req.num_computed))
                draft.finishing += n == req.num_uncomputed
                budget -= n
        budget = self.cfg.max_num_batched_tokens - sum(n for _, n in plan.values())
        starts: list[SeqStart] = []
        if not self.running:
            self._kv_backoff = False
        # A step that had to preempt admits nobody: the room it made is for the running.
        can_admit = preempted == 0 and not self._kv_backoff and joined
        if n_decode:
            self.growth.step()
        # Admission by what a request needs: its whole uncomputed prompt (a preempted one's
        # output too) and its expected growth, beside what the running still need — never
        # by its first chunk alone, which lets a prompt in that the pool cannot finish.
        # A swapped-out request brings back the cells it held (`num_computed`; a new or
        # recomputing one holds none).
        committed = self._committed()
        swap_in: list[tuple[int, int]] = []
        kv_blocked = False
        # When the pool cannot hold everyone waiting, and sharing steps buys little
        # (`batching_pays`), serve one after another: the running finish at their own pace
        # and nobody's pace is halved for a newcomer that must wait anyway.
        if (
            can_admit
            and self.running
            and self.waiting
            and not self.cost.batching_pays()
            and self._short_of_kv(committed)
        ):
            can_admit, kv_blocked = False, True
        queue = list(self.waiting)
        for i, req in enumerate(queue):
            if not (
                can_admit and budget > 0 and self.pool.num_free_seqs > 0
                and len(self.running) < self.cfg.max_num_seqs
            ):  # fmt: skip
                break
            cached = self._cached_prefix(req)
            if self._waits_for_publish(req, plan, cached):
                continue
            rest = req.num_uncomputed - cached
            # others waiting share a stretch of this prompt: it offers that stretch first
            split = self._offer_point(req, cached, cached)
            cap = split - cached if split is not None else rest
            n = self.policy.grant(
                draft,
                min(rest, budget, self._chunk_cap(req), cap),
                req.num_computed + cached,
                rest,
            )
            behind = len(queue) - i - 1
            if n < 1 or not self.cost.joins(draft, n, req.num_computed + cached, behind):
                break
            held = req.num_computed
            free = self._free() - self._unread(req, cached)  # what it reads stays
            if free - held - n < self.cfg.kv_watermark or held + n > free:
                kv_blocked = True
                break
            need = rest + self.growth.cells(req.max_tokens - len(req.output_ids))
            if self.running and free - committed - held - need < self.cfg.kv_watermark:
                kv_blocked = True
                break
            committed += need - n
            self.waiting.remove(req)
            req.split_at = split
            self._note_kv_wait(req, now)
            req.seq_id = self.pool.open()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            starts.append(SeqStart(req.seq_id, req.params, list(req.output_ids)))
            if req.swap_key is not None:  # it leaves the swap space once restored
                swap_in.append((req.swap_key, req.seq_id))
            if self._looks_up(req):
                self._prefix_query += req.num_prompt
                self._prefix_hit += cached
            if cached:
                self._read_prefix(req)
            self._make_room(held + n)
            self.pool.grow(req.seq_id, held + n)
            plan[req.req_id] = (req, n)
            draft.chunks.append((n, req.num_computed))
            draft.finishing += n == rest
            budget -= n
        self._kv_blocked(kv_blocked, now)

        batch = StepBatch(
            [], starts, self._released, self._swap_out, swap_in, self._swap_drop,
            self._retained, self._kv_ops,
        )  # fmt: skip
        out = SchedulerOutput(batch, num_preempted=preempted)
        draft.chunks = []
        self._released, self._swap_out, self._swap_drop = [], [], []
        self._retained, self._kv_ops = [], []
        self._unhold_ready, self._unhold_after = self._unhold_after, []
        for req, n in plan.values():
            assert req.seq_id is not None
            pos0 = req.num_computed
            sample = pos0 + n == req.num_tokens and req.max_tokens > 0
            chunk = SeqChunk(
                req.seq_id, req.tokens_from(pos0, n), pos0, sample, req.targets(pos0, n)
            )
            out.batch.chunks.append(chunk)
            out.reqs.append(req)
            if not (n == 1 and req.output_ids and pos0 + 1 == req.num_tokens):
                draft.chunks.append((n, pos0))
        self._draft = draft
        assert out.batch.num_tokens <= self.cfg.max_num_batched_tokens, "step over budget"
        self.pool.sanity_checks()
        self.swap.sanity_checks()
        if self.prefix is not None:
            self.prefix.sanity_checks()
            assert self.pool.cached == self.prefix.cells, "cache cells drifted"
        return out

    # ---- prefix cache ----------------------------------------------------------------
    def _free(self) -> int:
        """Cells free now or once the unread part of the prefix cache is evicted: the cache
        never keeps out a request that would fit without it."""
        return self.pool.free + (self.prefix.evictable if self.prefix is not None else 0)

    def _looks_up(self, req: Request) -> bool:
        """A new request (not one resuming) that may read the cache."""
        return (
            self.prefix is not None and req.cache_prompt and req.num_computed == 0
            and req.swap_key is None
        )  # fmt: skip

    def _cached_prefix(self, req: Request) -> int:
        """How much of a new request's prompt it can read from the cache (one token is
        always left to compute: its logits give the first output token)."""
        if self.prefix is None or not self._looks_up(req):
            return 0
        return self.prefix.readable(req.prompt_ids, req.num_prompt - 1)

    def _unread(self, req: Request, cached: int) -> int:
        """Of the `cached` prefix `req` would read, the cells nobody reads yet: evictable
        now (room in `_free`), not once `req` reads them."""
        if not cached:
            return 0
        assert self.prefix is not None
        return self.prefix.unlocked(req.prompt_ids, cached)

    def _read_prefix(self, req: Request) -> None:
        assert self.prefix is not None and req.seq_id is not None
        lease, ops = self.prefix.acquire(req.prompt_ids, req.seq_id, req.num_prompt - 1)
        req.lease, req.shared, req.num_computed = lease, lease.length, lease.length
        req.num_cached = lease.length
        self._note_ops(ops)

    # A waiting request shares at least this many tokens it cannot read yet with a prompt
    # being computed: it waits for that prompt to be offered to the cache (below).
    SHARE_MIN = 64

    def _waits_for_publish(
        self, req: Request, plan: dict[str, tuple[Request, int]], have: int
    ) -> bool:
        """Should `req` wait for a running request that is computing a stretch of its
        prompt? That request offers what it computed to the cache at its next *offer
        point* (`_publish`), and `req` then computes only the rest: a burst of requests
        behind one system prompt, or the `n` choices of one request, compute the shared
        part once (SGLang does the same within a batch). The offer point is where the
        stretch shared with those waiting ends (`_offer_point`), so `req` neither waits for
        the rest of a longer prompt nor, with a sliding window (where a read must end at
        an offer point), misses the shared part. A stretch that request will not offer
        (it decodes already, or computed past it) is no reason to wait.
        `have`: what `req` can read from the cache already."""
        if self.prefix is None or not self._looks_up(req):
            return False
        for r in self.running:
            if not self._may_offer(r):
                continue
            c = self._shares(req, r.prompt_ids, req.num_prompt - 1, have)
            if c is None:
                continue
            end = r.num_computed + (plan[r.req_id][1] if r.req_id in plan else 0)
            point = r.split_at if r.split_at is not None else r.num_prompt
            if end <= point and (point <= c or not self.prefix.window):
                return True
        return False

    def _may_offer(self, req: Request) -> bool:
        """`req` is computing a prompt it will offer to the cache (in full or in part)."""
        return (
            self.prefix is not None and req.cache_prompt and not req.published
            and not req.output_ids and req.swap_key is None
        )  # fmt: skip

    def _shares(self, req: Request, other: list[int], limit: int, have: int) -> int | None:
        """How much of `req`'s prompt (at most `limit`) `other` starts with, if that is
        worth waiting for: `SHARE_MIN` tokens beyond `have`, or any for the very same
        prompt (the `n` choices of one request)."""
        need = have + (1 if other == req.prompt_ids else self.SHARE_MIN)
        if min(limit, len(other)) < need or other[need - 1] != req.prompt_ids[need - 1]:
            return None  # (the quick test: most prompts part early)
        c = common_prefix(req.prompt_ids, other, limit)
        return c if c >= need else None

    def _offer_point(self, req: Request, start: int, have: int) -> int | None:
        """Where `req`, computing its prompt from `start`, should next offer it to the
        cache short of its end: where the shortest stretch a waiting request shares with
        it (`_shares`, beyond the `have` it read from the cache) ends. With a sliding
        window also its own `offer_at` (a chat's system block end), so that requests
        behind the same system prompt that come later, when this one has finished, can
        read it: a read must end at a point offered. None when there is no such point.
        Asked afresh at every chunk: requests come and go."""
        if not self._may_offer(req):
            return None
        assert self.prefix is not None
        best = None
        if self.prefix.window and max(start, have) < req.offer_at < req.num_prompt:
            best = req.offer_at
        for w in self.waiting:
            if w is req or not self._looks_up(w):
                continue
            c = self._shares(w, req.prompt_ids, w.num_prompt - 1, have)
            if c is not None and start < c < req.num_prompt and (best is None or c < best):
                best = c
        return best

    def _until_split(self, req: Request) -> int:
        """Tokens `req` may compute before the point it offers its prompt at."""
        if req.split_at is not None and req.num_computed < req.split_at:
            return req.split_at - req.num_computed
        return self.cfg.max_num_batched_tokens

    def _publish(self, req: Request) -> None:
        """`req` computed its prompt, or the stretch others wait for (`split_at`): a fresh
        holder tags the same cells as a cache leaf, so requests arriving while it decodes
        (or computes on) read them. Past the prompt but its last token, it offers no more."""
        assert self.prefix is not None and req.seq_id is not None
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
                ids.append(self.pool.open())
                return ids[-1]

            out = self.prefix.publish(tokens, req.seq_id, lease, new_id)
            if out is not None:
                new_lease, given_up, ops = out
                self.pool.shrink(req.seq_id, n - lease.length)
                self.pool.hold(ids[0], n - lease.length - given_up)
                req.lease, req.shared = new_lease, n
                self._note_ops(ops)
                # a pin from an offer that failed earlier may tag cells it just gave up
                self._drop_pin(req)
                return
        # It cannot be offered now (with a window: the cache holds more of it than it read,
        # in no intact copy). A pin keeps its last window for when the request finishes and
        # its path joins the cache (`_keep_as_cache`).
        if (
            self.prefix.window
            and req.pin is None
            and self.prefix.match(tokens) > lease.length
            and self._num_holders < self.cfg.max_cached_seqs
            and (self.pool.num_free_seqs > self.cfg.max_num_seqs - len(self.running))
        ):  # (a free id: a pin that may come to nothing evicts nothing)
            pin = self.pool.open()
            self.pool.hold(pin, 0)
            req.pin = (pin, n)
            self._kv_ops.append(Share(req.seq_id, pin, self.prefix.reach(n), n))

    @property
    def _num_holders(self) -> int:
        """Sequence ids holding the cache, not counting those whose release is under way."""
        return self.pool.num_held - len(self._unhold_after) - len(self._unhold_ready)

    def _holder_room(self) -> bool:
        """Make room for one more holder (`_free_an_id`), keeping an id for every request
        that may still be admitted; False if there is none."""
        assert self.prefix is not None
        while self._num_holders >= self.cfg.max_cached_seqs:
            if not self._free_an_id():
                return False
        # ids whose release is under way are free from the next step: for admissions,
        # which may wait a step, they count; the holder needs one free now
        pending = len(self._unhold_after) + len(self._unhold_ready)
        free = self.pool.num_free_seqs
        return free >= 1 and free - 1 + pending >= self.cfg.max_num_seqs - len(self.running)

    def _free_an_id(self) -> bool:
        """Give up the least useful holder id: a pin inside a path first (it only keeps
        reads ending exactly there possible, e.g. at an older turn), then a leaf."""
        assert self.prefix is not None
        ops = self.prefix.unpin()
        if ops:
            self._note_ops(ops)
            return True
        return self._evict(1)

    def _evict(self, cells: int) -> bool:
        assert self.prefix is not None
        freed, ops = self.prefix.evict(cells)
        self.pool.cache(-freed)
        self._prefix_evicted += freed
        self._note_ops(ops)
        return bool(ops)

    def _make_room(self, n: int) -> None:
        """Evict cached prefixes nobody reads until `n` cells are free (or none is left)."""
        if self.prefix is not None and self.pool.free < n:
            self._evict(n - self.pool.free)

    def _note_ops(self, ops: list[KVOp]) -> None:
        self._kv_ops += ops
        self._unhold_after += [op.seq for op in ops if isinstance(op, Release)]

    def _drop_pin(self, req: Request) -> None:
        if req.pin is not None:
            self._note_ops([Release(req.pin[0])])
            req.pin = None

    def _drop_lease(self, req: Request) -> None:
        if req.lease is not None:
            assert self.prefix is not None
            self.prefix.release(req.lease)
        req.lease, req.shared = None, 0

    def _keep_as_cache(self, req: Request) -> None:
        """A finished request's KV joins the cache: what is new becomes a leaf its sequence
        holds; what the cache had already is given up (the ops say which)."""
        assert self.prefix is not None and req.seq_id is not None
        tokens = req.tokens_from(0, req.num_computed)
        # Its pin keeps the window before the end of its prompt; once its path is cached the
        # pin is made to tag that path's cells there (the cache's own where it takes them),
        # which must then be intact: else the pin goes.
        pin, req.pin = req.pin, None
        keep = None
        if pin is not None and self.prefix.keeps(tokens, req.shared, self.prefix.reach(pin[1])):
            keep = self.prefix.reach(pin[1])
        given_up, ops = self.prefix.insert(tokens, req.seq_id, req.shared, keep)
        if pin is not None:
            kept = keep is not None and not any(
                isinstance(op, Release) and op.seq == req.seq_id for op in ops
            )
            if kept and self.prefix.pin(req.prompt_ids[: pin[1]], pin[0]):
                ops += [Trim(pin[0], 0, -1), Share(req.seq_id, pin[0], keep or 0, pin[1])]
            else:
                ops.append(Release(pin[0]))
        new = req.num_computed - req.shared - given_up
        self._drop_lease(req)
        self.pool.hold(req.seq_id, new)
        if not any(isinstance(op, Release) and op.seq == req.seq_id for op in ops):
            self._retained.append(req.seq_id)
        self._note_ops(ops)
        req.seq_id = None
        while self._num_holders > self.cfg.max_cached_seqs and self._free_an_id():
            pass

    def _note_kv_wait(self, req: Request, now: float) -> None:
        """A request leaves the queue: count the time KV kept it out."""
        since = self._kv_blocked_since
        if since is not None:
            joined = req.arrival_time if req.queued_time is None else req.queued_time
            req.kv_wait_s += max(0.0, now - max(since, joined))

    def _kv_blocked(self, blocked: bool, now: float) -> None:
        """The queue's head was (or was no longer) kept out by KV: everyone queued behind
        it waits for KV too, so on the change each request's share is counted."""
        if blocked and self._kv_blocked_since is None:
            self._kv_blocked_since = now
        elif not blocked and self._kv_blocked_since is not None:
            for req in self.waiting:
                self._note_kv_wait(req, now)
            self._kv_blocked_since = None

    def _short_of_kv(self, committed: int) -> bool:
        """KV pressure: the waiting requests need more cells than are left beside what the
        running will still take (the unread prefix cache counts as room: it gives way).
        What a waiting request would read from the cache it does not need again; the cells
        it would read that nobody reads yet stop being room then (counted once: requests
        behind one system prompt read the same cells)."""
        room, read = self._free() - committed, 0
        for req in self.waiting:
            cached = self._cached_prefix(req)
            read = max(read, self._unread(req, cached))
            room -= req.num_tokens - cached
            room -= self.growth.cells(req.max_tokens - len(req.output_ids))
            if room - read < 0:
                return True
        return False

    def _committed(self) -> int:
        """Cells the running requests will still take beyond what they hold: the rest of
        their prompts and their expected growth."""
        total = 0
        for r in self.running:
            assert r.seq_id is not None
            total += max(0, r.num_tokens - r.shared - self.pool.cells(r.seq_id))
            total += self.growth.cells(r.max_tokens - len(r.output_ids))
        return total

    def _chunk_cap(self, req: Request) -> int:
        cap = self.cfg.max_prefill_chunk or self.cfg.max_num_batched_tokens
        return min(cap, self.cfg.prompt_logprob_rows) if req.scores_prompt else cap

    def _reserve(
        self, req: Request, n: int, plan: dict[str, tuple[Request, int]]
    ) -> tuple[bool, int]:
        """Grow `req` by `n` cells, preempting the newest running requests if the pool is full.

        Returns (reserved, number preempted); `req` itself may be the one preempted.
        """
        preempted = 0
        self._make_room(n)
        while self.pool.free < n:
            self.growth.preempted()
            # the least work lost: the fewest computed tokens, the newest among equals
            victim = min(reversed(self.running), key=lambda r: r.num_computed)
            plan.pop(victim.req_id, None)
            self._preempt(victim)
            preempted += 1
            if victim is req:
                return False, preempted
        assert req.seq_id is not None
        self.pool.grow(req.seq_id, n)
        return True, preempted

    def _preempt(self, req: Request) -> None:
        """Free its KV and put it first in line. Its KV goes to host RAM when that is
        cheaper than computing it again (`_swap_is_cheaper`); else it recomputes prompt +
        output on resume."""
        assert req.seq_id is not None
        self._drop_lease(req)  # a swap saves the prefix it read too: it comes back its own
        self._drop_pin(req)
        if self._swap_is_cheaper(req.num_computed):
            key = self.swap.take(req.num_computed)
            self._swap_out.append((req.seq_id, key))
            self._swapped[key] = req
            req.swap_key = key
            self._num_swapped_out += 1
        else:
            self._recomputed += req.num_computed
            req.num_computed = 0
        self._release_seq(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.queued_time = self._now
        req.num_preemptions += 1
        self._num_preempted += 1
        self.waiting.appendleft(req)

    def _swap_is_cheaper(self, cells: int) -> bool:
        """Swap a victim's `cells` out and back in, or recompute them? By the two cost
        models: the copy rate learned from swaps, the prefill time learned from steps (in
        full-budget chunks, as a resumed prompt runs alone at best). Before any prompt
        step was measured, swap: it keeps the work. No room in the swap space: recompute."""
        if not self.swap.fits(cells):
            return False
        if not self.cost.knows_prompts:
            return True
        b = self.cfg.max_num_batched_tokens
        redo = sum(self.cost.chunk_time(min(b, cells - d), d) for d in range(0, cells, b))
        return self.swap_cost.seconds(cells) < redo

    def _unswap(self, req: Request) -> None:
        """Its KV left the swap space (restored, dropped, or lost)."""
        assert req.swap_key is not None
        self.swap.give(req.swap_key)
        del self._swapped[req.swap_key]
        req.swap_key = None

    def _swaps_done(self, out: SchedulerOutput, lost: list[int]) -> None:
        """The step's swaps ran: restored sequences leave the swap space; one the engine
        could not save or restore recomputes."""
        for key in lost:
            self._swap_lost(key)
        for key, _ in out.batch.swap_in:
            req = self._swapped.get(key)
            if req is not None:
                self._unswap(req)

    def _swap_lost(self, key: int) -> None:
        req = self._swapped.get(key)
        if req is None:
            return
        self._unswap(req)
        if req.status is RequestStatus.RUNNING:  # its restore failed: queue it again
            self._release_seq(req)
            self.running.remove(req)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        self._recomputed += req.num_computed
        req.num_computed = 0

    def rollback_kv_full(self, out: SchedulerOutput) -> None:
        """The backend found no KV slot despite our accounting (llama.cpp left its cache as
        before the call): undo the step's reservations and preempt the newest request."""
        self._swaps_done(out, [])  # restores ran before the decode that failed
        for req, chunk in zip(out.reqs, out.batch.chunks, strict=True):
            if req.seq_id is not None:
                self.pool.shrink(req.seq_id, len(chunk.tokens))
        if self.running:
            self._preempt(self.running[-1])
        self._kv_backoff = True

    def _release_seq(self, req: Request) -> None:
        if req.seq_id is not None:
            self.pool.close(req.seq_id)
            self._released.append(req.seq_id)
            req.seq_id = None

    def stop(self, req_id: str, now: float) -> None:
        """Its text reached a stop string (scheduler.output): it ends as stopped — its KV
        kept for the prefix cache, like any finished request — before the next step."""
        req = self._by_id.get(req_id)
        if req is None:
            return
        if req.status is RequestStatus.WAITING:  # preempted: nothing runs it now
            self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_STOPPED, now, self._finished)
        else:
            self._stops.add(req_id)

    def _apply_aborts(self, now: float) -> None:
        for ids, status in ((self._aborts, RequestStatus.FINISHED_ABORTED),
                            (self._stops, RequestStatus.FINISHED_STOPPED)):  # fmt: skip
            for req_id in ids:
                req = self._by_id.get(req_id)
                if req is None or req.status.is_finished:
                    continue
                if req.status is RequestStatus.WAITING:
                    self.waiting.remove(req)
                self._finish(req, status, now, self._finished)
            ids.clear()

    def _finish(
        self, req: Request, status: RequestStatus, now: float, into: list[FinishedStats]
    ) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._kv_backoff = False
        if req.swap_key is not None:
            if req.status is RequestStatus.WAITING:  # else its restore was already sent
                self._swap_drop.append(req.swap_key)
            self._unswap(req)
        if req.status is RequestStatus.WAITING:
            self._note_kv_wait(req, now)
        keep = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if keep and self.prefix is not None and req.seq_id is not None and req.cache_prompt:
            self._keep_as_cache(req)
        else:
            self._drop_lease(req)
            self._drop_pin(req)
            self._release_seq(req)
        req.status = status
        del self._by_id[req.req_id]
        started = req.first_scheduled_time
        into.append(
            FinishedStats(
                finish_reason=status.finish_reason or "",
                num_prompt_tokens=req.num_prompt,
                num_output_tokens=len(req.output_ids),
                e2e_s=now - req.arrival_time,
                max_gap_s=req.max_gap_s if len(req.output_ids) > 1 else None,
                queue_s=None if started is None else started - req.arrival_time,
                kv_wait_s=req.kv_wait_s,
                req_id=req.req_id,
            )
        )

    # ---- postprocess -----------------------------------------------------------------
    def postprocess(
        self, out: SchedulerOutput, result: StepResult, now: float
    ) -> tuple[list[RequestOutput], StepStats]:
        """The one loop over a step's outputs: advance, append, finish by token."""
        self._swaps_done(out, result.swap_out_failed + result.swap_in_failed)
        self.swap_cost.observe(result.swap_out_bytes, result.swap_out_s)
        self.swap_cost.observe(result.swap_in_bytes, result.swap_in_s)
        engine_s = result.fill_s + result.decode_s + result.sample_s
        step = self._draft
        bounded = self.policy.bounded(step) and bool(step.chunks)
        planned_s = self.cost.step_time(step) if bounded else 0.0
        if not result.prompt_logprobs:  # (a scored prompt's extra call is not prompt cost)
            self.policy.observe(step, engine_s)
        stats = StepStats(
            num_step_tokens=out.batch.num_tokens,
            num_step_prompt_tokens=sum(n for n, _ in step.chunks),
            step_shape=(step.n_decode, list(step.chunks)),
            # (the default target is soft: its steps may run longer to prefill efficiently)
            stall_target_s=self.cfg.max_stall_s if bounded and not self.cfg.stall_auto else None,
            modelled_s=planned_s,
            chunk_policy=self.policy.stats(),
            num_step_seqs=len(out.batch.chunks),
            fill_s=result.fill_s,
            decode_s=result.decode_s,
            sample_s=result.sample_s,
            gil_s=result.gil_s,
            mask_wait_s=result.mask_wait_s,
            masks=result.masks,
            mask_s=result.mask_s,
            swap_out_bytes=result.swap_out_bytes,
            swap_in_bytes=result.swap_in_bytes,
            swap_s=result.swap_out_s + result.swap_in_s,
        )
        outputs: list[RequestOutput] = []
        for req, chunk in zip(out.reqs, out.batch.chunks, strict=True):
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed += len(chunk.tokens)
            if chunk.targets:
                self._scored(req, chunk, result.prompt_logprobs[chunk.seq_id])
            if (
                self.prefix is not None and req.cache_prompt
                and (req.num_computed == req.split_at
                     or (not req.published and req.num_computed == req.num_prompt))
            ):  # fmt: skip
                self._publish(req)
            if chunk.sample:
                outputs.append(self._append(req, result.sampled[chunk.seq_id], now, stats))
            elif req.max_tokens == 0 and req.num_computed == req.num_prompt:
                # only the prompt was asked for (echo with logprobs): it is done
                self._finish(req, RequestStatus.FINISHED_LENGTH, now, stats.finished)
                outputs.append(self._output(req, "", [], "length"))
        return outputs, self._close_stats(stats)

    @staticmethod
    def _scored(req: Request, chunk: SeqChunk, scored: list[Sampled]) -> None:
        """Keep the chunk's prompt logprobs not kept already (a recomputed chunk scores
        positions again)."""
        have = req.prompt_logprobs
        for i, s in enumerate(scored):
            if chunk.pos0 + 1 + i == len(have) + 1:
                have.append(s)

    def fail(self, out: SchedulerOutput, now: float) -> tuple[list[RequestOutput], StepStats]:
        """The engine failed this step: end its requests with `error`, keep the rest going."""
        stats = StepStats()
        outputs = []
        for req in out.reqs:
            if req.status is RequestStatus.RUNNING:
                self._finish(req, RequestStatus.FINISHED_ERROR, now, stats.finished)
                outputs.append(self._output(req, "", [], "error"))
        return outputs, self._close_stats(stats)

    def _append(self, req: Request, s: Sampled, now: float, stats: StepStats) -> RequestOutput:
        tok = s.token
        req.output_ids.append(tok)
        stats.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            stats.ttft_s.append(now - req.arrival_time)
            if req.first_scheduled_time is not None:
                stats.queue_s.append(req.first_scheduled_time - req.arrival_time)
            stats.num_prompt_tokens += req.num_prompt
        elif req.last_token_time is not None:
            gap = now - req.last_token_time
            stats.itl_s.append(gap)
            req.max_gap_s = max(req.max_gap_s, gap)
        req.last_token_time = now

        # Ended by its tokens here; by its text (stop strings) in scheduler.output, which
        # then calls `stop`. The text is filled in there.
        status: RequestStatus | None = None
        if req.is_eog(tok):
            status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_ids) >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        logprobs = [s] if req.params.logprobs else []
        if status is not None:
            self._finish(req, status, now, stats.finished)
        return self._output(req, "", [tok], status.finish_reason if status else None, logprobs)

    @staticmethod
    def _output(
        req: Request,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        logprobs: list[Sampled] | None = None,
    ) -> RequestOutput:
        # the prompt's logprobs ride on its first output
        scored = req.params.prompt_logprobs is not None and len(req.output_ids) <= 1
        return RequestOutput(
            req_id=req.req_id,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs or [],
            finish_reason=finish_reason,
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=len(req.output_ids),
            num_cached_tokens=req.num_cached,
            prompt_logprobs=req.prompt_logprobs if scored else None,
        )

    def _close_stats(self, stats: StepStats) -> StepStats:
        stats.finished.extend(self._finished)
        self._finished.clear()
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.kv_used = self.pool.used
        stats.kv_capacity = self.pool.capacity
        stats.kv_reserved = self._committed()
        stats.num_recomputed_tokens, self._recomputed = self._recomputed, 0
        stats.num_preempted, self._num_preempted = self._num_preempted, 0
        stats.num_swapped_out, self._num_swapped_out = self._num_swapped_out, 0
        stats.kv_cached = self.pool.cached
        stats.prefix_query_tokens, self._prefix_query = self._prefix_query, 0
        stats.prefix_hit_tokens, self._prefix_hit = self._prefix_hit, 0
        stats.prefix_evicted_cells, self._prefix_evicted = self._prefix_evicted, 0
        stats.swap_used_cells = self.swap.used
        stats.swap_capacity_cells = self.swap.capacity
        return stats
