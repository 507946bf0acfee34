"""bench.replicas' "history kept": a turn counts when its cached tokens cover the previous
turn's whole prompt (it reached the replica holding its conversation), not when they
cover only a system prompt another replica also holds."""

from __future__ import annotations

import math

from bench.multiturn import Rec
from bench.replicas import history_kept


def rec(user: int, turn: int, prompt: int, cached: int, error: str | None = None) -> Rec:
    return Rec(user, turn, 0.0, prompt_tokens=prompt, cached_tokens=cached, error=error)


def test_history_kept_counts_turns_that_read_their_whole_history() -> None:
    records = [
        rec(0, 1, 420, 0), rec(0, 2, 480, 436), rec(0, 3, 540, 400),  # kept, then moved
        rec(1, 1, 420, 400), rec(1, 2, 480, 420),  # kept (exactly the previous prompt)
    ]  # fmt: skip
    assert history_kept(records) == 2 / 3


def test_history_kept_leaves_out_failed_turns_and_first_turns() -> None:
    assert math.isnan(history_kept([rec(0, 1, 420, 0)]))
    # turn 2 failed: neither it nor turn 3 (whose previous turn it is) counts
    failed = [rec(0, 1, 420, 0), rec(0, 2, 0, 0, error="boom"), rec(0, 3, 540, 500)]
    assert math.isnan(history_kept(failed))
    assert history_kept([*failed, rec(0, 4, 600, 100)]) == 0.0
