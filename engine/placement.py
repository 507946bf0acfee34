"""Tensor placement at load: llama.cpp's tensor buffer-type overrides, from ctypes.

`llama_model_params.tensor_buft_overrides` is a NULL-terminated array of
`{const char *pattern; ggml_backend_buffer_type_t buft}`; a tensor whose name the regex
*searches* successfully is allocated in that buffer type (llama.cpp's `-ot`, `--cpu-moe`).
llama-cpp-python types the field as an unused `c_void_p`, so the array is built here and
must stay alive until the load returns. The CPU buffer type must be the very pointer
llama.cpp compares against: it comes from the `libggml` already loaded with `libllama`
(FINDINGS, "Placement": a second copy of the library gives another pointer).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# llama.cpp's own `--cpu-moe`: every routed expert's weights (not the shared experts).
CPU_MOE = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
_DEVICE_CPU = 0  # enum ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU


class _Override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def libggml(ll: Any) -> ctypes.CDLL:
    """The libggml that libllama uses: by soname (already loaded, so the same copy)."""
    try:
        return ctypes.CDLL("libggml.so.0")
    except OSError:
        here = Path(ll.__file__).parent / "lib" / "libggml.so.0"
        return ctypes.CDLL(str(here))


GPU_TYPES = (1, 2)  # GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU


def ggml_devices(ll: Any) -> ctypes.CDLL:
    """`libggml` with its backend-device calls typed (the devices llama.cpp uses)."""
    g = libggml(ll)
    g.ggml_backend_dev_count.restype = ctypes.c_size_t
    g.ggml_backend_dev_get.restype = ctypes.c_void_p
    g.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    g.ggml_backend_dev_type.restype = ctypes.c_int
    g.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    g.ggml_backend_dev_name.restype = ctypes.c_char_p
    g.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    return g


def gpu_host_buffer_type(g: ctypes.CDLL) -> int | None:
    """The first GPU's host buffer type (page-locked memory: `cudaHostAlloc` on CUDA), or
    None without a GPU. `g` is `ggml_devices(ll)`."""
    g.ggml_backend_dev_host_buffer_type.restype = ctypes.c_void_p
    g.ggml_backend_dev_host_buffer_type.argtypes = [ctypes.c_void_p]
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        if g.ggml_backend_dev_type(dev) in GPU_TYPES:
            buft: int | None = g.ggml_backend_dev_host_buffer_type(dev)
            return buft
    return None


def cpu_buffer_type(ll: Any) -> int:
    ggml = libggml(ll)
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    dev = ggml.ggml_backend_dev_by_type(_DEVICE_CPU)
    if not dev:
        raise RuntimeError("ggml has no CPU device")
    buft: int = ggml.ggml_backend_dev_buffer_type(dev)
    return buft


class CpuOverrides:
    """Tensors matching any of `patterns` stay in host RAM; pass `.pointer` as
    `tensor_buft_overrides` and keep this object alive until the model has loaded.

    llama.cpp takes an override to the CPU buffer type as "host RAM" and picks the buffer
    type itself: on a GPU host, read (not mapped), the GPU's page-locked host memory."""

    def __init__(self, ll: Any, patterns: list[str]) -> None:
        buft = cpu_buffer_type(ll)
        self._patterns = [p.encode() for p in patterns]  # owned: the array points into them
        self._array = (_Override * (len(patterns) + 1))()
        for i, p in enumerate(self._patterns):
            self._array[i].pattern = p
            self._array[i].buft = buft
        self._array[len(patterns)].pattern = None  # terminator
        log.info("tensors in host RAM: %s", " | ".join(patterns))

    @property
    def pointer(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(ctypes.addressof(self._array))
