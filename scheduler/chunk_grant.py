"""The chunk grant: how many tokens of a prompt go into the step being planned, and whether
that chunk joins the step at all.

The size is the chunk policy's (`scheduler.budget`: a fixed budget, or the stall target
decoders are held to), within the step's budget, the cap on one chunk and the point the
prompt is offered to the prefix cache at; whether it joins is the step cost model's
(`StepCostModel.joins`). Both learn from the steps the engine ran (`observe`), so this
object keeps the draft of the step last planned beside them.
"""

from __future__ import annotations

from engine.step_types import StepBatch, StepResult
from scheduler.budget import ChunkPolicy, FixedBudget, StallTarget
from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.stats import StepStats
from scheduler.step_cost import StepCostModel, StepDraft
from scheduler.step_outputs import step_stats


class ChunkGrant:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.cost = StepCostModel(cfg.ubatch, cfg.attention_tile)
        self.policy: ChunkPolicy = (
            FixedBudget(self.cost) if cfg.max_stall_s is None else StallTarget(
                self.cost, cfg.max_stall_s, cfg.min_prefill_chunk, cfg.max_num_batched_tokens,
                cfg.stall_auto,
            )
        )  # fmt: skip
        self.last = StepDraft()  # the step last planned, as the policy saw it

    def draft(self, decoders: list[Request], prefilling: bool, others_waiting: bool) -> StepDraft:
        """The step before any prompt chunk. Prompt chunks are sized to keep it under the
        stall target — except for a burst: when every decoder has one token so far and no
        prefill is under way, the decoders came with the prompts now waiting (a closed-loop
        wave: the first arrival is prefilled alone while the rest arrive). Bounding the
        step for them would stagger the burst over many steps, and every later step would
        mix prompt work. A prefill already under way stays bounded for every decoder.
        `others_waiting`: another lane waits for this step, as if its users decoded here."""
        burst = (
            not prefilling and not others_waiting and all(len(r.output_ids) < 2 for r in decoders)
        )
        n = len(decoders)
        left = [max(1, r.max_tokens - len(r.output_ids)) for r in decoders]
        return StepDraft(n, sum(r.num_computed for r in decoders), n > 0 or others_waiting, burst,
                         ahead=sum(left) / n if n else 1.0, last=max(left, default=0))  # fmt: skip

    def running(self, draft: StepDraft, req: Request, budget: int, behind: int) -> int | None:
        """The next chunk of a prompt under way (0: none granted); None when it would not
        join the step: it waits for the next, with the `behind` requests after it."""
        n = self.policy.grant(
            draft,
            min(req.num_uncomputed, budget, self.cap(req), self.until_split(req)),
            req.num_computed,
            req.num_uncomputed,
            behind,
        )
        if n < 1:
            return 0
        return n if self.cost.joins(draft, n, req.num_computed, behind) else None

    def first(
        self, draft: StepDraft, req: Request, cached: int, split: int | None, budget: int,
        behind: int,
    ) -> int:  # fmt: skip
        """The chunk a waiting request would start with after the `cached` tokens it reads,
        up to the point `split` it offers its prompt at (0: none this step)."""
        rest = req.num_uncomputed - cached
        cap = split - cached if split is not None else rest
        depth = req.num_computed + cached
        n_max = min(rest, budget, self.cap(req), cap)
        if n_max == rest and self.cost.waits_for_decoders(draft, rest, depth, behind):
            return 0  # (a short prompt: a long one is the stall target's, chunk by chunk)
        n = self.policy.grant(draft, n_max, depth, rest, behind)
        return n if n >= 1 and self.cost.joins(draft, n, depth, behind) else 0

    def cap(self, req: Request) -> int:
        """The most tokens of one chunk (a scored prompt's: the engine's logit rows)."""
        cap = self.cfg.max_prefill_chunk or self.cfg.max_num_batched_tokens
        return min(cap, self.cfg.prompt_logprob_rows) if req.scores_prompt else cap

    def until_split(self, req: Request) -> int:
        """Tokens `req` may compute before the point it offers its prompt at."""
        if req.split_at is not None and req.num_computed < req.split_at:
            return req.split_at - req.num_computed
        return self.cfg.max_num_batched_tokens

    def observe(self, batch: StepBatch, result: StepResult) -> StepStats:
        """The policy learns what the step last planned took; the step's figures."""
        step = self.last
        bounded = self.policy.bounded(step) and bool(step.chunks)
        planned_s = self.cost.step_time(step) if bounded else 0.0
        if not result.prompt_logprobs:  # (a scored prompt's extra call is not prompt cost)
            self.policy.observe(step, result.fill_s + result.decode_s + result.sample_s)
        # (the default target is soft: its steps may run longer to prefill efficiently)
        target = self.cfg.max_stall_s if bounded and not self.cfg.stall_auto else None
        stats = step_stats(batch, result, step, target)
        stats.modelled_s, stats.chunk_policy = planned_s, self.policy.stats()
        return stats
