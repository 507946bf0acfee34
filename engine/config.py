"""Engine options: what the model and context are loaded with."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

FlashAttn = Literal["auto", "on", "off"]


def default_threads() -> int:
    """Physical-ish core count: llama.cpp gains nothing from SMT siblings."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, n)


DEFAULT_PROMPT_LOGPROB_ROWS = 64
SIDE_AUTO = -1  # EngineConfig.side_prefill_ctx: decided by the placement


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to load the model and its one context.

    `n_ctx` is the size of the shared KV pool (tokens, all sequences together, a unified
    cache); `n_seq_max` bounds how many requests run at once; `n_batch` is the most tokens
    one step may submit (llama.cpp aborts the process above it, so the engine refuses first).
    """

    model_path: str
    n_ctx: int = 16384
    n_seq_max: int = 32
    # Sequence ids kept beyond n_seq_max for the prefix cache: each holds a finished
    # conversation's (or a running prompt's) KV for later requests to read (0 = no cache).
    n_cached_seqs: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    # Logit rows one call may return for the prompt's own logprobs (echo + logprobs): a
    # prompt scored that way goes in chunks of at most this many tokens. llama.cpp sizes
    # the compute buffer for max(this, sequence ids) rows (64 rows of a 152K vocabulary:
    # 39 MiB); 0 refuses prompt logprobs.
    prompt_logprob_rows: int = DEFAULT_PROMPT_LOGPROB_ROWS
    n_threads: int = 0  # 0 = all cores this process may use
    n_threads_batch: int = 0
    flash_attn: FlashAttn = "auto"
    n_gpu_layers: int = -1  # all layers on the GPU when there is one
    # Plain greedy requests take argmax inside the graph (engine.context). Off by default:
    # measured on the H200 (docs/runs/2026-12-02-h200-engine-step.txt) it made a 32-user
    # step slower (13.3 vs 11.6 ms) — llama.cpp pads the logits and runs one argmax per row.
    device_greedy: bool | None = False
    # Regexes of tensor names kept in host RAM whatever n_gpu_layers says (llama.cpp's
    # `-ot ...=CPU`); engine.placement.CPU_MOE is its `--cpu-moe`.
    cpu_tensors: tuple[str, ...] = ()
    # Share of steps whose MoE router choices are read back (engine.expert_tap); 0 = off,
    # and off attaches nothing to the context.
    expert_sample_rate: float = 0.0
    # The routed-expert cache (patch 0002, engine.moe_cache) of the shared lane's context:
    # experts a layer kept on the GPU (the CPU where there is none) for the layers whose
    # experts are in host RAM (0 = off), and the most a layer uploads after a step. The
    # reproducible lane's context never has one: its numerics must not follow the traffic.
    expert_cache_slots: int = 0
    expert_cache_uploads: int = 1
    # An upload into a full bank must beat the weakest cached expert's decayed pick count by
    # this much (engine.moe_cache.set_admission); 0 = plain LRU, every miss may replace. 3:
    # on the routing curves, as many hits as LRU for a third to a fifth of its uploads.
    expert_cache_admission: float = 3.0
    # Where cached layers compute their misses (engine.moe_cache.set_misses): "cpu", from
    # the host tensors (a host round trip a layer); "gpu", the GPU reading them in place over
    # PCIe (no round trip; a miss costs its bytes over the bus), for decode steps.
    expert_cache_misses: str = "cpu"
    # Router pick counts (`PickCounts` JSON) whose most picked experts fill the bank at load,
    # before any request: --pick-counts, or the counts a previous run saved (engine.pick_store).
    expert_cache_fill: str | None = None
    # Map the file (llama.cpp's default) or read it into memory. Read, the tensors kept in
    # host RAM go to the GPU's page-locked host memory (on a CPU: may be repacked for its
    # matmul kernels); mapped, they are shared with the page cache. None: the placement
    # decides (`api.server.planning.load_mode`).
    use_mmap: bool | None = True
    # A second context of this many tokens prefills long prompts beside the shared lane's
    # steps (engine.side_prefill) where no step carrying them could keep the stall target:
    # with routed experts in host RAM every prompt batch copies them to the GPU. 0 = none;
    # SIDE_AUTO: `api.server.planning.side_context` decides (a GPU and experts in host RAM).
    side_prefill_ctx: int = 0

    def threads(self) -> tuple[int, int]:
        """Decode and batch threads. By default every core, except that with tensors in host
        RAM on a machine of 8 or more cores one core is left to the server's own threads
        (event loop, engine thread): measured on the H200 host with half the experts in RAM
        (docs/benchmarks.md, "Hybrid placement"), 15 of 16 cores decoded 7-25% faster than
        16, whose spinning OpenMP workers competed with the Python threads."""
        t = self.n_threads or default_threads()
        if not self.n_threads and self.cpu_tensors and t >= 8:
            t -= 1
        return t, self.n_threads_batch or t
