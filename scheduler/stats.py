"""What the scheduler reports after each step; only api.server.metrics turns it into
Prometheus."""

from __future__ import annotations

from dataclasses import dataclass, field

FAST = "fast"  # the shared lane's name; other lanes are named by whoever adds them


@dataclass(slots=True)
class FinishedStats:
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    e2e_s: float
    queue_s: float | None  # None when it never got scheduled
    max_gap_s: float | None = None  # longest gap between two of its tokens
    kv_wait_s: float = 0.0  # time it waited in the queue while KV kept it out
    req_id: str = ""


@dataclass(slots=True)
class StepStats:
    """One step's figures, plus the pool and queue state after it."""

    lane: str = FAST  # which lane stepped (scheduler.loop)
    num_running: int = 0
    num_waiting: int = 0
    kv_used: int = 0
    kv_capacity: int = 0
    kv_reserved: int = 0  # cells the running will still take: prompts' rest, expected growth
    num_step_tokens: int = 0
    num_step_seqs: int = 0
    num_step_prompt_tokens: int = 0  # prompt-chunk tokens in this step
    aside_prompt_tokens: int = 0  # prompt tokens a side context prefilled, back this step
    num_prompt_tokens: int = 0  # prompt tokens whose prefill completed in this step
    num_generated_tokens: int = 0
    num_preempted: int = 0  # requests preempted, all kinds
    num_swapped_out: int = 0  # of which their KV went to host RAM (the rest recompute)
    num_recomputed_tokens: int = 0  # computed tokens preemption threw away (to compute again)
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_s: float = 0.0  # engine time copying KV to and from host RAM
    prefix_query_tokens: int = 0  # prompt tokens of requests that looked up the cache
    prefix_hit_tokens: int = 0  # of which read from it
    prefix_evicted_cells: int = 0  # cached cells given back to the pool
    kv_cached: int = 0  # of `kv_used`, cells of the prefix cache (read by none or many)
    swap_used_cells: int = 0  # cells held in host RAM after the step
    swap_capacity_cells: int = 0
    schedule_s: float = 0.0  # schedule(): which tokens go in
    fill_s: float = 0.0  # engine: releases, sampler starts, batch fill
    decode_s: float = 0.0  # inside llama_decode
    sample_s: float = 0.0  # sampling + logprobs in the engine
    gil_s: float = 0.0  # engine thread waiting for the GIL after its native step
    mask_wait_s: float = 0.0  # engine: after decoding, waiting for constrained rows' masks
    masks: int = 0  # token masks computed for constrained sequences ...
    mask_s: float = 0.0  # ... and the time that took, on the mask thread
    postprocess_s: float = 0.0  # append, detokenize, stops, finish, hand each stream its delta
    step_s: float = 0.0  # whole step as the loop saw it (schedule → fan-out)
    ttft_s: list[float] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    finished: list[FinishedStats] = field(default_factory=list)
    # the step as the chunk policy saw it: (decode tokens, prompt chunks as (tokens, depth))
    step_shape: tuple[int, list[tuple[int, int]]] = (0, [])
    stall_target_s: float | None = None  # the target it was held to (None: not bounded)
    modelled_s: float = 0.0  # what the cost model expected of it (when bounded)
    chunk_policy: dict[str, float] = field(default_factory=dict)  # its figures (/metrics)
