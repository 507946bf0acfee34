"""How far a model load has got, and a way to stop it from another thread.

A model of hundreds of GB takes minutes to read; an operator who stops the server in that
time (a wrong flag, a rolled-back deploy) should not wait for the load to finish first.
llama.cpp calls a progress callback after each tensor it loads and abandons the load when
the callback returns false: the callback here records the fraction done (exported while the
server loads) and returns false once `cancel()` has been called, e.g. from a signal handler.
Every tenth of the weights it logs how far the load has got and at what rate, for an
operator watching the log of a load that takes minutes. With the file mapped (the
default) llama.cpp first has the kernel read it in whole (MAP_POPULATE) and reports the
first tensor only then: progress stays at 0 and a stop waits for that read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class LoadProgress:
    def __init__(self, total_bytes: int = 0) -> None:
        self.fraction = 0.0  # of the weights' bytes loaded (llama.cpp's measure)
        self.total_bytes = total_bytes  # the model file's size, for the logged rate
        self._logged = 0  # tenths logged
        self._t0: float | None = None
        self._cancel = threading.Event()
        self._callback: Any = None  # the ctypes callback: alive as long as this object

    def cancel(self) -> None:
        """Abandon the load at the next tensor (safe from any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def callback(self, ll: Any) -> Any:
        """The `llama_progress_callback` to put in the model's parameters, just before the
        load starts (its clock starts here: a mapped file is read in before the first
        tensor is reported)."""
        self._t0 = time.monotonic()
        if self._callback is None:

            def on_progress(fraction: float, _user: Any) -> bool:
                self.fraction = fraction
                try:
                    self._log(fraction)
                except Exception:  # (an exception here would read as "stop the load")
                    log.exception("load progress")
                return not self._cancel.is_set()

            self._callback = ll.llama_progress_callback(on_progress)
        return self._callback

    def _log(self, fraction: float) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        tenths = int(fraction * 10 + 1e-6)
        if tenths <= self._logged:
            return
        self._logged = tenths
        took = now - self._t0
        rate = (f", {fraction * self.total_bytes / took / 2**30:.2f} GiB/s"
                if self.total_bytes and took > 0 else "")  # fmt: skip
        log.info("loading the weights: %d%% in %.1f s%s", 10 * tenths, took, rate)
