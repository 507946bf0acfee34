"""How far a model load has got, and a way to stop it from another thread.

A model of hundreds of GB takes minutes to read; an operator who stops the server in that
time (a wrong flag, a rolled-back deploy) should not wait for the load to finish first.
llama.cpp calls a progress callback after each tensor it loads and abandons the load when
the callback returns false: the callback here records the fraction done (exported while the
server loads) and returns false once `cancel()` has been called, e.g. from a signal handler.
"""

from __future__ import annotations

import threading
from typing import Any


class LoadProgress:
    def __init__(self) -> None:
        self.fraction = 0.0  # of the weights' bytes loaded (llama.cpp's measure)
        self._cancel = threading.Event()
        self._callback: Any = None  # the ctypes callback: alive as long as this object

    def cancel(self) -> None:
        """Abandon the load at the next tensor (safe from any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def callback(self, ll: Any) -> Any:
        """The `llama_progress_callback` to put in the model's parameters."""
        if self._callback is None:

            def on_progress(fraction: float, _user: Any) -> bool:
                self.fraction = fraction
                return not self._cancel.is_set()

            self._callback = ll.llama_progress_callback(on_progress)
        return self._callback
