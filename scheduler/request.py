"""A request's state as the scheduler sees it, and what it streams back."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.detok import IncrementalDetokenizer
from engine.step_types import Sampled, SamplingParams
from scheduler.prefix import Lease
from scheduler.stops import StopMatcher

# The finish_reason of a stream the server ended because it is shutting down (the drain
# window passed): the API turns it into an error event, never a finish.
SHUTDOWN = "shutdown"


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _REASONS.get(self)


_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class Request:
    """One sequence to generate. `num_computed` counts tokens of prompt + output in KV.

    There are no prefill/decode phases: each step catches `num_computed` up with
    `num_tokens` under the step's budget, so a long prompt is simply several chunks and a
    decoding request has exactly one uncomputed token (the one it sampled last).
    """

    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    detok: IncrementalDetokenizer
    stops: StopMatcher
    is_eog: Callable[[int], bool]
    client: str = ""  # who sent it (API key, else connection): the queue's fairness unit
    status: RequestStatus = RequestStatus.WAITING
    seq_id: int | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_preemptions: int = 0
    swap_key: int | None = None  # its KV waits in host RAM under this key (preempted)
    side_failed: bool = False  # a side context could not prefill its prompt: in place then
    lease: Lease | None = None  # the cached prefix it reads (prefix cache)
    shared: int = 0  # its first positions read from the cache, not its own cells
    cache_prompt: bool = True  # may read and feed the prefix cache
    num_cached: int = 0  # prompt tokens it read from the cache instead of computing them
    published: bool = False  # its prompt was offered to the cache while it runs
    split_at: int | None = None  # it offers its first `split_at` tokens, for others waiting
    offer_at: int = 0  # a point its prompt is offered at with a window (a system block's end)
    pin: tuple[int, int] | None = None  # (seq id, end): it keeps the window before `end`
    queued_time: float | None = None  # when it last joined the queue (None: at arrival)
    kv_wait_s: float = 0.0  # time it waited in the queue while KV kept it out
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    max_gap_s: float = 0.0  # longest wait between two of its tokens (the stall it saw)
    # params.prompt_logprobs: prompt tokens 1, 2, ... scored so far, in order
    prompt_logprobs: list[Sampled] = field(default_factory=list)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def scores_prompt(self) -> bool:
        """It wants the prompt's own logprobs and some are still to come."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt - 1
        )

    def targets(self, pos0: int, n: int) -> list[int] | None:
        """For a chunk of `n` tokens from `pos0`: the prompt tokens its rows score (each
        row the next token's), None when it adds none not scored already."""
        end = min(pos0 + n, self.num_prompt - 1)
        if self.params.prompt_logprobs is None or end <= len(self.prompt_logprobs):
            return None
        return self.prompt_ids[pos0 + 1 : end + 1]

    @property
    def may_read_cache(self) -> bool:
        """A new request, or one preempted to recompute (not one resuming its own KV),
        that may read the prefix cache."""
        return self.cache_prompt and self.num_computed == 0 and self.swap_key is None

    @property
    def is_decoding(self) -> bool:
        """Prompt done; only the last sampled token is waiting to be fed."""
        return bool(self.output_ids) and self.num_uncomputed == 1

    def tokens_from(self, start: int, n: int) -> list[int]:
        p = self.num_prompt
        if start + n <= p:
            return self.prompt_ids[start : start + n]
        if start >= p:  # decoding: never copy the whole history per step
            return self.output_ids[start - p : start - p + n]
        return self.prompt_ids[start:] + self.output_ids[: start + n - p]


@dataclass(slots=True)
class RequestOutput:
    """What one step adds to one request's stream."""

    req_id: str
    text: str
    token_ids: list[int]
    logprobs: list[Sampled]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # of the prompt tokens, those read from the prefix cache
    # the prompt's own logprobs (tokens 1.. of it), on the request's first output
    prompt_logprobs: list[Sampled] | None = None
    stop_string: str | None = None  # on the last output: the stop string that ended it
