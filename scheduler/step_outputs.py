"""What a step's results mean for each request and for the step's figures: its sampled token
appended (with the timings a user sees: first token, gaps), its prompt's logprobs kept,
the `RequestOutput` it streams, and the figures of the step and of a finished request.

Pure functions of a request and the engine's result, apart from the scheduler's queues:
the scheduler decides when a request ends, these say what it got.
"""

from __future__ import annotations

from engine.step_types import Sampled, SeqChunk, StepBatch, StepResult
from scheduler.request import Request, RequestOutput, RequestStatus
from scheduler.stats import FinishedStats, StepStats
from scheduler.step_cost import StepDraft


def step_stats(
    batch: StepBatch, result: StepResult, step: StepDraft, target_s: float | None
) -> StepStats:
    """The step's figures as planned (`step`, the stall target it was held to, if any)
    and as the engine ran it."""
    return StepStats(
        num_step_tokens=batch.num_tokens,
        num_step_prompt_tokens=sum(n for n, _ in step.chunks),
        step_shape=(step.n_decode, list(step.chunks)),
        stall_target_s=target_s,
        num_step_seqs=len(batch.chunks),
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


def keep_scored(req: Request, chunk: SeqChunk, scored: list[Sampled]) -> None:
    """Keep the chunk's prompt logprobs not kept already (a recomputed chunk scores
    positions again)."""
    have = req.prompt_logprobs
    for i, s in enumerate(scored):
        if chunk.pos0 + 1 + i == len(have) + 1:
            have.append(s)


def take_token(req: Request, s: Sampled, now: float, stats: StepStats) -> RequestStatus | None:
    """Append a sampled token and count its timings; the status it ends `req` with, if
    any. Ended by its tokens here; by its text (stop strings) in scheduler.output, which
    then calls `Scheduler.stop`."""
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
    if req.is_eog(tok):
        return RequestStatus.FINISHED_STOPPED
    if len(req.output_ids) >= req.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def request_output(
    req: Request,
    token_ids: list[int],
    finish_reason: str | None,
    logprobs: list[Sampled] | None = None,
) -> RequestOutput:
    """What `req` streams for this step (its text is filled in by scheduler.output)."""
    # the prompt's logprobs ride on its first output
    scored = req.params.prompt_logprobs is not None and len(req.output_ids) <= 1
    return RequestOutput(
        req_id=req.req_id,
        text="",
        token_ids=token_ids,
        logprobs=logprobs or [],
        finish_reason=finish_reason,
        num_prompt_tokens=req.num_prompt,
        num_output_tokens=len(req.output_ids),
        num_cached_tokens=req.num_cached,
        prompt_logprobs=req.prompt_logprobs if scored else None,
    )


def finished_stats(req: Request, status: RequestStatus, now: float) -> FinishedStats:
    started = req.first_scheduled_time
    return FinishedStats(
        finish_reason=status.finish_reason or "",
        num_prompt_tokens=req.num_prompt,
        num_output_tokens=len(req.output_ids),
        e2e_s=now - req.arrival_time,
        max_gap_s=req.max_gap_s if len(req.output_ids) > 1 else None,
        queue_s=None if started is None else started - req.arrival_time,
        kv_wait_s=req.kv_wait_s,
        req_id=req.req_id,
    )
