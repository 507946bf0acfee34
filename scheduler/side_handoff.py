"""New prompts handed to a side context (engine.side_prefill) and back: which prompt goes,
and where it is while it is away.

A new prompt goes where no step that carries it beside the decoders could stay within the
stall target (`ChunkPolicy.beyond_reach`: with every expert of its rows in host RAM).
There it is prefilled in full batches while the decoders' steps go on without it, and
comes back as a swapped-out request, first in the queue. The scheduler core decides when
to ask (`Scheduler._admit_in_order`); the KV manager holds its swap key (`set_aside`,
`aside_ran`).
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.chunk_grant import ChunkGrant
from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.step_cost import StepDraft


class SideHandoff:
    """The requests away at the side context, and whether the next batch polls it."""

    def __init__(self, cfg: SchedulerConfig, chunks: ChunkGrant) -> None:
        self.cfg = cfg
        self.chunks = chunks
        # new requests whose prompt the side context is prefilling: out of the queue until
        # their KV comes back, then first in it as swapped-out requests
        self.requests: dict[str, Request] = {}
        self._poll = False  # a side prefill ended while no step ran (`woke`)

    def wants(self, draft: StepDraft, req: Request, cached: int) -> bool:
        """Whether `req` goes aside rather than into `draft`'s step. Not a prompt that reads
        much of the prefix cache (the side context has none: it would compute what is
        cached), nor one whose own logprobs are asked for (scored in the steps), nor one
        longer than that context or shorter than a minimum chunk (under 32 rows its
        experts run on the CPU's threads, which the side context leaves to the
        decoders)."""
        rest = req.num_prompt - 1
        return (
            max(1, self.cfg.min_prefill_chunk) <= rest <= self.cfg.side_prefill_tokens
            and 4 * cached <= req.num_prompt
            and req.num_computed == 0 and req.swap_key is None
            and not (req.scores_prompt or req.side_failed)
            and self.chunks.policy.beyond_reach(draft, rest)
        )  # fmt: skip

    def hold(self, req: Request, now: float) -> None:
        """`req` left the queue for the side context (its swap key is held)."""
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.requests[req.req_id] = req

    def release(self, req: Request) -> bool:
        """`req` leaves the side context's hands (aborted or stopped); False if it was not
        there."""
        return self.requests.pop(req.req_id, None) is not None

    def returned(self, reqs: Iterable[Request], now: float) -> list[Request]:
        """The requests whose side prefill came back, queued again as of `now`."""
        back = []
        for req in reqs:
            del self.requests[req.req_id]
            req.queued_time = now
            back.append(req)
        return back

    def woke(self) -> None:
        """A side prefill ended (the engine's side thread says so, under the loop's lock):
        the next batch asks for it even if nothing else is to be done."""
        self._poll = True

    def take_poll(self) -> bool:
        """Whether the batch being assembled polls the side context (once per wake)."""
        poll = self._poll and bool(self.requests)
        self._poll = False
        return poll
