"""The scheduler's settings: one frozen record the scheduler and the KV manager both read,
kept apart from either so that neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


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
    # The longest prompt (tokens, less its last) a second context may prefill beside the
    # steps where no step carrying it could stay within the stall target (0 = no side
    # context: every prompt is chunked into the steps)
    side_prefill_tokens: int = 0
