"""engine.pick_store: the router pick counts a server keeps for its next start."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from api.server.cli import _pick_counts
from engine.pick_store import PickStore, counts_path, top_experts


def test_a_save_keeps_half_of_the_earlier_runs_and_this_run_s_counts(tmp_path: Path) -> None:
    path = tmp_path / "picks" / "m.json"
    assert PickStore(path, 2, 4).prior is None  # nothing saved yet
    PickStore(path, 2, 4).save(np.array([[8, 0, 2, 0], [0, 4, 0, 0]]))
    store = PickStore(path, 2, 4)
    assert store.prior is not None and store.prior.tolist() == [[8, 0, 2, 0], [0, 4, 0, 0]]
    store.save(np.array([[0, 6, 0, 0], [0, 0, 0, 0]]))
    assert PickStore(path, 2, 4).prior.tolist() == [[4, 6, 1, 0], [0, 2, 0, 0]]  # type: ignore[union-attr]
    store.save(np.zeros((2, 4), dtype=np.int64))  # a run that sampled nothing keeps the file
    assert PickStore(path, 2, 4).prior.tolist() == [[4, 6, 1, 0], [0, 2, 0, 0]]  # type: ignore[union-attr]


def test_counts_of_another_shape_or_a_damaged_file_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    PickStore(path, 2, 4).save(np.ones((2, 4), dtype=np.int64))
    assert PickStore(path, 3, 4).prior is None
    path.write_text('{"counts": ')
    assert PickStore(path, 2, 4).prior is None


def test_another_file_of_the_same_name_is_another_model(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"x" * 10)
    assert counts_path(tmp_path, a) != counts_path(tmp_path, b)
    before = counts_path(tmp_path, a)
    a.write_bytes(b"y" * 11)  # rewritten: another model
    assert counts_path(tmp_path, a) != before


def test_the_most_picked_experts_of_a_layer_come_first() -> None:
    counts = np.array([[1, 9, 0, 5], [0, 0, 0, 0]])
    assert top_experts(counts, 0, 2) == [1, 3]
    assert top_experts(counts, 0, 4) == [1, 3, 0]  # never picked: not loaded
    assert top_experts(counts, 1, 2) == []


def test_serve_and_plan_read_the_saved_counts_unless_told_otherwise(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"gguf")
    state = tmp_path / "state"
    args = argparse.Namespace(pick_counts=None, state_dir=state)
    assert _pick_counts(args, str(model)) is None  # nothing saved
    saved = counts_path(state, model)
    PickStore(saved, 1, 2).save(np.array([[3, 1]]))
    assert _pick_counts(args, str(model)) == saved
    given = tmp_path / "given.json"
    assert _pick_counts(argparse.Namespace(pick_counts=given, state_dir=state), str(model)) == given
    assert _pick_counts(argparse.Namespace(pick_counts=None, state_dir=None), str(model)) is None
    assert os.environ.get("ONEGPU_STATE_DIR")  # (the suite's servers save under its own)
