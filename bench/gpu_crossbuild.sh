#!/usr/bin/env bash
# On this CPU machine (no GPU, PyPI reachable): build llama.cpp for CUDA (sm_90: H100, H200)
# with NVIDIA's toolkit wheels from PyPI, and pack the shared libraries and the peers'
# binaries for the offline GPU host, where bench/gpu_prebuilt.sh sets them up in seconds —
# the GPU host's device time then goes to measuring, not to a ~5 minute build.
# Details: nvcc 13.0 (the GPU host's CUDA); a stub libcuda.so.1 defining the driver calls
# ggml-cuda makes (the driver's real library resolves them at run time: the stub only puts
# it among the library's NEEDED ones — an empty stub is dropped by the linker and the
# calls then have nowhere to resolve); the CPU backend for x86-64-v3 (AVX2, FMA, F16C: the
# GPU host's CPU is not known here; AMX off, as in every build of ours).
#   Usage: bench/gpu_crossbuild.sh WORK [OUT=.gpu-pre]   (~25 min on 2 cores; after
#   bench/gpu_prepare.sh, whose .gpu/ it reads; carry OUT in the device call)
set -euo pipefail
W=${1:?WORK}; OUT=${2:-.gpu-pre}
ver=0.3.36
T="$W/site/nvidia/cu13"
mkdir -p "$W" "$OUT"
python3 -m pip install -q --target "$W/site" nvidia-cuda-nvcc==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-cuda-cccl==13.0.85 \
  nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
(cd "$T/lib" && ln -sf libcudart.so.13 libcudart.so && ln -sf libcublas.so.13 libcublas.so \
  && ln -sf libcublasLt.so.13 libcublasLt.so && mkdir -p stubs)
echo > "$W/empty.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$T/lib/stubs/libcuda.so" "$W/empty.c"
ln -sfn lib "$T/lib64"
rm -rf "$W/fresh" && mkdir -p "$W/fresh" "$W/src"
tar xzf .gpu/llama-cpp-python-src.tgz -C "$W/fresh"  # bench/gpu_prepare.sh wrote it
for p in engine/llama_patches/*.patch; do  # as make does
  patch -p1 -s -d "$W/fresh/llama_cpp_python-$ver/vendor/llama.cpp" < "$p"
done
# into the build's tree, only the files that differ: a patch edited since the last build in
# this WORK recompiles what it touches, not the whole of ggml-cuda (~20 min on 2 cores)
python3 - "$W/fresh" "$W/src" <<'PY'
import filecmp, os, shutil, sys
src, dst = sys.argv[1:]
for root, _, files in os.walk(src):
    out = os.path.join(dst, os.path.relpath(root, src))
    os.makedirs(out, exist_ok=True)
    for f in files:
        a, b = os.path.join(root, f), os.path.join(out, f)
        if not os.path.exists(b) or not filecmp.cmp(a, b, shallow=False):
            shutil.copy2(a, b) if not os.path.exists(b) else shutil.copyfile(a, b)
PY
L="$W/src/llama_cpp_python-$ver/vendor/llama.cpp"
PATH="$T/bin:$PATH" cmake -S "$L" -B "$W/build" -G Ninja -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCUDAToolkit_ROOT="$T" -DCMAKE_CUDA_COMPILER="$T/bin/nvcc" \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,--allow-shlib-undefined" > "$W/cmake.log"
build() {
  nice -n 10 cmake --build "$W/build" -j"$(nproc)" --target llama llama-batched-bench \
    llama-server > "$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
}
build
# the driver calls the library makes, defined in the stub; then link it again against that
nm -D --undefined-only "$W/build/bin/libggml-cuda.so" \
  | awk '/ cu[A-Z]/ {print "void " $2 "(void) {}"}' > "$W/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$T/lib/stubs/libcuda.so" "$W/stub.c"
rm -f "$W"/build/bin/libggml-cuda.so*
build
readelf -d "$W/build/bin/libggml-cuda.so" | grep -q 'libcuda.so.1' || { echo "no libcuda"; exit 1; }
rm -rf "$W/pack" && mkdir -p "$W/pack"
cp -a "$W"/build/bin/*.so* "$W"/build/bin/llama-server "$W"/build/bin/llama-batched-bench "$W/pack"
find "$W/pack" -type f -exec strip --strip-unneeded {} +
tar cJf "$OUT/llama-cuda.tar.xz" -C "$W/pack" .  # ~43 MB
bash bench/gpu_kit.sh "$OUT" "$OUT"  # the Python package and the wheels beside it
