"""The reference model the product exists for, as the planner sees it: DeepSeek-V4.1-Flash
(the reference system's model) described by its header alone — every tensor's name, shape,
type and bytes, no weights. The planner's tests plan it; `bench.synth_moe --shape reference`
writes a slice of it at its true width; `bench.hybrid_model` predicts its decode rate.
"""

from __future__ import annotations

from engine.gguf_meta import ModelMeta, TensorInfo, kv_bytes_per_token
from engine.plan import PlanOptions

GB = 10**9


def tensor(name: str, shape: tuple[int, ...], bytes_per_param: float, ggml_type: str) -> TensorInfo:
    n = 1
    for d in shape:
        n *= d
    return TensorInfo(
        name=name, ggml_type=ggml_type, nbytes=round(n * bytes_per_param), shape=shape
    )


def deepseek_like() -> ModelMeta:
    """A DeepSeek-V4.1-Flash-like header: 763B parameters, 3 dense then 44 MoE layers of
    384 routed experts (6 used) plus a shared expert, multi-head latent attention; routed
    experts in Q2_K, attention projections in F16 but the output one, the rest in Q8_0 —
    264.5 GB in all."""
    q2k, q8, f16 = 84 / 256, 34 / 32, 2.0
    E, V, X, F, FD = 7168, 129280, 384, 2048, 18432
    ts = [
        tensor("token_embd.weight", (E, V), q8, "Q8_0"),
        tensor("output_norm.weight", (E,), 4, "F32"),
        tensor("output.weight", (E, V), q8, "Q8_0"),
    ]
    for i in range(47):
        b = f"blk.{i}."
        ts += [
            tensor(b + "attn_norm.weight", (E,), 4, "F32"),
            tensor(b + "attn_q_a.weight", (E, 1536), f16, "F16"),
            tensor(b + "attn_q_b.weight", (1536, 24576), f16, "F16"),
            tensor(b + "attn_kv_a_mqa.weight", (E, 576), f16, "F16"),
            tensor(b + "attn_kv_b.weight", (512, 32768), f16, "F16"),
            tensor(b + "attn_output.weight", (16384, E), q8, "Q8_0"),
            tensor(b + "ffn_norm.weight", (E,), 4, "F32"),
        ]
        if i < 3:
            ts += [tensor(b + f"ffn_{w}.weight", (E, FD), q8, "Q8_0") for w in ("gate", "up")]
            ts.append(tensor(b + "ffn_down.weight", (FD, E), q8, "Q8_0"))
            continue
        ts.append(tensor(b + "ffn_gate_inp.weight", (E, X), 4, "F32"))
        ts += [tensor(b + f"ffn_{w}_shexp.weight", (E, F), q8, "Q8_0") for w in ("gate", "up")]
        ts.append(tensor(b + "ffn_down_shexp.weight", (F, E), q8, "Q8_0"))
        ts += [tensor(b + f"ffn_{w}_exps.weight", (E, F, X), q2k, "Q2_K") for w in ("gate", "up")]
        ts.append(tensor(b + "ffn_down_exps.weight", (F, E, X), q2k * 1.035, "Q2_K"))
    return ModelMeta(
        arch="deepseek2", name="DeepSeek-V4.1-Flash-like", n_layer=47, n_expert=X,
        n_expert_used=6, n_embd=E, n_vocab=V,
        kv_bytes_per_token=kv_bytes_per_token(47, 1, 576, 512, k_only=True),  # MLA: K only
        tensors=tuple(ts),
    )  # fmt: skip


REFERENCE_OPTS = PlanOptions(kv_tokens=4 * 65536, n_ubatch=512)  # 4 users x 64K
