"""engine.side_prefill: a prompt prefilled in the second context, on its thread, while the
main context decodes, comes back through the main context's swap store and continues as
the same prompt prefilled in place would (the embedded model, CPU)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from engine.default_model import default_model_path
from engine.model import Model
from engine.runner import Engine
from engine.side_prefill import SidePrefill
from engine.step_types import SamplingParams, SeqChunk, SeqStart, StepBatch

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    cfg = EngineConfig(default_model_path(), n_ctx=4096, n_seq_max=4, n_batch=256, n_threads=2)
    with Model(cfg) as m:
        yield m


def test_a_prompt_prefilled_beside_the_decoders_continues_as_one_prefilled_in_place(
    model: Model,
) -> None:
    main = Engine(model)
    side = SidePrefill(model, n_ctx=1024)
    try:
        vocab = model.n_vocab
        prompt = [(7 + 31 * i) % vocab for i in range(700)]
        decoder, in_place, moved = 1, 2, 3
        main.step(StepBatch([SeqChunk(decoder, [5, 6, 7], 0, True)],
                            [SeqStart(s, GREEDY) for s in (decoder, in_place, moved)]))  # fmt: skip
        ended = threading.Event()
        side.on_done = ended.set
        side.submit(42, prompt[:-1])
        assert side.busy
        pos, steps = 3, 0
        while not ended.is_set():  # the decoder keeps stepping meanwhile
            main.step(StepBatch([SeqChunk(decoder, [9], pos, True)]))
            pos, steps = pos + 1, steps + 1
            assert steps < 10_000
        (done,) = side.finished()
        assert not side.busy and done.key == 42 and done.tokens == 699 and done.kv is not None
        main.swap.put(42, done.kv)
        for d in range(0, 699, 256):  # the same prompt in place, in the main context
            main.step(StepBatch([SeqChunk(in_place, prompt[d : min(d + 256, 699)], d, False)]))
        r = main.step(StepBatch([SeqChunk(in_place, prompt[-1:], 699, True),
                                 SeqChunk(moved, prompt[-1:], 699, True)],
                                swap_in=[(42, moved)]))  # fmt: skip
        assert r.swap_in_failed == [] and r.swap_in_bytes > 0
        assert r.sampled[moved].token == r.sampled[in_place].token
        assert main.seq_pos_max(moved) == main.seq_pos_max(in_place) == 699
        ended.clear()
        side.submit(43, prompt[:100])  # the side context is free for the next prompt
        ended.wait(60)
        (again,) = side.finished()
        assert again.kv is not None and len(again.kv) < len(done.kv)
    finally:
        side.close()
