"""The sampling a request gets for the fields it leaves unset.

Users expect what llama-server gives: a request without `temperature` samples at 0.8 with
top-k 40, top-p 0.95 and min-p 0.05, not at temperature 1.0 from the whole vocabulary
(which makes a small model ramble). A model may carry its makers' own recommendation in
its GGUF (`general.sampling.*`, gguf-py's `Keys.General.SAMPLING_*`, read by llama.cpp
since 2025), and that is better still. So each field resolves, in order:

  1. the request's own value (api.pipeline.sequences; an explicit temperature 0 is greedy);
  2. the server's flag where the operator gave it (`--temp`, `--top-k`, `--top-p`,
     `--min-p`, `--repeat-penalty`: llama-server's names) — llama.cpp also lets a flag
     given by hand win over the model's metadata;
  3. the GGUF's `general.sampling.<key>`;
  4. llama-server's default.

Values a GGUF carries out of range are ignored (logged), never served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

FLAG, GGUF, DEFAULT = "flag", "gguf", "llama-server default"


@dataclass(frozen=True, slots=True)
class Field:
    name: str  # SamplingParams' field, and the API's
    key: str  # general.sampling.<key>
    flag: str  # the serve option (llama-server's name)
    default: float
    valid: Callable[[float], bool]


FIELDS = (
    Field("temperature", "temp", "--temp", 0.8, lambda v: 0.0 <= v <= 2.0),
    Field("top_k", "top_k", "--top-k", 40, lambda v: 0 <= v < 2**31 and v == int(v)),
    Field("top_p", "top_p", "--top-p", 0.95, lambda v: 0.0 < v <= 1.0),
    Field("min_p", "min_p", "--min-p", 0.05, lambda v: 0.0 <= v <= 1.0),
    Field("repetition_penalty", "penalty_repeat", "--repeat-penalty", 1.0,
          lambda v: 0.0 < v <= 10.0),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SamplingFlags:
    """The serve options as given; None: not given."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request's unset sampling fields become, and where each value came from."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    sources: tuple[tuple[str, str], ...] = tuple((f.name, DEFAULT) for f in FIELDS)

    def describe(self) -> str:
        """One line for the startup log: each value and its source."""
        source = dict(self.sources)
        return ", ".join(f"{f.name} {getattr(self, f.name):g} ({source[f.name]})" for f in FIELDS)


def resolve_defaults(flags: SamplingFlags, meta: Callable[[str], str | None]) -> SamplingDefaults:
    """Each field from the flag given, else the GGUF (`meta(key)`: a metadata value as
    text, None when absent), else llama-server's default."""
    values: dict[str, float] = {}
    sources: list[tuple[str, str]] = []
    for f in FIELDS:
        given = getattr(flags, f.name)
        if given is not None:
            values[f.name], source = float(given), FLAG
        elif (carried := _carried(f, meta)) is not None:
            values[f.name], source = carried, GGUF
        else:
            values[f.name], source = f.default, DEFAULT
        sources.append((f.name, source))
    return SamplingDefaults(
        temperature=values["temperature"], top_k=int(values["top_k"]), top_p=values["top_p"],
        min_p=values["min_p"], repetition_penalty=values["repetition_penalty"],
        sources=tuple(sources),
    )  # fmt: skip


def _carried(f: Field, meta: Callable[[str], str | None]) -> float | None:
    key = f"general.sampling.{f.key}"
    text = meta(key)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not f.valid(value):  # (NaN too)
        log.warning("ignoring the model's %s = %r: out of range", key, text)
        return None
    return value
