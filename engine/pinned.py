"""A page-locked host buffer for KV moved between a GPU and host memory.

A sequence's KV copied to or from pageable memory goes through the driver's staging
buffers: on an H100 host, saving a 16K prompt's 1.5 GiB from the side context took 873 ms
and writing it into the main context 304 ms, and while the pageable save ran the main
context's decode step waited for it (890 ms, 156 of them its own). Page-locked memory is
copied by DMA at the link's rate. Pinning is itself slow and freeing it synchronizes the
device, so one buffer is allocated once, when the server starts, sized for the largest
sequence its owner will save, and lent to one saved sequence at a time; when it is lent
out (or too small), the caller falls back to plain memory. The memory comes from ggml's
host buffer type of the first GPU (`cudaHostAlloc` on CUDA); without a GPU there is none
(`lend` answers None). The buffer lives as long as the process: its owner does too.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

from engine.placement import ggml_devices, gpu_host_buffer_type

log = logging.getLogger(__name__)


class HostBytes:
    """A saved sequence's bytes in host memory, and how its memory goes back."""

    def __init__(
        self, view: ctypes.Array[ctypes.c_uint8], release: Callable[[], None] | None = None
    ) -> None:
        self.view = view
        self._release = release

    def __len__(self) -> int:
        return len(self.view)

    def free(self) -> None:
        """Done with the bytes: lent memory goes back to its lender (once)."""
        if self._release is not None:
            self._release()
            self._release = None


def plain(size: int) -> HostBytes:
    """Pageable memory (zeroed lazily by the kernel: calloc maps fresh pages)."""
    return HostBytes((ctypes.c_uint8 * size)())


class PinnedStaging:
    """One page-locked buffer of `capacity` bytes, lent to one sequence at a time."""

    def __init__(self, ll: Any, capacity: int) -> None:
        self._g = g = ggml_devices(ll)
        g.ggml_backend_buft_alloc_buffer.restype = ctypes.c_void_p
        g.ggml_backend_buft_alloc_buffer.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        g.ggml_backend_buffer_get_base.restype = ctypes.c_void_p
        g.ggml_backend_buffer_get_base.argtypes = [ctypes.c_void_p]
        buft = gpu_host_buffer_type(g)
        self._base = 0
        self.capacity = 0
        self._lent = False
        if buft:
            buf = g.ggml_backend_buft_alloc_buffer(buft, capacity)
            if buf:
                self._base, self.capacity = g.ggml_backend_buffer_get_base(buf), capacity
            else:
                log.warning("no page-locked host buffer of %d bytes: plain memory", capacity)

    def lend(self, size: int) -> HostBytes | None:
        """`size` bytes of the buffer, or None: no GPU host memory, the buffer is lent
        out, or it is too small (the sequence then goes to plain memory)."""
        if not self._base or self._lent or size > self.capacity:
            return None
        self._lent = True
        return HostBytes((ctypes.c_uint8 * size).from_address(self._base), self._returned)

    def _returned(self) -> None:
        self._lent = False
