"""What the server says about the memory holding its weights (`engine.weight_buffers`):
read from llama.cpp's load summary, and a warning when the driver did not page-lock weights
read into host RAM on a GPU host (it starts and serves regardless)."""

from __future__ import annotations

from engine.weight_buffers import MiB, parse, unpinned_warning

PINNED = [
    "load_tensors: offloading output layer to GPU",
    "load_tensors:        CUDA0 model buffer size = 12950.25 MiB",
    "load_tensors:    CUDA_Host model buffer size = 23811.50 MiB",
]
REFUSED = [  # the same load when cudaMallocHost failed: ggml fell back to plain memory
    "load_tensors:        CUDA0 model buffer size = 12950.25 MiB",
    "load_tensors:          CPU model buffer size = 23811.50 MiB",
]


def test_the_load_summary_gives_bytes_by_kind_of_memory() -> None:
    got = parse(PINNED)
    assert got.by_buffer == {"CUDA0": round(12950.25 * MiB), "CUDA_Host": round(23811.5 * MiB)}
    assert (got.pinned, got.plain, got.mapped) == (round(23811.5 * MiB), 0, 0)
    mapped = parse(["load_tensors:   CPU_Mapped model buffer size =   512.00 MiB"])
    assert (mapped.mapped, mapped.plain) == (512 * MiB, 0)
    assert "CUDA_Host 23,812 MiB" in got.describe()


def test_weights_the_driver_would_not_lock_are_said_once_and_only_then() -> None:
    refused = parse(REFUSED)
    warning = unpinned_warning(refused, gpu=True, read=True)
    assert warning is not None and "not page-locked" in warning and "23,812 MiB" in warning
    assert unpinned_warning(parse(PINNED), gpu=True, read=True) is None
    assert unpinned_warning(refused, gpu=False, read=True) is None  # a CPU host: nothing to lock
    assert unpinned_warning(refused, gpu=True, read=False) is None  # mapped: never locked
