"""Numerics lanes: which lane serves a request, and how a response names it.

The fast lane shares steps with everyone (its numerics follow the batch's shape). The
reproducible lane runs on a context of its own: each request in its own KV stream, decoded
alone in every step, its prompt cut into chunks of a fixed size — so its tokens, text and
logprobs are those it gets alone on an idle server started with the same options.

`system_fingerprint` is OpenAI's field for "same fingerprint + same seed ⇒ same output":
it hashes the model file and the options that shape the numerics, and ends with the lane,
so a client can tell which lane served it and compare runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from api.server.errors import InvalidRequest, NotReproducible, ReproducibleLaneUnavailable
from engine.config import EngineConfig
from engine.step_types import SamplingParams
from scheduler.stats import FAST as FAST  # the shared lane, named where the loop names it

REPRODUCIBLE = "reproducible"
ALLOWED = ("required", "off")


@dataclass(frozen=True, slots=True)
class LaneOptions:
    """`--cpu-numerics fork` (default): requests share steps unless they ask otherwise;
    `gpu`: every request is served reproducibly. `slots` requests fit the reproducible lane
    at once, each up to `ctx` tokens, their prompts prefilled `chunk` tokens at a time."""

    cpu_numerics: str = "fork"
    slots: int = 2
    ctx: int = 4096
    chunk: int = 256


def resolve_lane(value: str | None, opts: LaneOptions) -> str:
    """The lane for a request's `strata_reproducible`; 400 for any other value."""
    if value is not None and value not in ALLOWED:
        raise InvalidRequest(
            f"`strata_reproducible` must be one of {', '.join(map(repr, ALLOWED))} "
            f"(or absent); got {value!r}",
            param="strata_reproducible",
        )
    if value == "required" or opts.cpu_numerics == "gpu":
        if opts.slots < 1:
            raise ReproducibleLaneUnavailable(
                "this server has no reproducible lane (started with --repro-slots 0)",
                param="strata_reproducible",
            )
        return REPRODUCIBLE
    return FAST


def check_reproducible(params: SamplingParams) -> None:
    """What the lane cannot make reproducible is refused, never served another way."""
    if not params.is_greedy and params.seed is None:
        raise NotReproducible(
            "a reproducible request that samples (temperature > 0) needs a `seed`",
            param="seed",
        )


def fingerprints(cfg: EngineConfig, opts: LaneOptions) -> dict[str, str]:
    """`system_fingerprint` per lane: the same model file and numerics options give the
    same value (the server's port, API key or queue bounds do not enter)."""
    path = Path(cfg.model_path)
    size = path.stat().st_size if path.exists() else 0
    key = repr(
        (path.name, size, cfg.threads(), cfg.flash_attn, cfg.n_ubatch, cfg.n_gpu_layers,
         cfg.cpu_tensors, cfg.use_mmap, opts.ctx, opts.chunk)
    )  # fmt: skip
    h = hashlib.sha256(key.encode()).hexdigest()[:10]
    return {FAST: f"fp_{h}-{FAST}", REPRODUCIBLE: f"fp_{h}-{REPRODUCIBLE}"}
