"""Accounting for the KV pool: sequence ids and cells (one cell per token per sequence),
and the host-RAM swap space preempted sequences' cells go to.

The backend is a unified llama.cpp cache of `capacity` cells shared by all sequences;
the scheduler mirrors its use here so admission and preemption never need to ask it.

Cells have owners, and `used` counts each cell once, under its owner. Today every owner is
a sequence and owns its cells alone. The prefix cache adds a second kind: a cached prefix,
whose cells llama.cpp lets several sequences read (`seq_cp` is metadata-only in a unified
cache), held with a reference count of the sequences reading it. A sequence then owns only
the cells past its shared prefix; closing it drops a reference, and a prefix nobody reads
is free to evict — its cells count as reclaimable when admission asks what fits. The state
API saves every cell a sequence can see, its shared prefix too: a swapped sequence that
read one comes back owning a private copy, unless the restore drops that copy and reads
the cached prefix again (`seq_cp`) while it is still cached. Growth reserves, admission
and the swap space are all counted in owned cells, so none of them changes when owners
multiply.
"""

from __future__ import annotations

import math


class KVPool:
    def __init__(self, capacity: int, num_seqs: int) -> None:
        self.capacity = capacity
        self.num_seqs = num_seqs
        self._free_seqs = list(range(num_seqs - 1, -1, -1))  # pop() hands out 0 first
        self._cells: dict[int, int] = {}
        self.held: set[int] = set()  # ids of sequences kept as prefix cache (no own cells)
        self.cached = 0  # cells of the prefix cache, counted once however many read them
        self.used = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def num_free_seqs(self) -> int:
        return len(self._free_seqs)

    def open(self) -> int:
        """Take a free sequence id (caller checks `num_free_seqs` first)."""
        seq = self._free_seqs.pop()
        self._cells[seq] = 0
        return seq

    def grow(self, seq: int, n: int) -> None:
        """Reserve `n` more cells for `seq` (caller checks `free` first)."""
        if n > self.free:
            raise ValueError(f"KV pool: {n} cells asked, {self.free} free")
        self._cells[seq] += n
        self.used += n

    def shrink(self, seq: int, n: int) -> None:
        """Give back `n` cells reserved for a step that did not run."""
        self._cells[seq] -= n
        self.used -= n

    def close(self, seq: int) -> int:
        """Return a sequence id and all its cells; returns the cells freed."""
        n = self._cells.pop(seq)
        self.used -= n
        self._free_seqs.append(seq)
        return n

    def cells(self, seq: int) -> int:
        return self._cells[seq]

    def hold(self, seq: int, cached: int) -> None:
        """A finished sequence's id stays taken as a prefix-cache holder; its own cells go,
        `cached` of them to the cache."""
        self.used -= self._cells.pop(seq)
        self.held.add(seq)
        self.cache(cached)

    def unhold(self, seq: int) -> None:
        """A holder released by the prefix index: its id is free again."""
        self.held.remove(seq)
        self._free_seqs.append(seq)

    def cache(self, n: int) -> None:
        self.cached += n
        self.used += n

    @property
    def num_held(self) -> int:
        return len(self.held)

    def sanity_checks(self) -> None:
        assert self.used == sum(self._cells.values()) + self.cached, "cell count drifted"
        assert 0 <= self.used <= self.capacity, "pool over capacity"
        taken = len(self._cells) + len(self.held)
        assert len(self._free_seqs) + taken == self.num_seqs, "seq ids leaked"
        assert not set(self._free_seqs) & (set(self._cells) | self.held), "seq id free and taken"


class GrowthEstimate:
    """How much of its remaining `max_tokens` a running request is expected to still need
    in KV (SGLang's `new_token_ratio`): admission keeps that many cells for every running
    request, so a newcomer is not let in only to be preempted when the others grow.

    Requests mostly stop well before `max_tokens`, so the share starts at `INIT` and decays
    every step toward `FLOOR`; a preemption shows the reserve was short, and puts it back
    to 1 (everything they may still generate).
    """

    INIT = 0.7
    FLOOR = 0.1
    DECAY = 0.002  # per step
    CLIP = 4096  # remaining tokens counted per request at most (a default max_tokens is huge)

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.ratio = self.INIT if enabled else 0.0

    def cells(self, remaining_tokens: int) -> int:
        return math.ceil(self.ratio * min(max(remaining_tokens, 0), self.CLIP))

    def step(self) -> None:
        if self.enabled:
            self.ratio = max(self.FLOOR, self.ratio - self.DECAY)

    def preempted(self) -> None:
        if self.enabled:
            self.ratio = 1.0


class SwapSpace:
    """The host-RAM pool for preempted sequences' KV (`--swap-space`), counted in cells
    at the model's bytes per cell: a victim is swapped only if its cells fit, past which
    it is recomputed. Each swapped sequence has a key the engine stores its bytes under."""

    def __init__(self, capacity_cells: int) -> None:
        self.capacity = max(0, capacity_cells)
        self.used = 0
        self._held: dict[int, int] = {}  # key -> cells
        self._next_key = 0

    def fits(self, cells: int) -> bool:
        return 0 < cells <= self.capacity - self.used

    def take(self, cells: int) -> int:
        """Hold `cells` (caller checks `fits`); returns the swap key."""
        key = self._next_key
        self._next_key += 1
        self._held[key] = cells
        self.used += cells
        return key

    def give(self, key: int) -> int:
        """Release a key (restored, failed or dropped); returns its cells."""
        cells = self._held.pop(key)
        self.used -= cells
        return cells

    def sanity_checks(self) -> None:
        assert self.used == sum(self._held.values()), "swap cells drifted"
        assert 0 <= self.used <= self.capacity, "swap space over capacity"


class SwapCost:
    """Seconds to save a sequence's KV to host RAM and write it back on resume: the bytes
    both ways times the copy time per byte, learned from the engine's swaps and started
    from a prior measured on the slower of our machines. The average is of time per byte
    (weighted to the newest), so one slow copy counts at once and fast ones win back
    slowly: a wrong "swap" costs a stall, a wrong "recompute" only throughput."""

    PRIOR_BYTES_PER_S = 2e9
    GAIN = 0.3  # weight of the newest observation
    MIN_BYTES = 1 << 20  # smaller copies time the call overhead, not the rate

    def __init__(self, bytes_per_cell: int) -> None:
        self.bytes_per_cell = bytes_per_cell
        self.seconds_per_byte = 1.0 / self.PRIOR_BYTES_PER_S

    def seconds(self, cells: int) -> float:
        return 2 * cells * self.bytes_per_cell * self.seconds_per_byte

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes >= self.MIN_BYTES and seconds > 0:
            self.seconds_per_byte += self.GAIN * (seconds / nbytes - self.seconds_per_byte)
