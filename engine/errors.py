"""Typed failures of the backend, one class per `llama_decode` outcome that callers handle."""


class EngineError(Exception):
    """Base class of every engine failure."""


class ModelLoadError(EngineError):
    """The GGUF could not be loaded or a context could not be created."""


class ModelLoadCancelled(ModelLoadError):
    """The load was abandoned on request (`LoadProgress.cancel`): a stop, not a failure."""


class KVCacheFull(EngineError):
    """`llama_decode` returned 1: no KV slot for the batch; the cache is as before the call."""


class DecodeAborted(EngineError):
    """`llama_decode` returned 2: the abort callback stopped the step."""


class InvalidBatch(EngineError):
    """`llama_decode` returned -1 (or our own check refused the batch before submitting it)."""


class BackendError(EngineError):
    """`llama_decode` returned < -1: a compute error inside ggml."""


def raise_for_decode(rc: int) -> None:
    """Map a `llama_decode` return code to its exception; 0 returns normally."""
    if rc == 0:
        return
    if rc == 1:
        raise KVCacheFull("no KV cache slot for the batch")
    if rc == 2:
        raise DecodeAborted("decode aborted")
    if rc == -1:
        raise InvalidBatch("llama_decode rejected the batch")
    raise BackendError(f"llama_decode failed with code {rc}")


class GrammarError(EngineError):
    """A response format or tool schema that cannot be compiled into a grammar."""
