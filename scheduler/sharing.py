"""Prompt sharing: where a prompt being computed is offered to the prefix cache short of its
end, and when a waiting request waits for that offer instead of computing the same tokens.

A burst of requests behind one system prompt, or the `n` choices of one request, then
compute the shared part once (SGLang does the same within a batch). This is scheduling
policy — it sizes chunks and holds back admissions — so the scheduler owns it; the offer
itself, and what it does to the cache's books, is the KV manager's (`chunk_ran`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from scheduler.prefix import common_prefix
from scheduler.request import Request

# A waiting request shares at least this many tokens it cannot read yet with a prompt being
# computed: it waits for that prompt to be offered to the cache.
SHARE_MIN = 64


def may_offer(req: Request) -> bool:
    """`req` is computing a prompt it will offer to the cache (in full or in part)."""
    return req.cache_prompt and not req.published and not req.output_ids and req.swap_key is None


def shares(req: Request, other: list[int], limit: int, have: int) -> int | None:
    """How much of `req`'s prompt (at most `limit`) `other` starts with, if that is worth
    waiting for: `SHARE_MIN` tokens beyond `have`, or any for the very same prompt (the
    `n` choices of one request)."""
    need = have + (1 if other == req.prompt_ids else SHARE_MIN)
    if min(limit, len(other)) < need or other[need - 1] != req.prompt_ids[need - 1]:
        return None  # (the quick test: most prompts part early)
    c = common_prefix(req.prompt_ids, other, limit)
    return c if c >= need else None


class PromptSharing:
    """The policy for a server with a prefix cache; `window`: the model's sliding attention
    window (0: none), where a read must end at a point offered."""

    def __init__(self, window: int) -> None:
        self.window = window

    def waits_for_publish(
        self,
        req: Request,
        running: Iterable[Request],
        planned: Mapping[str, tuple[Request, int]],
        have: int,
    ) -> bool:
        """Should `req` wait for a running request that is computing a stretch of its
        prompt? That request offers what it computed to the cache at its next offer point,
        and `req` then computes only the rest. The offer point is where the stretch shared
        with those waiting ends (`offer_point`), so `req` neither waits for the rest of a
        longer prompt nor, with a sliding window, misses the shared part. A stretch that
        request will not offer (it decodes already, or computed past it) is no reason to
        wait. `planned`: this step's chunks by request; `have`: what `req` can read from
        the cache already."""
        if not req.may_read_cache:
            return False
        for r in running:
            if not may_offer(r):
                continue
            c = shares(req, r.prompt_ids, req.num_prompt - 1, have)
            if c is None:
                continue
            end = r.num_computed + (planned[r.req_id][1] if r.req_id in planned else 0)
            point = r.split_at if r.split_at is not None else r.num_prompt
            if end <= point and (point <= c or not self.window):
                return True
        return False

    def offer_point(
        self, req: Request, waiting: Iterable[Request], start: int, have: int
    ) -> int | None:
        """Where `req`, computing its prompt from `start`, should next offer it to the
        cache short of its end: where the shortest stretch a waiting request shares with
        it (`shares`, beyond the `have` it read from the cache) ends. With a sliding window
        also its own `offer_at` (a chat's system block end), so that requests behind the
        same system prompt that come later, when this one has finished, can read it: a
        read must end at a point offered. None when there is no such point. Asked afresh
        at every chunk: requests come and go."""
        if not may_offer(req):
            return None
        best = None
        if self.window and max(start, have) < req.offer_at < req.num_prompt:
            best = req.offer_at
        for w in waiting:
            if w is req or not w.may_read_cache:
                continue
            c = shares(w, req.prompt_ids, w.num_prompt - 1, have)
            if c is not None and start < c < req.num_prompt and (best is None or c < best):
                best = c
        return best
