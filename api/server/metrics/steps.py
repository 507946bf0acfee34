"""What the engine's steps do and take: steps and their time by lane, the prompt tokens
computed (beside the steps too), and for the fast lane's shared steps their shape, their
time by phase (and for pure decode steps apart: what llama-batched-bench's S_TG times),
grammar masks and the scheduler's learned step-time model."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from api.server.metrics.families import SEQS, STEP, TOKENS, ByLane
from scheduler.stats import FAST, StepStats

PHASES = ("schedule", "fill", "decode", "mask_wait", "sample", "gil", "postprocess", "other")


class StepMetrics:
    def __init__(self, r: CollectorRegistry, lane_counter: ByLane) -> None:
        self.lane_steps = lane_counter("onegpu_lane_steps", "Engine steps run, by lane")
        self.lane_step_time = lane_counter("onegpu_lane_step_seconds", "Engine step time, by lane")
        self.prefill_tokens = Counter(
            "onegpu_prefill_tokens",
            "Prompt tokens computed (not read from the prefix cache; recomputation included)",
            registry=r,
        )
        self.side_prefill_tokens = Counter(
            "onegpu_side_prefill_tokens",
            "Of the prompt tokens computed, those a second context prefilled beside the "
            "decoders' steps (--side-prefill-ctx), counted when their KV came back",
            registry=r,
        )  # fmt: skip
        self.step_tokens = Histogram(
            "onegpu_step_tokens", "Tokens submitted per step", buckets=TOKENS, registry=r
        )
        self.step_prompt_tokens = Histogram(
            "onegpu_step_prompt_tokens", "Prompt-chunk tokens per step (steps with any)",
            buckets=TOKENS, registry=r,
        )  # fmt: skip
        self.cost_model = Gauge(
            "onegpu_cost_model_seconds",
            "The scheduler's learned step-time model: decode_step_s + decode_token_s * D + "
            "decode_kv_cell_s * the KV cells decoders attend; per prompt token prompt_token_s "
            "+ prompt_token_per_kv_cell_s * KV depth; per chunk prompt_chunk_per_kv_cell_s * "
            "the KV span it attends over; per physical batch carrying a prompt prompt_batch_s",
            ["term"], registry=r,
        )  # fmt: skip
        self.cost_bias = Gauge(
            "onegpu_cost_model_bias",
            "The stall policy's correction: measured / modelled time of recent steps it "
            "planned; chunks are sized for --max-stall-ms divided by it",
            registry=r,
        )
        self.cost_headroom = Gauge(
            "onegpu_cost_model_headroom",
            "The share of --max-stall-ms a step is planned to beyond the correction: room "
            "for the 99.5th percentile of how far recent steps landed from their plan",
            registry=r,
        )
        self.step_seqs = Histogram(
            "onegpu_step_sequences", "Sequences sharing one step", buckets=SEQS, registry=r
        )
        self.step_time = Histogram(
            "onegpu_step_duration_seconds", "Whole step: schedule, decode, sample, postprocess",
            buckets=STEP, registry=r,
        )  # fmt: skip
        self.decode_time = Histogram(
            "onegpu_step_decode_seconds", "Time inside llama_decode per step", buckets=STEP,
            registry=r,
        )  # fmt: skip
        self.python_time = Histogram(
            "onegpu_step_python_seconds",
            "Per step, time outside llama_decode: batch fill, sampling, detokenization, streaming",
            buckets=STEP, registry=r,
        )  # fmt: skip
        phase_time = Counter(
            "onegpu_step_phase_seconds",
            "Step time by phase: schedule, fill (batch + sampler setup), decode (llama_decode), "
            "mask_wait (after decoding, for constrained sequences' token masks), sample, gil "
            "(the engine thread waiting for Python's GIL after its native step), postprocess "
            "(detokenize, stops, fan-out), other (thread hand-off, waits)",
            ["phase"],
            registry=r,
        )
        self.grammar_masks = Counter(
            "onegpu_grammar_masks", "Token masks computed for constrained sequences",
            registry=r,
        )  # fmt: skip
        self.grammar_mask_time = Counter(
            "onegpu_grammar_mask_seconds",
            "Time computing them (on the mask thread, while the step decodes)",
            registry=r,
        )
        self._phases = {p: phase_time.labels(phase=p) for p in PHASES}
        # The same for steps without prompt tokens only: a pure decode step is what
        # llama-batched-bench's S_TG times, and prompt steps would blur the comparison.
        self.decode_steps = Counter(
            "onegpu_decode_steps", "Steps that carried no prompt tokens", registry=r
        )
        decode_phase_time = Counter(
            "onegpu_decode_step_phase_seconds",
            "onegpu_step_phase_seconds over the steps without prompt tokens only",
            ["phase"],
            registry=r,
        )
        self._decode_phases = {p: decode_phase_time.labels(phase=p) for p in PHASES}

    def observe(self, s: StepStats) -> None:
        if s.num_step_prompt_tokens:
            self.prefill_tokens.inc(s.num_step_prompt_tokens)
        if s.aside_prompt_tokens:
            self.prefill_tokens.inc(s.aside_prompt_tokens)
            self.side_prefill_tokens.inc(s.aside_prompt_tokens)
        if s.num_step_tokens:
            self.lane_steps.labels(lane=s.lane).inc()
            self.lane_step_time.labels(lane=s.lane).inc(s.step_s)
            if s.lane == FAST:
                self._observe_shared_step(s)

    def _observe_shared_step(self, s: StepStats) -> None:
        if s.num_step_prompt_tokens:
            self.step_prompt_tokens.observe(s.num_step_prompt_tokens)
        for term, v in s.chunk_policy.items():
            if term == "correction":
                self.cost_bias.set(v)
            elif term == "headroom":
                self.cost_headroom.set(v)
            else:
                self.cost_model.labels(term=term).set(v)
        self.step_tokens.observe(s.num_step_tokens)
        self.step_seqs.observe(s.num_step_seqs)
        self.step_time.observe(s.step_s)
        self.decode_time.observe(s.decode_s)
        self.python_time.observe(max(0.0, s.step_s - s.decode_s))
        parts = {
            "schedule": s.schedule_s,
            "fill": s.fill_s,
            "decode": s.decode_s,
            "mask_wait": s.mask_wait_s,
            "sample": s.sample_s,
            "gil": s.gil_s,
            "postprocess": s.postprocess_s,
        }
        parts["other"] = max(0.0, s.step_s - sum(parts.values()))
        for phase, v in parts.items():
            self._phases[phase].inc(v)
        if s.masks:
            self.grammar_masks.inc(s.masks)
            self.grammar_mask_time.inc(s.mask_s)
        if s.num_step_prompt_tokens == 0:
            self.decode_steps.inc()
            for phase, v in parts.items():
                self._decode_phases[phase].inc(v)
