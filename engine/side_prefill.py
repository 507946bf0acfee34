"""Long prompts prefilled beside the decoders, in a second context on the same weights.

With the experts in host RAM every step that carries 32 or more prompt rows copies the
experts those rows use to the GPU (~1 s a physical batch on a model whose prompts use them
all), so no chunk size keeps the decoders' pause short. The decoders' own steps compute
their experts on the CPU and hardly use the PCIe link; a prompt's use the link and the GPU.
Run apart they overlap: on an H100 (bench/side_prefill.py) four decoders kept 80 ms steps
(71 alone) while a 16K prompt prefilled beside them in 13.1 s, against 1.6 s steps and
12.9 s with its chunks in their steps.

So a prompt handed here is prefilled, all but its last token, in full batches by a context
of its own on a thread of its own; its KV is then saved to host memory as a preempted
sequence's is (`engine.kv_swap`) and handed to the main context's swap store, from which
the step that admits the request again restores it and feeds the last token. One prompt
at a time: the side context holds one sequence, and the link is the bottleneck anyway.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from engine.kv_swap import SideDone
from engine.model import Model
from engine.pinned import HostBytes, PinnedStaging, plain
from engine.runner import Engine
from engine.step_types import SamplingParams, SeqChunk, SeqStart, StepBatch

log = logging.getLogger(__name__)

_SEQ = 0  # the side context's one sequence
_GREEDY = SamplingParams(temperature=0.0)  # no token is sampled here: a sampler is required


class SidePrefill:
    """The second context and its thread. `submit` and `finished` are called from the
    engine thread; the side engine is used by the worker thread only. `on_done` (set by
    whoever steps the main context) is called on the worker thread when a prefill ends:
    an idle scheduler loop waits for that, not for a step."""

    def __init__(
        self, model: Model, n_ctx: int, threads: int = 2, kv_bytes_per_token: int = 0
    ) -> None:
        self._ctx = model.open_context(n_ctx=n_ctx, n_seq_max=1, unified=True,
                                       device_greedy=False, swa_full=model.swa_full)  # fmt: skip
        model.ll.llama_set_n_threads(self._ctx.ctx, threads, threads)
        self._engine = Engine(model, self._ctx)
        self.n_ctx = self._ctx.n_ctx
        # its saves go to page-locked memory where there is a GPU (engine.pinned): a save
        # through pageable memory held the main context's step for as long as it took.
        # Sized for a full context: every cell's K and V, its position and sequence ids,
        # and room for the per-layer headers.
        capacity = self.n_ctx * (kv_bytes_per_token + 16) + (1 << 20)
        self._staging = PinnedStaging(model.ll, capacity) if kv_bytes_per_token else None
        self._engine.swap.alloc = self._alloc
        self._jobs: queue.Queue[tuple[int, list[int]] | None] = queue.Queue()
        self._done: queue.Queue[SideDone] = queue.Queue()
        self._pending = 0  # submitted, not yet collected by `finished`
        self._closing = threading.Event()  # a prefill under way stops at its next batch
        self.on_done: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._work, name="side-prefill", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def submit(self, key: int, tokens: list[int]) -> None:
        """Prefill `tokens` (a prompt less its last token) into KV saved under `key`."""
        if len(tokens) >= self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens do not fit the side context ({self.n_ctx})")
        self._pending += 1
        self._jobs.put((key, tokens))

    def finished(self) -> list[SideDone]:
        """The prefills that ended since the last call (never blocks)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._pending -= len(out)
        return out

    def close(self) -> None:
        self._closing.set()
        self._jobs.put(None)
        self._thread.join()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            key, tokens = job
            kv = None
            try:
                kv = self._prefill(key, tokens)
            except Exception:  # the request recomputes its prompt in the main context
                log.exception("side prefill of %d tokens failed", len(tokens))
            finally:  # its cells and sampler go: the next prompt starts afresh
                self._engine.step(StepBatch([], released=[_SEQ]))
            self._done.put(SideDone(key, kv, len(tokens)))
            if self.on_done is not None:
                try:
                    self.on_done()
                except Exception:  # the next step collects it anyway
                    log.exception("waking the scheduler for a side prefill failed")

    def _alloc(self, size: int) -> HostBytes:
        lent = self._staging.lend(size) if self._staging is not None else None
        return lent or plain(size)

    def _prefill(self, key: int, tokens: list[int]) -> HostBytes | None:
        # batches as even as the fewest full ones allow: a short last one (under 32 rows)
        # would compute the experts on this context's few threads
        start = time.perf_counter()
        k = -(-len(tokens) // self._engine.n_batch)
        step = -(-len(tokens) // k)
        for d in range(0, len(tokens), step):
            if self._closing.is_set():
                return None
            starts = [SeqStart(_SEQ, _GREEDY)] if d == 0 else []
            chunk = SeqChunk(_SEQ, tokens[d : d + step], d, False)
            self._engine.step(StepBatch([chunk], starts))
        t0 = time.perf_counter()
        swap = self._engine.swap
        if not swap.save(key, self._engine.llama_seq(_SEQ)):
            return None
        log.debug("side prefill of %d tokens in %d batches: %.2f s, KV saved in %.0f ms",
                  len(tokens), k, t0 - start, 1000 * (time.perf_counter() - t0))  # fmt: skip
        return swap.take(key)
