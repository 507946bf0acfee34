"""What the routes share: settings and the live model, loop and metrics (built in the
app's lifespan, carried on `app.state`, never module globals)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from starlette.requests import Request

from api.pipeline.lanes import REPRODUCIBLE, LaneOptions
from api.server.errors import ServiceUnavailable
from api.server.limits import ConnectionLimits, RequestLimits
from api.server.metrics.registry import Metrics
from engine.chat_template import ChatTemplate
from engine.config import EngineConfig
from engine.model import Model
from engine.plan import Plan
from engine.sampling_defaults import SamplingDefaults, SamplingFlags
from scheduler.loop import EngineLoop

if TYPE_CHECKING:
    from engine.expert_telemetry import ExpertTelemetry
    from engine.pick_store import PickStore


@dataclass(frozen=True, slots=True)
class ServerSettings:
    engine: EngineConfig
    served_model_name: str | None = None
    chat_template: Path | None = None
    reasoning_format: str = "auto"  # "none": a reasoning model's <think> block stays in content
    # api.pipeline.tool_calls: "auto" (from the template, else generic), a name, "none" (no tools)
    tool_call_parser: str = "auto"
    sampling: SamplingFlags = field(default_factory=SamplingFlags)  # --temp, --top-k …
    accept_any_model: bool = False  # any `model` a request names is served (llama-server)
    max_waiting: int = 256
    swap_space: int = 4 * 2**30  # host-RAM bytes for preempted requests' KV (0 = none)
    max_num_batched_tokens: int | None = None  # per step; None = the context's n_batch
    max_model_len: int | None = None  # per request; None = min(n_ctx, training context)
    max_stall_ms: float | None = 250.0  # step-time target while others decode (None = off)
    stall_auto: bool = False  # the target is the default: chunks also stay efficient
    min_prefill_chunk: int = 32
    api_keys: tuple[str, ...] = ()  # any of them opens /v1 (api.server.auth); none: open
    protect_metrics: bool = False  # /metrics and /experts need a key too
    limits: RequestLimits = field(default_factory=RequestLimits)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    drain_s: float = 30.0
    lanes: LaneOptions = field(default_factory=LaneOptions)
    plan: Plan | None = None  # the placement plan applied (engine.cpu_tensors carries it)
    state_dir: Path | None = None  # where sampled router pick counts are saved (engine.pick_store)


@dataclass(slots=True)
class ServerState:
    settings: ServerSettings
    model: Model
    loop: EngineLoop
    metrics: Metrics
    template: ChatTemplate
    model_name: str
    max_model_len: int
    repro_max_len: int  # per request in the reproducible lane (its KV stream)
    fingerprints: dict[str, str]  # system_fingerprint by lane
    created: int
    longest_token_bytes: int  # bounds a prompt's tokens by its length (api.pipeline.prompts)
    prompt_workers: anyio.CapacityLimiter  # render + tokenize threads (api.pipeline.prompts)
    draining: bool = False
    # sequences of requests admitted but still being tokenized, by (lane, client)
    preparing: Counter[tuple[str, str]] = field(default_factory=Counter)
    aliases: frozenset[str] = field(default_factory=frozenset)
    experts: ExpertTelemetry | None = None  # router telemetry (MoE, sample rate > 0)
    picks: PickStore | None = None  # where the telemetry's counts are saved for the next start
    reasoning: bool = (
        False  # split <think> … </think> into reasoning_content (api.pipeline.reasoning)
    )
    tool_format: str | None = (
        None  # the model's tool-call format (api.pipeline.tool_calls), if served
    )
    renders_tools: bool = True  # the template writes `tools` (else the server adds them)
    system_role: bool = True  # the template renders a system message (api.pipeline.generic_tools)
    system_between: bool = True  # ... and one after the first turn (api.pipeline.rendering)
    # what a request's unset sampling fields become (engine.sampling_defaults)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def max_len(self, lane: str) -> int:
        """Most tokens of prompt + completion in `lane`."""
        return self.repro_max_len if lane == REPRODUCIBLE else self.max_model_len


def server_state(request: Request) -> ServerState:
    """The serving state; a 503 while the model is still loading."""
    state: ServerState | None = request.app.state.server
    if state is None:
        raise ServiceUnavailable("the model is loading; try again shortly")
    return state


def working_state(request: Request) -> ServerState:
    """The serving state for a request that asks for work: also a 503 once the server
    drains (checked again when its sequences are queued: reading and tokenizing take
    time)."""
    state = server_state(request)
    if state.draining:
        raise ServiceUnavailable("the server is shutting down; retry on another instance")
    return state
