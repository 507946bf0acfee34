"""The contract between the scheduler and the engine's one step call.

Plain data, no native code: the scheduler core builds a `StepBatch`, the engine returns a
`StepResult`. Kept free of ctypes so the scheduler can be tested with a fake engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, OpenAI names mapped to llama.cpp samplers."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # constrained output (engine.grammar): the compiled grammar
    # a lazy grammar: it applies from the first time this token is sampled (`tool_choice`
    # auto: the model's own start of a call), the output before it is free
    grammar_trigger: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    min_tokens: int = 0  # end-of-generation tokens are not sampled before this many
    # The prompt's own logprobs (completions echo + logprobs): each prompt token's, with
    # this many most likely alternatives; None: not asked for
    prompt_logprobs: int | None = None

    @property
    def needs_host_row(self) -> bool:
        """Its row is changed before sampling (bias, banned end, mask): never on the device."""
        return bool(self.grammar is not None or self.logit_bias or self.min_tokens)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(slots=True)
class SeqChunk:
    """Tokens of one sequence fed in this step, at consecutive positions from `pos0`."""

    seq_id: int
    tokens: list[int]
    pos0: int
    sample: bool  # sample a next token from the logits of the chunk's last token
    # Prompt logprobs: the tokens that follow the chunk's first len(targets) tokens (the
    # prompt's next ones); the engine returns each one's logprob given what precedes it.
    targets: list[int] | None = None


@dataclass(slots=True)
class SeqStart:
    """A sequence that (re)starts in this step: the engine builds its sampler.

    `history` holds tokens the sequence already generated (after a preemption), so that
    penalty samplers see them again.
    """

    seq_id: int
    params: SamplingParams
    history: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Share:
    """Tag `dst`'s positions [p0, p1) with the cells `src` holds there (llama `seq_cp`:
    metadata only in a unified cache, the cells are read by both)."""

    src: int
    dst: int
    p0: int
    p1: int


@dataclass(frozen=True, slots=True)
class Trim:
    """Untag `seq` from its positions [p0, p1) (llama `seq_rm`; p1 = -1: to the end)."""

    seq: int
    p0: int
    p1: int


@dataclass(frozen=True, slots=True)
class Release:
    """`seq` holds nothing anyone needs: untag all its cells and forget the id."""

    seq: int


KVOp = Share | Trim | Release


@dataclass(slots=True)
class StepBatch:
    """One `llama_decode` call: decode tokens first, then prompt chunks, within n_batch."""

    chunks: list[SeqChunk]
    starts: list[SeqStart] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # seq ids whose KV and sampler to drop
    # KV moved to and from host RAM (preemption that keeps the work, see engine.kv_swap):
    # saved before `released` is applied, restored after `starts`, in this order.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (seq id, swap key)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap key, seq id)
    swap_drop: list[int] = field(default_factory=list)  # swap keys no longer wanted
    # Sequences whose sampler goes but whose KV stays (a finished request kept as cache),
    # and changes to which sequence reads which cells (the prefix index's), applied after
    # `starts` and before swap restores.
    retained: list[int] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)
    # Prompts (all but their last token) a second context prefills beside the steps
    # (engine.side_prefill), by the swap key their KV comes back under: (key, tokens).
    side_prefill: list[tuple[int, list[int]]] = field(default_factory=list)
    # Report the side prefills that ended, though nothing else is to be done (one ended
    # while no step ran: the scheduler's idle loop was woken for it).
    side_poll: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


@dataclass(slots=True)
class Sampled:
    """The token sampled for one sequence, with logprobs when asked for."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class StepResult:
    """What one step produced: a sampled token per sequence that asked for one."""

    sampled: dict[int, Sampled]
    fill_s: float = 0.0  # releases, sampler starts, batch fill
    # per sequence, one per entry of its chunk's `targets`: that token and its logprobs
    prompt_logprobs: dict[int, list[Sampled]] = field(default_factory=dict)
    decode_s: float = 0.0  # time inside llama_decode
    sample_s: float = 0.0  # time sampling and computing logprobs
    gil_s: float = 0.0  # after the native step, waiting for Python's GIL (another thread held it)
    mask_wait_s: float = 0.0  # after decoding, waiting for constrained rows' masks
    masks: int = 0  # token masks computed (constrained sequences) ...
    mask_s: float = 0.0  # ... and their time, on the mask thread
    swap_out_s: float = 0.0  # saving KV to host RAM
    swap_in_s: float = 0.0  # restoring it
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    # Swap keys the engine could not save (their requests recompute) or restore (their
    # chunks were left out of the step; they recompute too).
    swap_out_failed: list[int] = field(default_factory=list)
    swap_in_failed: list[int] = field(default_factory=list)
    # Side prefills that ended since the last step: (swap key, whether its KV is now in
    # the swap store, to be restored like a preempted sequence's; else it recomputes).
    side_done: list[tuple[int, bool]] = field(default_factory=list)
