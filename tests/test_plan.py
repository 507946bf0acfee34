"""The placement planner (pure): the reference's own case, refusals with their numbers,
budgets never exceeded over random shapes, the regexes that apply a plan, saved plans,
sizes, and the header reader on a real GGUF."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.reference_model import REFERENCE_OPTS, deepseek_like
from engine.gguf_meta import ModelMeta, TensorInfo, read_meta
from engine.plan import (
    Budgets,
    GiB,
    Plan,
    PlanDoesNotFit,
    PlanOptions,
    cpu_patterns,
    format_plan,
    make_plan,
    parse_size,
    plan_from_json,
    plan_to_json,
    reserves,
    vram_for_expert_share,
)
from tests.tiny_gguf import Shape, write_qwen3moe

GB = 10**9
EXPERT = re.compile(r"_(ch|)exps\.")


def _assert_within(plan: Plan) -> None:
    assert plan.vram_used <= plan.budgets.vram
    assert plan.ram_used <= plan.budgets.ram


def test_reference_case_fits_with_the_non_expert_part_on_the_gpu() -> None:
    meta = deepseek_like()
    assert abs(meta.n_params - 763e9) / 763e9 < 0.01
    assert abs(meta.nbytes - 264.5 * GB) / (264.5 * GB) < 0.01
    plan = make_plan(meta, Budgets(vram=96 * GB, ram=280 * GB), REFERENCE_OPTS)
    _assert_within(plan)
    for t in plan.tensors:
        if not EXPERT.search(t.name) and t.name != "token_embd.weight":
            assert t.device == "gpu", t.name
    experts = [t for t in plan.tensors if EXPERT.search(t.name)]
    on_gpu = sum(t.nbytes for t in experts if t.device == "gpu")
    # The GPU is filled: what is left of the budget cannot hold one more expert tensor.
    left = plan.budgets.vram - plan.vram_used
    assert on_gpu > 40 * GB and all(t.nbytes > left for t in experts if t.device == "ram")
    # Whole layers from the last one down (llama.cpp's --n-cpu-moe keeps the first N).
    assert plan.expert_layers_on_gpu > 0
    last = [t for t in experts if t.name.startswith("blk.46.")]
    assert all(t.device == "gpu" for t in last)
    text = format_plan(plan)
    assert "routed experts" in text and "of 89.41 GiB budget" in text


def test_reference_model_on_128_gb_of_ram_is_refused_with_the_numbers() -> None:
    meta = deepseek_like()
    with pytest.raises(PlanDoesNotFit) as e:
        make_plan(meta, Budgets(vram=96 * GB, ram=128 * GB), REFERENCE_OPTS)
    err = e.value
    assert err.resource == "RAM" and err.available == 128 * GB
    # Needed: everything the GPU cannot take, plus host buffers and the margin.
    fits = make_plan(meta, Budgets(vram=96 * GB, ram=10**15), REFERENCE_OPTS)
    assert err.needed == fits.ram_used and err.shortfall == fits.ram_used - 128 * GB
    msg = str(err)
    assert f"short by {err.shortfall / GiB:.2f} GiB" in msg and "more host RAM" in msg


def test_a_gpu_too_small_for_the_non_expert_part_and_kv_is_refused() -> None:
    meta = deepseek_like()
    with pytest.raises(PlanDoesNotFit) as e:
        make_plan(meta, Budgets(vram=24 * GB, ram=600 * GB), REFERENCE_OPTS)
    err = e.value
    assert err.resource == "VRAM" and err.shortfall > 0
    # The KV cache for 256K tokens is part of what is needed; fewer tokens would fit.
    assert "KV cache" in str(err) and "smaller context" in str(err)
    m = re.search(r"at most (\d+) KV tokens", str(err))
    assert m is not None
    fits = int(m.group(1))
    assert 0 < fits < REFERENCE_OPTS.kv_tokens
    opts = msgspec.structs.replace(REFERENCE_OPTS, kv_tokens=fits)
    make_plan(meta, Budgets(vram=24 * GB, ram=600 * GB), opts)  # the advice holds
    with pytest.raises(PlanDoesNotFit):
        make_plan(
            meta,
            Budgets(vram=24 * GB, ram=600 * GB),
            msgspec.structs.replace(REFERENCE_OPTS, kv_tokens=fits + 1),
        )


# ---- property tests over random shapes and budgets -------------------------------------------
@st.composite
def metas(draw: st.DrawFn) -> ModelMeta:
    n_layer = draw(st.integers(1, 12))
    n_expert = draw(st.sampled_from([0, 4, 8, 64]))
    used = draw(st.integers(1, max(1, n_expert // 2))) if n_expert else 0
    size = st.integers(1, 5 * 10**8)
    ts = [TensorInfo("token_embd.weight", "Q8_0", draw(size), (1, 1))]
    ts.append(TensorInfo("output.weight", "Q8_0", draw(size), (1, 1)))
    for i in range(n_layer):
        ts.append(TensorInfo(f"blk.{i}.attn_q.weight", "F16", draw(size), (1, 1)))
        ts.append(TensorInfo(f"blk.{i}.attn_norm.weight", "F32", draw(st.integers(1, 10**5)), (1,)))
        if n_expert and draw(st.booleans() | st.just(True)):
            kinds = draw(st.sampled_from([("gate", "up", "down"), ("gate_up", "down")]))
            ts += [
                TensorInfo(f"blk.{i}.ffn_{w}_exps.weight", "Q4_0", draw(size), (1, 1, n_expert))
                for w in kinds
            ]
        else:
            ts.append(TensorInfo(f"blk.{i}.ffn_up.weight", "Q4_0", draw(size), (1, 1)))
    return ModelMeta(
        arch="test", name="random", n_layer=n_layer, n_expert=n_expert, n_expert_used=used,
        n_embd=draw(st.integers(64, 8192)), n_vocab=draw(st.integers(256, 200_000)),
        kv_bytes_per_token=draw(st.integers(1, 400_000)), tensors=tuple(ts),
    )  # fmt: skip


@given(
    meta=metas(),
    vram=st.integers(0, 64 * GiB),
    ram=st.integers(0, 64 * GiB),
    kv_tokens=st.integers(0, 200_000),
    n_ubatch=st.sampled_from([32, 512, 2048]),
)
@settings(max_examples=300, deadline=None)
def test_plans_never_exceed_either_budget_and_patterns_select_exactly_the_ram_tensors(
    meta: ModelMeta, vram: int, ram: int, kv_tokens: int, n_ubatch: int
) -> None:
    opts = PlanOptions(kv_tokens=kv_tokens, n_ubatch=n_ubatch)
    budgets = Budgets(vram=vram, ram=ram)
    try:
        plan = make_plan(meta, budgets, opts)
    except PlanDoesNotFit as e:
        assert e.needed > e.available and e.shortfall == e.needed - e.available
        # Refused only when the minimum layout (or the most the GPU can take) truly fails.
        if e.resource == "VRAM":
            dense = sum(
                t.nbytes for t in meta.tensors
                if not EXPERT.search(t.name) and t.name != "token_embd.weight"
            )  # fmt: skip
            assert e.needed == vram_for_expert_share(meta, opts, 0.0) and e.needed > vram
            assert dense <= e.needed
        else:
            assert e.resource == "RAM" and e.available == ram
        return
    _assert_within(plan)
    assert [t.name for t in plan.tensors] == [t.name for t in meta.tensors]
    left = vram - plan.vram_used
    for t in plan.tensors:
        if EXPERT.search(t.name):
            assert t.device == "gpu" or t.nbytes > left  # nothing that fits is left in RAM
        else:
            assert t.device == ("ram" if t.name == "token_embd.weight" else "gpu")
    pats = [re.compile(p) for p in cpu_patterns(plan)]
    for t in plan.tensors:
        if t.name != "token_embd.weight":
            assert any(p.search(t.name) for p in pats) == (t.device == "ram"), t.name
    assert plan_from_json(plan_to_json(plan)) == plan


def test_a_small_model_fits_a_host_with_little_free_ram() -> None:
    """The 4 GiB RAM margin is for big hosts; with 3 GB free a small model still plans."""
    meta = deepseek_like()
    small = msgspec.structs.replace(
        meta, tensors=tuple(t for t in meta.tensors if not t.name.startswith("blk.") or
                            t.name.startswith(("blk.0.", "blk.1.")))
    )  # fmt: skip
    plan = make_plan(small, Budgets(vram=24 * GB, ram=3 * GB), PlanOptions(kv_tokens=4096))
    assert plan.ram_reserve.margin == 3 * GB // 20 and plan.ram_used <= 3 * GB


def test_half_expert_budget_places_about_half_the_expert_bytes() -> None:
    meta = deepseek_like()
    opts = PlanOptions(kv_tokens=8192)
    plan = make_plan(meta, Budgets(vram_for_expert_share(meta, opts, 0.5), 10**15), opts)
    experts = [t for t in plan.tensors if EXPERT.search(t.name)]
    share = sum(t.nbytes for t in experts if t.device == "gpu") / sum(t.nbytes for t in experts)
    assert 0.49 < share <= 0.5


def test_asking_for_one_logit_row_per_sequence_frees_vram_for_experts() -> None:
    """llama.cpp sizes a context's logits for every row of a ubatch unless told how many
    rows a step outputs; the server outputs one per sequence. The reserve follows, and the
    freed VRAM (here 480 rows of a 129K vocabulary: 237 MB) goes to expert tensors."""
    meta = deepseek_like()
    every_row = PlanOptions(kv_tokens=8192)
    per_seq = PlanOptions(kv_tokens=8192, n_outputs=32)
    vram = vram_for_expert_share(meta, every_row, 0.5)
    a = make_plan(meta, Budgets(vram, 10**15), every_row)
    b = make_plan(meta, Budgets(vram, 10**15), per_seq)
    freed = (512 - 32) * meta.n_vocab * 4
    assert a.vram_reserve.compute - b.vram_reserve.compute == freed
    assert b.bytes_on("gpu") - a.bytes_on("gpu") > freed - max(t.nbytes for t in meta.tensors)
    assert b.vram_used <= vram


def test_a_saved_plan_round_trips_and_a_malformed_one_is_rejected() -> None:
    meta = deepseek_like()
    plan = make_plan(meta, Budgets(vram=96 * GB, ram=280 * GB), REFERENCE_OPTS)
    again = plan_from_json(plan_to_json(plan))
    assert again == plan and cpu_patterns(again) == cpu_patterns(plan)
    with pytest.raises(ValueError):
        plan_from_json(b'{"model": "x"}')


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80G", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("512M", 512 * 2**20),
        ("1.5T", round(1.5 * 2**40)),
        ("96 gb", 96 * 10**9),
        ("123", 123),
        ("4kib", 4096),
    ],
)
def test_sizes_parse_with_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 apples", "-3G", "1.2.3G"])
def test_a_size_that_does_not_parse_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(ValueError, match=r"e\.g\. 80GiB"):
        parse_size(text)


def test_the_header_of_a_real_gguf_is_read(tmp_path: Path) -> None:
    s = Shape()
    meta = read_meta(write_qwen3moe(tmp_path / "m.gguf", shape=s))
    assert (meta.arch, meta.n_layer, meta.n_expert, meta.n_expert_used) == (
        "qwen3moe", s.n_layer, s.n_expert, s.n_expert_used,
    )  # fmt: skip
    assert meta.n_embd == s.n_embd and meta.n_vocab > 256
    assert meta.kv_bytes_per_token == s.n_layer * s.n_head_kv * 2 * s.head_dim * 2
    by_name = {t.name: t for t in meta.tensors}
    gate = by_name["blk.0.ffn_gate_exps.weight"]
    assert gate.shape == (s.n_embd, s.n_ff_exp, s.n_expert) and gate.ggml_type == "F32"
    assert gate.nbytes == s.n_embd * s.n_ff_exp * s.n_expert * 4
    # The byte sizes add up to the file's tensor data (the rest is header and alignment).
    size = (tmp_path / "m.gguf").stat().st_size
    assert 0 < size - meta.nbytes < 64 * 1024


def test_a_split_model_is_read_from_all_its_files(tmp_path: Path) -> None:
    whole = read_meta(write_qwen3moe(tmp_path / "w.gguf", seed=1))
    write_qwen3moe(tmp_path / "s.gguf", seed=1, split_max_tensors=10)
    parts = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(parts) == 3
    split = read_meta(parts[0])
    assert split.tensors == whole.tensors and split.n_layer == whole.n_layer


def test_mla_cache_and_skipped_mtp_blocks_follow_llama_cpp(tmp_path: Path) -> None:
    """A DeepSeek-style header: the compressed (MLA) cache is K only, one head of
    `key_length`; the multi-token-prediction block (the last one) is not loaded, so it is
    neither planned nor given KV."""
    path = tmp_path / "ds.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(3)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(576)
    w.add_value_length(512)
    w.add_uint32("deepseek2.attention.key_length_mla", 192)
    w.add_uint32("deepseek2.nextn_predict_layers", 1)
    for i in range(3):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = read_meta(path)
    assert [t.name for t in meta.tensors] == ["blk.0.attn_norm.weight", "blk.1.attn_norm.weight"]
    assert meta.kv_bytes_per_token == 2 * 576 * 2


def test_threads_leave_a_core_to_the_server_when_tensors_run_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Measured on the H200 host: with experts in RAM, 15 of 16 cores decode faster than 16
    (the Python threads need a core); all on the GPU, or on a small machine, all cores."""
    from engine import config
    from engine.config import EngineConfig
    from engine.placement import CPU_MOE

    monkeypatch.setattr(config, "default_threads", lambda: 16)
    assert EngineConfig("m.gguf").threads() == (16, 16)
    assert EngineConfig("m.gguf", cpu_tensors=(CPU_MOE,)).threads() == (15, 15)
    assert EngineConfig("m.gguf", cpu_tensors=(CPU_MOE,), n_threads=16).threads() == (16, 16)
    monkeypatch.setattr(config, "default_threads", lambda: 2)
    assert EngineConfig("m.gguf", cpu_tensors=(CPU_MOE,)).threads() == (2, 2)


def test_with_experts_in_ram_a_physical_batch_is_a_whole_step_where_it_fits() -> None:
    """A GPU server copies host-resident experts once per physical batch of a prompt step:
    with some of them in RAM the plan reserves buffers for batches of a whole step (the
    server then uses them); with every expert on the GPU it keeps 512 rows, and where
    wide buffers would not fit it keeps 512 rather than refusing."""
    from api.server.planning import PlanRequest, experts_in_ram, plan_wide

    meta = deepseek_like()
    req = PlanRequest(vram_budget="96GB", ram_budget="280GB", options=REFERENCE_OPTS)
    hybrid = plan_wide(meta, req, 2048)
    assert experts_in_ram(hybrid) and hybrid.options.n_ubatch == 2048
    narrow = make_plan(meta, Budgets(vram=96 * GB, ram=280 * GB), REFERENCE_OPTS)
    assert hybrid.vram_reserve.compute > narrow.vram_reserve.compute
    _assert_within(hybrid)
    assert "2048-row batches" in format_plan(hybrid)

    roomy = PlanRequest(vram_budget="400GB", ram_budget="280GB", options=REFERENCE_OPTS)
    all_gpu = plan_wide(meta, roomy, 2048)
    assert not experts_in_ram(all_gpu) and all_gpu.options.n_ubatch == 512

    # room for the 512-row plan's non-expert part and buffers, not for 2.8 GB more
    gpu = [t for t in narrow.tensors if t.device == "gpu"]
    experts_on_gpu = sum(t.nbytes for t in gpu if EXPERT.search(t.name))
    tight = PlanRequest(
        vram_budget=str(narrow.vram_used - experts_on_gpu + GB), ram_budget="280GB",
        options=REFERENCE_OPTS,
    )  # fmt: skip
    kept = plan_wide(meta, tight, 2048)
    assert experts_in_ram(kept) and kept.options.n_ubatch == 512
    _assert_within(kept)


def test_serve_widens_physical_batches_only_on_a_gpu_with_experts_placed_in_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--cpu-moe` by hand on a GPU: batches of a whole step; an explicit --n-ubatch, no
    GPU, or host-RAM tensors that are not experts: unchanged."""
    import api.server.planning as planning
    from engine.config import EngineConfig
    from engine.placement import CPU_MOE

    class Gpu:
        def llama_supports_gpu_offload(self) -> bool:
            return True

    model = str(write_qwen3moe(tmp_path / "m.gguf"))
    moe = EngineConfig(model_path=model, n_batch=2048, n_ubatch=512, cpu_tensors=(CPU_MOE,))
    req = planning.PlanRequest()
    on_cpu, _ = planning.plan_for_serve(moe, req, None, wide_batches=True)
    assert on_cpu.n_ubatch == 512  # this test machine has no GPU
    monkeypatch.setattr(planning, "llama", Gpu)
    wide, _ = planning.plan_for_serve(moe, req, None, wide_batches=True)
    assert wide.n_ubatch == 2048
    given, _ = planning.plan_for_serve(moe, req, None, wide_batches=False)
    assert given.n_ubatch == 512
    norms = EngineConfig(model_path=model, n_ubatch=512, cpu_tensors=(r"_norm\.",))
    assert planning.plan_for_serve(norms, req, None, wide_batches=True)[0].n_ubatch == 512


def test_serve_caches_experts_by_default_only_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--expert-cache-slots` left at auto: where the plan keeps experts in host RAM on a GPU
    the engine gets the split's slots (the measured win, docs/benchmarks.md "Expert cache");
    without a GPU, even planned under a VRAM budget, no cache (a host-RAM bank of host-RAM
    experts only costs copies); 0 turns it off on a GPU too."""
    import api.server.planning as planning
    from engine.config import EngineConfig
    from engine.plan import AUTO

    class Gpu:
        def llama_supports_gpu_offload(self) -> bool:
            return True

    model = str(write_qwen3moe(tmp_path / "m.gguf", shape=Shape(n_expert=32)))
    meta = read_meta(model)
    roomy = planning.PlanRequest(vram_budget="64GiB", ram_budget="64GiB")
    whole = planning.plan_model(meta, roomy)
    experts = sum(t.nbytes for t in whole.tensors if EXPERT.search(t.name))
    budget = str(whole.vram_used - experts // 2)

    def served(slots: int) -> int:
        opts = msgspec.structs.replace(PlanOptions(), cache_slots=slots)
        req = planning.PlanRequest(vram_budget=budget, ram_budget="64GiB", options=opts)
        cfg, plan = planning.plan_for_serve(EngineConfig(model_path=model), req, None)
        assert plan is not None and planning.experts_in_ram(plan)
        return cfg.expert_cache_slots

    assert served(AUTO) == 0  # this test machine has no GPU
    monkeypatch.setattr(planning, "llama", Gpu)
    assert served(AUTO) > 0
    assert served(0) == 0


def test_serve_opens_a_side_context_where_a_gpu_computes_prompts_with_experts_in_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--side-prefill-ctx` left at auto: a side context (engine.side_prefill) only where a
    GPU computes prompts with routed experts in host RAM — placed by hand, or by the plan,
    which then reserves its KV and buffers as one more context; none without a GPU, none
    where the experts are resident; a number is taken as given."""
    from dataclasses import replace

    import api.server.planning as planning
    from engine.config import SIDE_AUTO, EngineConfig
    from engine.placement import CPU_MOE

    class Gpu:
        def llama_supports_gpu_offload(self) -> bool:
            return True

    model = str(write_qwen3moe(tmp_path / "m.gguf", shape=Shape(n_expert=32, n_ff_exp=1024)))
    meta = read_meta(model)
    by_hand = EngineConfig(model_path=model, n_ctx=65536, cpu_tensors=(CPU_MOE,),
                           side_prefill_ctx=SIDE_AUTO)  # fmt: skip
    req = planning.PlanRequest()
    assert planning.plan_for_serve(by_hand, req, None)[0].side_prefill_ctx == 0  # no GPU
    monkeypatch.setattr(planning, "llama", Gpu)
    assert planning.plan_for_serve(by_hand, req, None)[0].side_prefill_ctx == 32768
    small = EngineConfig(model_path=model, n_ctx=4096, side_prefill_ctx=SIDE_AUTO)
    opts = PlanOptions(kv_tokens=4096)
    whole = planning.plan_model(meta, planning.PlanRequest(vram_budget="64GiB", options=opts))
    experts = sum(t.nbytes for t in whole.tensors if EXPERT.search(t.name))
    with_side = msgspec.structs.replace(opts, kv_tokens=8192, contexts=2)
    extra = reserves(meta, with_side)[0].total - reserves(meta, opts)[0].total
    for budget, side in ((str(whole.vram_used + extra - experts // 2), 4096), ("64GiB", 0)):
        tight = planning.PlanRequest(vram_budget=budget, ram_budget="64GiB", options=opts)
        cfg, plan = planning.plan_for_serve(small, tight, None)
        assert plan is not None and cfg.side_prefill_ctx == side
        assert plan.options.contexts == (2 if side else 1)
        assert plan.options.kv_tokens == 4096 + side and plan.vram_used <= parse_size(budget)
    given = replace(by_hand, side_prefill_ctx=1000)
    assert planning.plan_for_serve(given, req, None)[0].side_prefill_ctx == 1000


def test_serve_reads_the_model_where_a_gpu_computes_with_weights_in_host_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--mmap` left unset: read (llama.cpp then keeps host-RAM weights in the GPU's
    page-locked memory, and prompt batches copy them by DMA) where a GPU computes with
    weights in host RAM — experts by hand or by the plan, or layers kept on the CPU; mapped
    with every weight on the GPU and without a GPU; `--mmap`/`--no-mmap` taken as given."""
    from dataclasses import replace

    import api.server.planning as planning
    from engine.config import EngineConfig
    from engine.placement import CPU_MOE

    class Gpu:
        def llama_supports_gpu_offload(self) -> bool:
            return True

    model = str(write_qwen3moe(tmp_path / "m.gguf", shape=Shape(n_expert=32)))
    auto = EngineConfig(model_path=model, use_mmap=None)
    by_hand = replace(auto, cpu_tensors=(CPU_MOE,))
    req = planning.PlanRequest()

    def mapped(cfg: EngineConfig, req: planning.PlanRequest = req) -> bool | None:
        return planning.plan_for_serve(cfg, req, None)[0].use_mmap

    assert mapped(by_hand) is True  # this test machine has no GPU
    monkeypatch.setattr(planning, "llama", Gpu)
    assert mapped(by_hand) is False
    assert mapped(replace(auto, n_gpu_layers=1)) is False
    assert mapped(auto, planning.PlanRequest(vram_budget="64GiB")) is True  # all fits
    meta = read_meta(model)
    whole = planning.plan_model(meta, planning.PlanRequest(vram_budget="64GiB"))
    experts = sum(t.nbytes for t in whole.tensors if EXPERT.search(t.name))
    tight = planning.PlanRequest(vram_budget=str(whole.vram_used - experts // 2),
                                 ram_budget="64GiB")  # fmt: skip
    assert mapped(auto, tight) is False
    assert mapped(replace(by_hand, use_mmap=True)) is True
    assert mapped(replace(auto, use_mmap=False), planning.PlanRequest(vram_budget="64GiB")) is False
