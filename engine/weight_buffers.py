"""Which kinds of memory hold the model's weights, as llama.cpp allocated them at the load.

With weights in host RAM on a GPU host the server reads the file (not mapped) into the
GPU's host buffer type, page-locked memory (`cudaMallocHost`): the GPU copies from it by
DMA, which the routed-expert cache's uploads and llama.cpp's own prompt batches rely on.
The driver can refuse (not enough lockable memory, `GGML_CUDA_NO_PINNED` set): ggml then
falls back to plain memory without a word at its default log level, the server starts
and runs, only slower. This module reads llama.cpp's per-buffer summary of the load
("CUDA_Host model buffer size = ... MiB") so that the server can say what it got — the
bytes by buffer in its log and in `onegpu_weight_buffer_bytes`, and a warning when
weights meant to be page-locked are not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

MiB = 1 << 20
_LINE = re.compile(r"(\S+) model buffer size = +([\d.]+) MiB")


class WeightBuffers(msgspec.Struct, frozen=True):
    """Bytes of weights by llama.cpp buffer name (`CUDA0`, `CUDA_Host`, `CPU_Mapped`,
    `CPU`, a repacking type such as `CPU_REPACK`)."""

    by_buffer: dict[str, int]

    @property
    def pinned(self) -> int:
        """Page-locked host memory (a GPU backend's host buffer type)."""
        return sum(v for k, v in self.by_buffer.items() if k.endswith("_Host"))

    @property
    def mapped(self) -> int:
        return sum(v for k, v in self.by_buffer.items() if k.endswith("_Mapped"))

    @property
    def plain(self) -> int:
        """Host memory neither page-locked nor mapped: read into ordinary pages."""
        return sum(v for k, v in self.by_buffer.items() if k.startswith("CPU")
                   and not k.endswith("_Mapped"))  # fmt: skip

    def describe(self) -> str:
        return ", ".join(f"{k} {v / MiB:,.0f} MiB" for k, v in sorted(self.by_buffer.items()))


def parse(lines: Iterable[str]) -> WeightBuffers:
    """The load's buffer summary from llama.cpp's log lines (the last figure per buffer)."""
    out: dict[str, int] = {}
    for line in lines:
        m = _LINE.search(line)
        if m:
            out[m.group(1)] = round(float(m.group(2)) * MiB)
    return WeightBuffers(out)


def unpinned_warning(buffers: WeightBuffers, gpu: bool, read: bool) -> str | None:
    """What to warn about, if anything: on a GPU host, weights read into host RAM that is
    not page-locked (the driver refused, or pinning was turned off)."""
    if not gpu or not read or buffers.plain == 0 or buffers.pinned > 0:
        return None
    return (
        f"weights in host RAM are in plain memory, not page-locked ({buffers.plain / MiB:,.0f} "
        "MiB): the driver refused to lock them (or GGML_CUDA_NO_PINNED is set); the server "
        "runs, but the GPU's copies from them go through a staging buffer and are slower"
    )
