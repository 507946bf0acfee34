#!/usr/bin/env bash
# On a machine with the package index: fill .gpu/ with what the offline GPU host needs —
# the llama-cpp-python source (without models, docs and the web UI's sources: llama-server
# still builds, with no UI assets), the wheels our server, the benchmark and the openai
# client import, and the synthetic-model writer. Then carry .gpu in the device call and run
# bench/gpu_build.sh there.   Usage: bench/gpu_prepare.sh [OUT=.gpu]
set -euo pipefail
out=${1:-.gpu}
ver=0.3.36
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$tmp"
tar xzf "$tmp/llama_cpp_python-$ver.tar.gz" -C "$tmp"
v="$tmp/llama_cpp_python-$ver/vendor/llama.cpp"
rm -rf "$v"/{models,docs,media,benches} "$v"/tools/ui/{src,tests,package-lock.json} \
  "$tmp/llama_cpp_python-$ver/.git" "$v"/.git*
tar czf "$out/llama-cpp-python-src.tgz" -C "$tmp" "llama_cpp_python-$ver"
wheels=(annotated_types==0.8.0 anyio==4.16.0 certifi==2026.10.19.post1 click==8.5.1
  diskcache==5.6.3 distro==1.9.0 gguf==0.19.0 h11==0.16.0 httpcore==1.0.9 httpcore2==2.16.2
  httptools==0.9.0 httpx==0.28.1 httpx2==2.16.2 idna==3.20 jinja2==3.1.6 jiter==0.19.0
  llguidance==1.9.1
  markupsafe==3.0.4 msgspec==0.22.0 openai==3.51.0 prometheus_client==0.26.0 pydantic==2.14.4
  pydantic_core==2.50.5 pyyaml==6.0.4 sniffio==1.3.1 starlette==1.10.0 tqdm==4.70.1
  truststore==0.10.5 typing_extensions==4.16.0 typing_inspection==0.4.5 uvicorn==0.54.0
  uvloop==0.23.0)
for w in "${wheels[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out" "$w"
done
du -sh "$out"
