"""The one door to llama.cpp's C API.

`llama_cpp.llama_cpp` (llama-cpp-python's low-level ctypes bindings) is imported here and
nowhere else, after libstdc++ has been loaded with RTLD_GLOBAL: CUDA builds otherwise bind
C++ symbols to copies inside libggml-cuda and crash in `llama_model::print_info` (FINDINGS).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# llama.cpp is chatty at INFO (every GGUF key at load): keep its INFO at our DEBUG.
_LEVEL = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}


@functools.cache
def llama() -> ModuleType:
    """Import the bindings once, with libstdc++ global and llama.cpp's log routed to `logging`."""
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:  # not fatal on CPU builds; CUDA builds would crash later at load
        log.warning("could not load %s globally", name)
    import llama_cpp.llama_cpp as ll

    ll.llama_log_set(_log_callback(ll), ctypes.c_void_p(0))
    ll.llama_backend_init()
    return ll


def _log_callback(ll: Any) -> Any:
    """Route llama.cpp's log lines to the `llama.cpp` logger (kept alive by the cache)."""
    logger = logging.getLogger("llama.cpp")
    buf: list[str] = []

    def on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        buf.append(text.decode("utf-8", "replace"))
        if buf[-1].endswith("\n"):
            line = "".join(buf).rstrip()
            buf.clear()
            if line:
                for tap in _LINE_TAPS:
                    tap(line)
                logger.log(_LEVEL.get(level, logging.DEBUG), "%s", line)

    cb = ll.llama_log_callback(on_log)
    _KEEPALIVE.append(cb)
    return cb


_KEEPALIVE: list[Any] = []
_LINE_TAPS: list[Callable[[str], None]] = []


@contextlib.contextmanager
def llama_log_lines() -> Iterator[list[str]]:
    """Every line llama.cpp logs meanwhile, whatever its level (the load's summary of its
    buffers is logged at llama.cpp's info level, which the server's log leaves out)."""
    lines: list[str] = []
    _LINE_TAPS.append(lines.append)
    try:
        yield lines
    finally:
        _LINE_TAPS.remove(lines.append)
