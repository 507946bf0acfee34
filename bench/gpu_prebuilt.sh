#!/usr/bin/env bash
# On the offline GPU host: set up what bench/gpu_crossbuild.sh built on the CPU machine —
# llama.cpp's CUDA libraries and the peers' binaries, llama-cpp-python's Python package,
# the wheels — in seconds instead of a build. The CUDA runtime and cuBLAS are the host's.
#   Usage: bench/gpu_prebuilt.sh WORKDIR [CARRIED=.gpu-pre]   (then source WORKDIR/env.sh)
set -euo pipefail
W=${1:?WORKDIR}; C=${2:-.gpu-pre}
mkdir -p "$W/lib"
tar xJf "$C/llama-cuda.tar.xz" -C "$W/lib"
tar xzf "$C/llama-cpp-python-pkg.tgz" -C "$W"
cc -O2 -Wall -shared -fPIC -o engine/native/libexpert_tap.so engine/native/expert_tap.c
cc -O3 -march=native -fno-trapping-math -Wall -shared -fPIC -pthread \
  -o engine/native/libdecode_sample.so engine/native/decode_sample.c -lm
python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$C"/*.whl
lt=$(find /usr/local/cuda* /usr /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
[ -n "$lt" ] || { echo "no cuBLAS 13 on this host (libcublasLt.so.13)"; exit 1; }
cuda=$(dirname "$lt")
cat > "$W/env.sh" <<ENV
export LLAMA_CPP_LIB_PATH=$W/lib
export LD_LIBRARY_PATH=$W/lib:$cuda\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export PYTHONPATH=$W/site:$W:$PWD
export PEER_BIN=$W/lib
export MODEL=$W/moe30.gguf
ENV
echo "CUDA libraries from $cuda"
