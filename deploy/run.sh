#!/usr/bin/env bash
# Plan, bind to the GPU's NUMA node and serve on 0.0.0.0:8090: `one-gpu run`, from the
# repository's virtual environment when there is one (`make install`), else from PATH.
#   deploy/run.sh --dry-run --model M.gguf        # print every command, start nothing
#   deploy/run.sh --model M.gguf [serve options]  # e.g. --n-ctx 65536 --cpu-moe
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -x "$here/.venv/bin/one-gpu" ]; then
  exec "$here/.venv/bin/one-gpu" run "$@"
fi
exec one-gpu run "$@"
