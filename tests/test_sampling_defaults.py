"""What a request's unset sampling fields become (engine.sampling_defaults): a flag given
by hand, else the model's own `general.sampling.*`, else llama-server's default — and a
request's own fields always win. Observed where the engine's parameters are made: the
sequences api.pipeline.sequences builds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api.pipeline.lanes import FAST
from api.pipeline.prompts import Prompt
from api.pipeline.request import GenerationRequest, Logprobs, Prompts, Sampling
from api.pipeline.sequences import sequences
from api.pipeline.structured import Constraint
from engine.config import EngineConfig
from engine.model import Model
from engine.sampling_defaults import (
    DEFAULT,
    FLAG,
    GGUF,
    SamplingDefaults,
    SamplingFlags,
    resolve_defaults,
)
from engine.step_types import SamplingParams
from tests.tiny_gguf import write_llama

CARRIED = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
           "general.sampling.top_p": 0.9}  # fmt: skip


def _nothing(_key: str) -> str | None:
    return None


def test_without_flags_or_metadata_llama_server_s_values_apply() -> None:
    d = resolve_defaults(SamplingFlags(), _nothing)
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.repetition_penalty) == (
        0.8, 40, 0.95, 0.05, 1.0,
    )  # fmt: skip
    assert set(dict(d.sources).values()) == {DEFAULT}
    assert d == SamplingDefaults()


def test_the_model_s_values_apply_and_a_flag_given_by_hand_wins_over_them() -> None:
    # (as llama.cpp renders the values; a min_p out of range is ignored)
    meta = {"general.sampling.temp": "0.600000", "general.sampling.top_k": "20",
            "general.sampling.min_p": "7.5"}  # fmt: skip
    d = resolve_defaults(SamplingFlags(top_k=5), meta.get)
    assert (d.temperature, d.top_k, d.min_p) == (0.6, 5, 0.05)
    assert dict(d.sources) == {"temperature": GGUF, "top_k": FLAG, "top_p": DEFAULT,
                               "min_p": DEFAULT, "repetition_penalty": DEFAULT}  # fmt: skip
    assert "temperature 0.6 (gguf)" in d.describe() and "top_k 5 (flag)" in d.describe()


@pytest.fixture(scope="module")
def carrying(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    path = write_llama(tmp_path_factory.mktemp("sampling") / "m.gguf", metadata=CARRIED)
    model = Model(EngineConfig(str(path), n_ctx=256, n_seq_max=1, n_threads=1))
    yield model
    model.close()


def _state(model: Model, defaults: SamplingDefaults) -> Any:
    """What `api.pipeline.sequences` reads of the server's state."""
    return SimpleNamespace(model=model, sampling_defaults=defaults, max_len=lambda lane: 256)


def _params(state: Any, sampling: Sampling, n: int = 1) -> list[SamplingParams]:
    req = GenerationRequest("r", Prompts("hello"), sampling=sampling, max_tokens=4, n=n)
    seqs = sequences(state, req, [Prompt([1, 2, 3])], Constraint(), FAST, "client")
    return [s.params for s in seqs]


def test_a_gguf_s_general_sampling_keys_reach_the_sequences(carrying: Model) -> None:
    """A generated GGUF carrying `general.sampling.*`: read through llama.cpp's metadata,
    a request without sampling fields gets the model's values (and llama-server's for
    the fields the file does not carry)."""
    d = resolve_defaults(SamplingFlags(), carrying.meta_str)
    assert dict(d.sources)["temperature"] == GGUF and dict(d.sources)["min_p"] == DEFAULT
    (p,) = _params(_state(carrying, d), Sampling())
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == pytest.approx((0.6, 20, 0.9, 0.05))


def test_a_request_s_own_fields_win_even_zero(carrying: Model) -> None:
    state = _state(carrying, SamplingDefaults())
    (greedy,) = _params(state, Sampling(temperature=0.0))
    assert greedy.is_greedy and greedy.temperature == 0.0
    (own,) = _params(state, Sampling(temperature=1.2, top_k=0, top_p=0.5, min_p=0.0, seed=3))
    assert (own.temperature, own.top_k, own.top_p, own.min_p) == (1.2, 0, 0.5, 0.0)
    (unset,) = _params(state, Sampling(seed=3))
    assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p) == (0.8, 40, 0.95, 0.05)
    assert [p.seed for p in _params(state, Sampling(seed=3), n=2)] == [3, 4]


def test_the_engine_s_neutral_values_are_what_no_defaults_mean() -> None:
    """sampling_params without defaults keeps its old meaning (the samplers' neutral
    values), for callers that build parameters themselves."""
    from api.pipeline.sequences import sampling_params

    p = sampling_params(Sampling(), Logprobs())
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.0)


def test_tiny_gguf_writes_the_keys_as_converters_do(tmp_path: Path) -> None:
    """(INT32 top_k, FLOAT32 the rest: what llama.cpp reads.)"""
    import gguf

    path = write_llama(tmp_path / "m.gguf", metadata=CARRIED)
    fields = gguf.GGUFReader(path).fields
    assert fields["general.sampling.top_k"].types == [gguf.GGUFValueType.INT32]
    assert fields["general.sampling.temp"].types == [gguf.GGUFValueType.FLOAT32]
