"""A step as the scheduler core plans it (`StepPlan`) and hands it out
(`SchedulerOutput`): the two records `Scheduler.schedule()` passes between its phases and
to the engine loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.step_types import SeqStart, StepBatch
from scheduler.request import Request
from scheduler.step_cost import StepDraft


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
            or b.retained or b.side_prefill or b.side_poll
        )  # fmt: skip


@dataclass(slots=True)
class StepPlan:
    """The step being planned: the chunks granted so far by request (insertion order is
    batch order), the sequences it starts, and the step as the chunk policy sees it."""

    draft: StepDraft = field(default_factory=StepDraft)
    chunks: dict[str, tuple[Request, int]] = field(default_factory=dict)
    starts: list[SeqStart] = field(default_factory=list)
    preempted: int = 0

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks.values())
