"""A deterministic stand-in for `engine.runner.Engine.step`, strict about the step contract.

The fake keeps each sequence's KV as a list of (pos, token) and refuses (with
`ContractViolation`, an AssertionError so no engine-error handler swallows it) anything the
real backend would silently get wrong: a chunk whose `pos0` does not continue its sequence,
a chunk for a sequence that was never started or already released, a sequence twice in one
batch, a live sequence id restarted without a release, a batch over `n_batch`.

The next token is a pure function of the sequence's whole token history, so a request's
output does not depend on what it was batched with, on chunking, or on preemption and
recompute: a request run alone through `reference()` is the exact expected output.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.detok import IncrementalDetokenizer
from engine.errors import EngineError, KVCacheFull
from engine.step_types import (
    KVOp,
    Release,
    Sampled,
    SamplingParams,
    Share,
    StepBatch,
    StepResult,
    Trim,
)
from scheduler.request import Request
from scheduler.stops import StopMatcher

VOCAB = 50  # ids 0..49; 0 is end-of-generation
EOG = 0
EOG_MARK = 1000  # a prompt [EOG_MARK, n, ...] produces EOG once its history is n tokens long


class ContractViolation(AssertionError):
    """The scheduler sent a batch the real engine would have mis-decoded."""


def next_token(history: Sequence[int]) -> int:
    """The token sampled after `history`: EOG only when the prompt asks for it."""
    if len(history) >= 2 and history[0] == EOG_MARK and len(history) >= history[1]:
        return EOG
    digest = hashlib.blake2b(array("q", history).tobytes(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (VOCAB - 1)


def token_bytes(token: int) -> bytes:
    return b"" if token == EOG else b"t%d " % token


def is_eog(token: int) -> bool:
    return token == EOG


@dataclass(slots=True)
class Reference:
    """What a request produces when it runs alone (slow, written from the definitions)."""

    token_ids: list[int]
    text: str
    finish_reason: str


def reference(
    prompt: Sequence[int],
    max_tokens: int,
    stops: Sequence[str] = (),
    sample: Callable[[Sequence[int]], int] = next_token,
) -> Reference:
    history = list(prompt)
    out: list[int] = []
    text = ""
    while True:
        tok = sample(history)
        out.append(tok)
        history.append(tok)
        if is_eog(tok):
            return Reference(out, text, "stop")
        text += token_bytes(tok).decode()
        hits = [i for i in (text.find(s) for s in stops if s) if i != -1]
        if hits:
            return Reference(out, text[: min(hits)], "stop")
        if len(out) >= max_tokens:
            return Reference(out, text, "length")


@dataclass
class FakeEngine:
    """`step(batch)` like `Engine.step`: release, start, check, "decode", sample.

    `capacity` (cells over all sequences) makes the fake raise `KVCacheFull` like llama.cpp
    when a batch does not fit, leaving the KV as before the call. `faults[i]` is raised by
    the i-th call (0-based) after releases and starts are applied, as the real engine does.
    `max_steps` turns a scheduler livelock into a prompt `ContractViolation`.

    Swaps keep a sequence's cells under their key, as the real engine keeps their bytes:
    saved before releases, restored after starts into a sequence that holds none. Cells
    have ids, so a prefix lent to another sequence (`Share`, from the prefix index) is one
    set of cells read by both, counted once in `kv_used`, as in llama.cpp's unified cache.
    `seconds_per_step`, `seconds_per_token`, `seconds_per_cell` and `swap_bytes_per_s` make
    steps and copies report times (the scheduler learns its cost models from them);
    `lose_swaps` are keys whose restore fails.

    A side context (`side_tokens_per_step` > 0, engine.side_prefill) prefills each prompt
    handed to it by `side_prefill` at that many tokens per step, one at a time, and puts
    its cells under its key as a swap would; `lose_side` are keys whose prefill fails.
    """

    n_batch: int | None = None
    capacity: int | None = None
    sample: Callable[[Sequence[int]], int] = next_token
    faults: dict[int, EngineError] = field(default_factory=dict)
    max_steps: int | None = None
    kv: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # pos, token, cell
    batches: list[StepBatch] = field(default_factory=list)
    num_steps: int = 0
    seconds_per_token: float = 0.0
    seconds_per_step: float = 0.0
    seconds_per_cell: float = 0.0  # per KV cell a token attends (attention's share)
    swap_bytes_per_s: float = 1e9
    bytes_per_cell: int = 1
    lose_swaps: set[int] = field(default_factory=set)
    window: int = 0  # sliding attention window: cells llama.cpp may overwrite (`pruned`)
    pruned: set[int] = field(default_factory=set)
    swapped: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    side_tokens_per_step: int = 0
    side_jobs: list[tuple[int, list[int]]] = field(default_factory=list)  # (key, tokens)
    side_progress: int = 0  # tokens of the first job prefilled
    lose_side: set[int] = field(default_factory=set)
    _next_cell: int = 0

    @property
    def side_busy(self) -> bool:
        return bool(self.side_jobs)

    @property
    def kv_used(self) -> int:
        """Cells in use: a cell several sequences read (a shared prefix) counts once."""
        return len({cell for cells in self.kv.values() for _, _, cell in cells})

    def history(self, seq_id: int) -> list[int]:
        return [tok for _, tok, _ in self.kv[seq_id]]

    def _new_cells(self, pos0: int, tokens: Sequence[int]) -> list[tuple[int, int, int]]:
        first, self._next_cell = self._next_cell, self._next_cell + len(tokens)
        return [(pos0 + k, tok, first + k) for k, tok in enumerate(tokens)]

    def _apply(self, i: int, op: KVOp) -> None:
        """The prefix index's ops, with llama.cpp's meaning (`seq_cp`, `seq_rm`)."""
        if isinstance(op, Share):
            src = [c for c in self.kv.get(op.src, []) if op.p0 <= c[0] < op.p1]
            if op.dst not in self.kv:  # a new cache holder (or pin) takes a copy
                self.kv[op.dst] = []
            if len(src) != op.p1 - op.p0 or op.dst not in self.kv:
                raise ContractViolation(f"step {i}: {op} from cells it does not hold")
            if any(op.p0 <= c[0] < op.p1 for c in self.kv[op.dst]):
                raise ContractViolation(f"step {i}: {op} over positions the reader holds")
            self.kv[op.dst] = sorted(self.kv[op.dst] + src)
        elif isinstance(op, Trim):
            end = op.p1 if op.p1 >= 0 else 1 << 62
            if op.seq not in self.kv:
                raise ContractViolation(f"step {i}: {op} of a sequence not live")
            self.kv[op.seq] = [c for c in self.kv[op.seq] if not op.p0 <= c[0] < end]
        else:
            assert isinstance(op, Release)
            if self.kv.pop(op.seq, None) is None:
                raise ContractViolation(f"step {i}: {op} of a sequence not live")

    def _prune(self) -> None:
        """With a window, llama.cpp may give a cell to a new token once it has one owner and
        lies a window behind that owner's last position: mark every such cell at once (the
        worst case), so reading one later is caught."""
        if not self.window:
            return
        owners: dict[int, int] = {}
        for cells in self.kv.values():
            for _, _, cell in cells:
                owners[cell] = owners.get(cell, 0) + 1
        for cells in self.kv.values():
            if cells:
                end = max(pos for pos, _, _ in cells) + 1
                self.pruned |= {
                    cell for pos, _, cell in cells if owners[cell] == 1 and end - pos >= self.window
                }

    def step(self, batch: StepBatch) -> StepResult:
        i = self.num_steps
        self.num_steps += 1
        if self.max_steps is not None and i >= self.max_steps:
            raise ContractViolation(f"still stepping after {self.max_steps} steps (livelock?)")
        self.batches.append(batch)
        swap = StepResult({})
        for key, tokens in batch.side_prefill:
            taken = key in self.swapped or any(k == key for k, _ in self.side_jobs)
            if not self.side_tokens_per_step or taken or not tokens:
                raise ContractViolation(f"step {i}: side prefill of key {key}")
            self.side_jobs.append((key, list(tokens)))
        for seq_id, key in batch.swap_out:
            if seq_id not in self.kv or key in self.swapped:
                raise ContractViolation(f"step {i}: swap out of seq {seq_id} as key {key}")
            self.swapped[key] = list(self.kv[seq_id])
            swap.swap_out_bytes += len(self.kv[seq_id]) * self.bytes_per_cell
        for seq_id in batch.released:
            if seq_id not in self.kv:
                raise ContractViolation(f"step {i}: released seq {seq_id} is not live")
            del self.kv[seq_id]
        for s in batch.starts:
            if s.seq_id in self.kv:
                raise ContractViolation(f"step {i}: started seq {s.seq_id} is still live")
            self.kv[s.seq_id] = []
        for seq_id in batch.retained:
            if seq_id not in self.kv:
                raise ContractViolation(f"step {i}: retained seq {seq_id} is not live")
        for op in batch.kv_ops:
            self._apply(i, op)
        self._prune()
        lost = set()
        for key, seq_id in batch.swap_in:
            if key not in self.swapped or self.kv.get(seq_id) != []:
                raise ContractViolation(f"step {i}: swap in of key {key} to seq {seq_id}")
            cells = self.swapped.pop(key)
            if key in self.lose_swaps:
                swap.swap_in_failed.append(key)
                lost.add(seq_id)
                continue
            self.kv[seq_id] = self._new_cells(0, [tok for _, tok, _ in cells])
            swap.swap_in_bytes += len(cells) * self.bytes_per_cell
        for key in batch.swap_drop:
            if self.swapped.pop(key, None) is None:
                raise ContractViolation(f"step {i}: dropped swap key {key} is not held")
        swap.swap_out_s = swap.swap_out_bytes / self.swap_bytes_per_s
        swap.swap_in_s = swap.swap_in_bytes / self.swap_bytes_per_s
        chunks = [c for c in batch.chunks if c.seq_id not in lost]
        if self.n_batch is not None and batch.num_tokens > self.n_batch:
            raise ContractViolation(f"step {i}: {batch.num_tokens} tokens > {self.n_batch}")
        seen: set[int] = set()
        for c in chunks:
            if c.seq_id not in self.kv:
                raise ContractViolation(f"step {i}: chunk for seq {c.seq_id}, never started")
            if c.seq_id in seen:
                raise ContractViolation(f"step {i}: seq {c.seq_id} twice in one batch")
            seen.add(c.seq_id)
            if not c.tokens:
                raise ContractViolation(f"step {i}: empty chunk for seq {c.seq_id}")
            have = len(self.kv[c.seq_id])
            if [pos for pos, _, _ in self.kv[c.seq_id]] != list(range(have)):
                raise ContractViolation(f"step {i}: seq {c.seq_id} has holes in its positions")
            if c.pos0 != have:
                kind = "gap" if c.pos0 > have else "overlap"
                raise ContractViolation(
                    f"step {i}: seq {c.seq_id} chunk at pos {c.pos0}, KV holds {have} ({kind})"
                )
            near = [cell for pos, _, cell in self.kv[c.seq_id] if pos > c.pos0 - self.window]
            if self.window and any(cell in self.pruned for cell in near):
                raise ContractViolation(f"step {i}: seq {c.seq_id} reads overwritten cells")
        if i in self.faults:
            raise self.faults.pop(i)
        if self.capacity is not None and self.kv_used + batch.num_tokens > self.capacity:
            raise KVCacheFull(f"{self.kv_used} + {batch.num_tokens} > {self.capacity}")
        for c in chunks:
            if c.targets:
                # row i scores the token after chunk token i: the chunk's own next ones
                inside = c.targets[: len(c.tokens) - 1]
                if inside != c.tokens[1 : len(inside) + 1] or len(c.targets) > len(c.tokens):
                    raise ContractViolation(f"step {i}: seq {c.seq_id} targets off its tokens")
                swap.prompt_logprobs[c.seq_id] = [
                    Sampled(t, prompt_logprob(c.pos0 + 1 + j, t)) for j, t in enumerate(c.targets)
                ]
            self.kv[c.seq_id].extend(self._new_cells(c.pos0, c.tokens))
            if c.sample:
                swap.sampled[c.seq_id] = Sampled(self.sample(self.history(c.seq_id)))
        self._prune()
        n = sum(len(c.tokens) for c in chunks)
        cells = sum(len(c.tokens) * (c.pos0 + (len(c.tokens) + 1) / 2) for c in chunks)
        swap.decode_s = (
            self.seconds_per_step + self.seconds_per_token * n + self.seconds_per_cell * cells
        )
        swap.side_done = self._side_step()
        return swap

    def _side_step(self) -> list[tuple[int, bool]]:
        """The side context works on while the step runs; a finished prompt's cells wait
        under its key like a swapped sequence's."""
        if not self.side_jobs:
            return []
        self.side_progress += self.side_tokens_per_step
        key, tokens = self.side_jobs[0]
        if self.side_progress < len(tokens):
            return []
        self.side_jobs.pop(0)
        self.side_progress = 0
        if key in self.lose_side:
            return [(key, False)]
        self.swapped[key] = self._new_cells(0, tokens)
        return [(key, True)]


def prompt_logprob(pos: int, token: int) -> float:
    """The fake's logprob of prompt `token` at position `pos`: the same however the prompt
    is chunked or recomputed."""
    return -0.001 * pos - 0.01 * token


def make_request(
    req_id: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    arrival: float = 0.0,
    stops: tuple[str, ...] = (),
    logprobs: bool = False,
    client: str | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    """A greedy request whose text comes from `token_bytes`; its own client unless told."""
    return Request(
        req_id=req_id,
        prompt_ids=list(prompt),
        params=SamplingParams(temperature=0, logprobs=logprobs, prompt_logprobs=prompt_logprobs),
        max_tokens=max_tokens,
        arrival_time=arrival,
        detok=IncrementalDetokenizer(token_bytes),
        stops=StopMatcher(stops),
        is_eog=is_eog,
        client=req_id if client is None else client,
    )
