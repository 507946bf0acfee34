#!/usr/bin/env bash
# On the offline GPU host: unpack the stripped llama-cpp-python source and the wheels that
# .gpu/ carries, build llama.cpp with CUDA as shared libraries (our engine loads them
# through LLAMA_CPP_LIB_PATH; llama-server and llama-batched-bench link the same ones),
# and write the random-weight Qwen3-30B-A3B-shaped Q4_0 model, in parallel.
# Usage: [PACK=DIR] bench/gpu_build.sh WORKDIR   (then source WORKDIR/env.sh; with PACK, the
# libraries are also packed there as bench/gpu_crossbuild.sh packs them, in 15 MB parts)
set -euo pipefail
W=${1:?WORKDIR}
mkdir -p "$W"
tar xzf .gpu/llama-cpp-python-src.tgz -C "$W"
SRC="$W/llama_cpp_python-0.3.36"
L="$SRC/vendor/llama.cpp"
for p in engine/llama_patches/*.patch; do patch -p1 -s -d "$L" < "$p"; done  # as make does
cc -O2 -Wall -shared -fPIC -o engine/native/libexpert_tap.so engine/native/expert_tap.c
cc -O3 -march=native -fno-trapping-math -Wall -shared -fPIC -pthread \
  -o engine/native/libdecode_sample.so engine/native/decode_sample.c -lm
python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" .gpu/*.whl
cat > "$W/env.sh" <<ENV
export LLAMA_CPP_LIB_PATH=$L/build/bin
export PYTHONPATH=$W/site:$SRC:$PWD
export PEER_BIN=$L/build/bin
export MODEL=$W/moe30.gguf
ENV
if [ ! -f "$W/moe30.gguf" ] && [ "${SYNTH30:-1}" = 1 ]; then  # SYNTH30=0: not written here
  PYTHONPATH="$W/site" python3 -m bench.synth_moe "$W/moe30.gguf" --arch qwen3moe --layers 48 \
    --embd 2048 --heads 32 --kv-heads 4 --head-dim 128 --ff 6144 --experts 128 --used 8 \
    --ff-exp 768 --vocab 151936 > "$W/synth.log" 2>&1 &
fi
# the CPU backend for x86-64-v3 (as bench/gpu_crossbuild.sh builds it): the libraries then
# run on any GPU host, and PACK can carry them to the next machine instead of a build there
cmake -S "$L" -B "$L/build" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release > "$W/cmake.log"
cmake --build "$L/build" -j"$(nproc)" --target llama llama-batched-bench llama-server \
  llama-perplexity \
  > "$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
if [ -n "${PACK:-}" ]; then  # bench/gpu_crossbuild.sh's pack, in parts a device call returns
  mkdir -p "$W/pack" "$PACK"
  cp -a "$L"/build/bin/*.so* "$L"/build/bin/llama-server "$L"/build/bin/llama-batched-bench \
    "$W/pack"
  find "$W/pack" -type f -exec strip --strip-unneeded {} +
  tar cf - -C "$W/pack" . | xz -T0 -6 | split -b 15M - "$PACK/llama-cuda.tar.xz.part-"
fi
wait
ls -la "$L/build/bin" "$W"/*.gguf || true  # (no model written here: SYNTH30=0)
