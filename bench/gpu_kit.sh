#!/usr/bin/env bash
# Fill OUT (.gpu-pre) with what bench/gpu_prebuilt.sh sets up on the offline GPU host, around
# a llama.cpp CUDA pack: llama-cpp-python's Python package, the wheels of .gpu/ (from
# bench/gpu_prepare.sh) and pytest's. The pack is either bench/gpu_crossbuild.sh's (built
# here) or the parts a device call returned (`PACK=DIR bench/gpu_build.sh` on the GPU host
# writes them: a call returns files of at most 16 MB).
#   Usage: bench/gpu_kit.sh PACK_PARTS_DIR [OUT=.gpu-pre]
set -euo pipefail
P=${1:?PACK_PARTS_DIR}; OUT=${2:-.gpu-pre}
ver=0.3.36
mkdir -p "$OUT"
if [ "$(realpath "$P")" != "$(realpath "$OUT")" ]; then
  cat "$P"/llama-cuda.tar.xz.part-* > "$OUT/llama-cuda.tar.xz"
fi
xz -t "$OUT/llama-cuda.tar.xz"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar xzf .gpu/llama-cpp-python-src.tgz -C "$tmp" "llama_cpp_python-$ver/llama_cpp"
tar czf "$OUT/llama-cpp-python-pkg.tgz" -C "$tmp/llama_cpp_python-$ver" llama_cpp
cp .gpu/*.whl "$OUT/"  # what gpu_prebuilt.sh installs
python3 -m pip download -q --no-deps -d "$OUT" pytest==9.2.0 pytest-timeout==2.4.0 \
  pluggy iniconfig packaging pygments  # the cache-cuda step runs tests there
du -sh "$OUT"
