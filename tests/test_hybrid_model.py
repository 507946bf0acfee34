"""The cost model of hybrid decode (`bench.hybrid_model`) and the layouts the expert-cache
A/B measures (`bench.expert_cache_ab`): what the reference-width figures rest on."""

from __future__ import annotations

import re

import pytest

from bench.expert_cache_ab import in_ram_regex, split_of, variants
from bench.hybrid_model import (
    BUS_S_PER_BYTE,
    MEASURED_CURVE,
    Constants,
    Layout,
    Row,
    Shape,
    fit,
    measured_hit,
    reference,
    rows_of,
    step_time,
)
from bench.reference_model import deepseek_like

SHAPE = Shape(n_moe=6, n_expert=384, k=6, expert_bytes=14.3e6, other_bytes=4.2e9)
TRUE = Constants(t0=2e-3, g=1 / 2.0e12, c=1 / 40e9, m=1 / 30e9, r=150e-6)
LAYOUTS = [
    Layout(resident=2.33, in_ram=3.67, mapped=True),  # llama-server mapping the file
    Layout(resident=6),
    Layout(resident=0, cached=6, hit=0.995),
    Layout(resident=0, cached=6, hit=0.7),
    Layout(resident=2, cached=4, hit=0.8),
    Layout(resident=2.33, in_ram=3.67),
    Layout(resident=0, in_ram=6),
]


def _rows(k: Constants, noise: float = 0.0) -> list[Row]:
    out = []
    for i, lay in enumerate(LAYOUTS):
        for j, users in enumerate((1, 4, 8)):
            wobble = 1 + noise * ((-1) ** (i + j))
            out.append(Row(f"row {i}", lay, users, wobble / step_time(k, SHAPE, lay, users)))
    return out


def test_the_fit_recovers_the_constants_that_made_the_rows() -> None:
    got = fit(SHAPE, _rows(TRUE))
    for name in ("t0", "g", "c", "m", "r"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-3), name
    noisy = fit(SHAPE, _rows(TRUE, noise=0.05))  # +-5% on alternate rows
    for r in _rows(TRUE):
        model = 1 / step_time(noisy, SHAPE, r.layout, r.users)
        assert model == pytest.approx(r.per_user_tok_s, rel=0.1)


def test_what_each_layout_costs_follows_the_bytes_and_the_round_trips() -> None:
    all_gpu = step_time(TRUE, SHAPE, Layout(resident=6), 1)
    cached = Layout(resident=0, cached=6, hit=1.0)
    # every pick a hit: the GPU's time plus one round trip a layer, unless all-hit layers
    # skip the CPU (the change the model can price before it is made)
    assert step_time(TRUE, SHAPE, cached, 1) == pytest.approx(all_gpu + 6 * TRUE.r)
    assert step_time(TRUE, SHAPE, cached, 1, split_all_hit=False) == pytest.approx(all_gpu)
    # more users read more distinct experts; fewer hits move reads to the slower side
    low = Layout(resident=0, cached=6, hit=0.5)
    assert step_time(TRUE, SHAPE, low, 8) > step_time(TRUE, SHAPE, low, 1)
    assert step_time(TRUE, SHAPE, low, 1) > step_time(TRUE, SHAPE, cached, 1)
    assert SHAPE.distinct(1) == pytest.approx(6) and SHAPE.distinct(10**6) == pytest.approx(384)
    # misses read by the GPU over the bus (patch 0006): no round trip, each missed pick's
    # bytes at the bus's rate — all-GPU where every pick hits, dearer with users than the
    # CPU's reads of distinct experts
    on_gpu = Layout(resident=0, cached=6, hit=1.0, misses_on_gpu=True)
    assert step_time(TRUE, SHAPE, on_gpu, 1) == pytest.approx(all_gpu)
    half = Layout(resident=0, cached=6, hit=0.5, misses_on_gpu=True)
    bus = 6 * 0.5 * 6 * SHAPE.expert_bytes * BUS_S_PER_BYTE  # 1 user: 3 missed picks a layer
    assert step_time(TRUE, SHAPE, half, 1) == pytest.approx(
        step_time(TRUE, SHAPE, Layout(resident=0, cached=6, hit=0.5), 1, split_all_hit=False)
        - 6 * 0.5 * SHAPE.distinct(1) * SHAPE.expert_bytes * TRUE.c
        - 6 * (1 - 0.5**6) * TRUE.r
        + bus
    )


def test_the_measured_curve_goes_through_the_real_model_s_points() -> None:
    for fraction, hit in MEASURED_CURVE:
        assert measured_hit(fraction) == pytest.approx(hit)
    fractions = [0.01 * i for i in range(1, 101)]
    hits = [measured_hit(f) for f in fractions]
    assert hits == sorted(hits) and all(f <= h <= 1 for f, h in zip(fractions, hits, strict=True))
    assert measured_hit(0.0) == 0.0 and measured_hit(1.0) == 1.0


def test_the_reference_model_s_prediction_says_what_it_is_and_where_time_goes() -> None:
    text = reference(TRUE)
    assert "A model, not a measurement" in text
    rows = {
        (m.group(1), int(m.group(2))): float(m.group(3))
        for m in re.finditer(r"^\| ([^|]+) \| (\d) \| ([\d.]+) \|", text, re.M)
    }
    assert set(rows) == {(label, n) for label in ("whole layers", "cache",
                         "cache, all-hit layers skip the CPU",
                         "cache, misses read by the GPU over the bus") for n in (1, 8)}  # fmt: skip
    for n in (1, 8):  # a cache in the same VRAM serves more picks on the GPU: faster
        assert rows["cache", n] > rows["whole layers", n]
        assert rows["cache, all-hit layers skip the CPU", n] >= rows["cache", n]
    assert rows["cache", 8] > rows["cache", 1]  # 8 users' output beats one user's
    assert Shape.of(deepseek_like()).n_moe == 44


def test_the_layouts_of_a_fractional_vram_size_split_layers_by_tensor() -> None:
    """7 tensors of a 6-layer model (38.9% of its expert bytes): layers 4 and 5 whole on
    the GPU and layer 3's down; the regex both servers get puts exactly the rest in RAM."""
    names = [f"blk.{i}.ffn_{w}_exps.weight" for i in range(6) for w in ("gate", "up", "down")]
    rx = re.compile(in_ram_regex(6, 7))
    in_ram = [n for n in names if rx.search(n)]
    assert len(in_ram) == 11
    assert "blk.3.ffn_down_exps.weight" not in in_ram and "blk.3.ffn_up_exps.weight" in in_ram
    assert not any(n.startswith(("blk.4.", "blk.5.")) for n in in_ram)
    assert len([n for n in names if re.compile(in_ram_regex(6, 6)).search(n)]) == 12
    rows = variants(6, 384, 6, 7, admission=3.0)
    assert rows[0].peer and rows[0].args == ["-ot", f"{in_ram_regex(6, 7)}=CPU"]
    assert rows[2].args[:3] == ["--cpu-moe", "--expert-cache-slots", str(7 * 384 // 18 - 6)]
    whole = variants(6, 384, 6, 6, admission=3.0)
    assert whole[0].args == ["--n-cpu-moe", "4"]
    read = variants(6, 384, 6, 6, admission=3.0, peer_read=True)  # llama-server's best of two
    assert [v.peer for v in read] == [True, True, False, False, False]
    assert read[1].args == ["--n-cpu-moe", "4", "-lm", "none"]  # (this build: no --no-mmap)


def test_a_measured_row_s_split_is_what_the_fit_reads() -> None:
    rows = variants(6, 384, 6, 7, admission=3.0)
    peer, whole, slots, auto = rows
    assert split_of(peer, 6, 0.0, 0) == {"resident": 7 / 3, "cached": 0,
                                         "in_ram": 6 - 7 / 3, "hit": 0.0,
                                         "mapped": True}  # fmt: skip
    # llama-server reading the model (`-lm none`) and ours: their own buffers, not the file
    read = variants(6, 384, 6, 7, admission=3.0, peer_read=True)[1]
    assert split_of(read, 6, 0.0, 0)["mapped"] is False
    assert split_of(whole, 6, 0.0, 0)["mapped"] is False
    assert split_of(slots, 6, 0.8, 6)["cached"] == 6 and split_of(slots, 6, 0.8, 6)["hit"] == 0.8
    assert split_of(auto, 6, 0.9, 4)["resident"] == 2  # the planner kept 2 layers whole
    result = [
        {"routing": "measured", "layout": whole.label, "split": split_of(whole, 6, 0, 0),
         "per_user": {"1": [10.0, 12.0, 11.0], "8": [3.0]}},
        {"routing": "measured", "layout": slots.label, "split": split_of(slots, 6, 0.5, 6),
         "hit_by_users": {"1": 0.7, "8": 0.4}, "per_user": {"1": [9.0], "8": [4.0]}},
    ]  # fmt: skip
    got = rows_of(result)
    assert [(r.users, r.per_user_tok_s) for r in got] == [(1, 11.0), (8, 3.0), (1, 9.0), (8, 4.0)]
    assert got[0].layout == Layout(resident=7 / 3, cached=0, in_ram=6 - 7 / 3, hit=0.0)
    # the same layout mapped costs the mapped constant's time where the read one costs c's
    lay = got[0].layout
    mapped = Layout(resident=lay.resident, in_ram=lay.in_ram, mapped=True)
    ram = lay.in_ram * SHAPE.distinct(1) * SHAPE.expert_bytes
    assert step_time(TRUE, SHAPE, mapped, 1) - step_time(TRUE, SHAPE, lay, 1) == pytest.approx(
        ram * (TRUE.m - TRUE.c)
    )
    # each N's own hit share: 8 users' picks spread over more experts than one user's
    assert [r.layout.hit for r in got[2:]] == [0.7, 0.4]
