"""A model's router pick counts kept between runs: what the server's telemetry sampled,
saved where its next start reads them.

The planner splits the experts' VRAM between resident layers and cache slots once, at load,
by a pick model (`engine.expert_split`); the cache's bank fills by misses unless it knows
which experts the traffic picks. Both want the traffic's counts, which only a running
server has. So a server saves its sampled counts (`--state-dir`, default
`~/.local/state/one-gpu`) every few minutes and when it stops, and its next start plans and
fills its bank from them — without `--pick-counts`, and fitted to its own traffic.

One file a model file: its name and a digest of its path, size and time of writing. A save
keeps half of what the last run saved beside this run's counts, so older traffic fades over
restarts rather than vanishing after a short run.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import msgspec
import numpy as np

from engine.expert_split import PickCounts

log = logging.getLogger(__name__)
CARRY = 0.5  # the share of the previous runs' counts a save keeps


def default_state_dir() -> Path:
    """`$ONEGPU_STATE_DIR`, else `$XDG_STATE_HOME/one-gpu`, else `~/.local/state/one-gpu`."""
    if env := os.environ.get("ONEGPU_STATE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "one-gpu"


def counts_path(state_dir: Path, model_path: str | Path) -> Path:
    """The model's file: its name, and a digest of where it is, its size and when it was
    written (another file of the same name is another model)."""
    model = Path(model_path).resolve()
    st = model.stat()
    key = hashlib.sha1(f"{model}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return state_dir / "picks" / f"{model.name}-{key}.json"


class PickStore:
    """The saved counts of one model: `prior` (read at start, None if there are none that
    fit the model's shape) and `save(counts)`."""

    def __init__(self, path: Path, n_layer: int, n_expert: int) -> None:
        self.path = path
        self.prior = _read(path, n_layer, n_expert)

    def save(self, counts: np.ndarray) -> None:
        """This run's counts plus the prior's carried share, written atomically."""
        if not counts.any():
            return
        total = counts.astype(np.int64)
        if self.prior is not None and self.prior.shape == total.shape:
            total = total + (self.prior * CARRY).astype(np.int64)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(PickCounts(counts=total.tolist())))
        tmp.replace(self.path)


def _read(path: Path, n_layer: int, n_expert: int) -> np.ndarray | None:
    try:
        counts = msgspec.json.decode(path.read_bytes(), type=PickCounts).counts
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # a damaged file: planned as if there were none
        log.warning("ignoring saved pick counts %s: %s", path, e)
        return None
    table = np.asarray(counts, dtype=np.int64)
    if table.shape != (n_layer, n_expert):
        log.warning("ignoring saved pick counts %s: %s, not this model's %s", path,
                    table.shape, (n_layer, n_expert))  # fmt: skip
        return None
    return table


def top_experts(counts: np.ndarray, layer: int, n: int) -> list[int]:
    """The `n` most picked experts of a layer, most picked first (only those picked)."""
    row = counts[layer]
    order = np.argsort(-row, kind="stable")[:n]
    return [int(e) for e in order if row[e] > 0]
