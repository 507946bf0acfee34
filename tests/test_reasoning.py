"""The reasoning split on its own: any cut of the streamed text gives the same parts."""

from __future__ import annotations

import random

import pytest

from api.pipeline.reasoning import ReasoningSplit, template_reasons

CASES = [
    # (prompt tail, the model's text, reasoning, content)
    ("<start_of_turn>model\n", "<think>\nLet me see. 2+2=4.</think>\n\nIt is 4.",
     "Let me see. 2+2=4.", "It is 4."),
    ("<｜Assistant｜><think>\n", "2+2 is 4, surely.\n</think>\n\nFour.", "2+2 is 4, surely.\n",
     "Four."),
    ("<start_of_turn>model\n", "No reasoning here, just <b>bold</b> text.", "",
     "No reasoning here, just <b>bold</b> text."),
    ("<start_of_turn>model\n", "<thin ice", "", "<thin ice"),
    ("<｜Assistant｜><think>\n", "cut off while thinking </th", "cut off while thinking </th",
     ""),
]  # fmt: skip


@pytest.mark.parametrize(("tail", "text", "reasoning", "content"), CASES)
def test_every_cut_of_the_stream_gives_the_same_split(
    tail: str, text: str, reasoning: str, content: str
) -> None:
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(6, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        split = ReasoningSplit(tail)
        got_r = got_c = ""
        for p in pieces:
            r, c = split.feed(p)
            got_r, got_c = got_r + r, got_c + c
        r, c = split.flush()
        got_r, got_c = got_r + r, got_c + c
        assert (got_r, got_c) == (reasoning, content), pieces
        assert (split.reasoning, split.content) == (reasoning, content)


def test_a_template_that_writes_think_is_a_reasoning_one() -> None:
    assert template_reasons("{{ '<think>\\n' }}{% if add_generation_prompt %}")
    assert not template_reasons("<start_of_turn>model\n")
