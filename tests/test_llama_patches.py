"""Our patches to the llama.cpp that llama-cpp-python vendors (engine/llama_patches/,
applied by the Makefile before it builds), checked on the library this checkout runs.

0001: `ggml_mul_mat_id` on the CPU takes an id of -1 as "no expert here" and gives a zero
row — the half of a layer's experts that a GPU cache computes elsewhere (the other half's
chain adds its rows). Checked directly on ggml through ctypes, against numpy, with the
output memory filled with NaN first (ggml does not clear it). Run in a child process: an
unpatched library indexes expert -1, which may crash rather than fail.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
F32, I32 = 0, 26  # enum ggml_type


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]  # fmt: skip


def mul_mat_id(a: np.ndarray, b: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ggml_mul_mat_id on the CPU backend: a [n_as, m, k], b [n_tok, n_used, k] float32,
    ids [n_tok, n_used] int32 -> [n_tok, n_used, m]."""
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"))
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.restype, base.ggml_init.argtypes = vp, [_InitParams]
    base.ggml_new_tensor_3d.restype = vp
    base.ggml_new_tensor_3d.argtypes = [vp, ctypes.c_int, i64, i64, i64]
    base.ggml_new_tensor_2d.restype = vp
    base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, i64, i64]
    base.ggml_mul_mat_id.restype, base.ggml_mul_mat_id.argtypes = vp, [vp, vp, vp, vp]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = vp, [vp]
    base.ggml_build_forward_expand.argtypes = [vp, vp]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = vp, [vp]
    base.ggml_free.argtypes = [vp]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]

    n_as, m, k = a.shape
    n_tok, n_used, _ = b.shape
    ctx = base.ggml_init(_InitParams(16 << 20, None, False))
    ta = base.ggml_new_tensor_3d(ctx, F32, k, m, n_as)
    tb = base.ggml_new_tensor_3d(ctx, F32, k, n_used, n_tok)
    tid = base.ggml_new_tensor_2d(ctx, I32, n_used, n_tok)
    out = base.ggml_mul_mat_id(ctx, ta, tb, tid)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, out)

    def view(t: int, arr: np.ndarray) -> np.ndarray:
        ptr = ctypes.cast(
            base.ggml_get_data(t), ctypes.POINTER(np.ctypeslib.as_ctypes_type(arr.dtype))
        )
        return np.ctypeslib.as_array(ptr, shape=arr.shape)

    view(ta, a)[:] = a
    view(tb, b)[:] = b
    view(tid, ids)[:] = ids
    result = view(out, np.empty((n_tok, n_used, m), dtype=np.float32))
    result[:] = np.nan  # ggml does not clear dst: a skipped row must be written
    try:
        assert cpu.ggml_graph_compute_with_ctx(ctx, gf, 2) == 0
        return result.copy()
    finally:
        base.ggml_free(ctx)


def _child() -> None:
    """In the child: a case with some ids -1, printed as JSON."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 6, 16)).astype(np.float32)
    b = rng.standard_normal((3, 2, 16)).astype(np.float32)
    ids = np.array([[2, -1], [-1, -1], [0, 3]], dtype=np.int32)
    sys.stdout.write(json.dumps({"a": a.tolist(), "b": b.tolist(), "ids": ids.tolist(),
                                 "out": mul_mat_id(a, b, ids).tolist()}))  # fmt: skip


def test_mul_mat_id_gives_zero_rows_for_experts_computed_elsewhere() -> None:
    run = subprocess.run(
        [sys.executable, "-c", "from tests.test_llama_patches import _child; _child()"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, f"ggml crashed on an id of -1 (patch 0001 missing?)\n{run.stderr}"
    got = json.loads(run.stdout)
    a, b = np.array(got["a"]), np.array(got["b"])
    ids, out = np.array(got["ids"]), np.array(got["out"])
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            want = np.zeros(a.shape[1]) if e < 0 else a[e] @ b[t, s]
            np.testing.assert_allclose(out[t, s], want, rtol=1e-5, atol=1e-5)
