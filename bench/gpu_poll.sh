#!/usr/bin/env bash
# On the GPU host, in a device call after `setsid nohup bash bench/gpu_session.sh /tmp/w /tmp/r
# STEP... > /tmp/r.log 2>&1 &`: wait up to SECONDS (default 560, inside one call's 600 s)
# for the session to finish, then copy what it has so far into $OUT, one file per RESULTS
# folder (partial-NAME.txt; all-NAME.txt once done): the device returns only a few files.
# Several folders (sessions chained one after another): waits for the last one.
#   Usage: bash bench/gpu_poll.sh [SECONDS] [RESULTS=/tmp/r ...]
T=${1:-560}; shift; [ $# -eq 0 ] && set -- /tmp/r; t0=$SECONDS
last=${!#}
[ -d "$1" ] || { echo "no $1: the machine is fresh, start gpu_session.sh first"; exit 1; }
failed() { for d in "$@"; do [ -f "$d/build.failed" ] && return 0; done; return 1; }
while [ $((SECONDS - t0)) -lt "$T" ] && [ ! -f "$last/done" ] && ! failed "$@"; do
  sleep 10
done
for R in "$@"; do
  [ -d "$R" ] || continue
  n=$(basename "$R")
  for f in "$R"/*.txt "$R"/*.log; do
    [ "$f" = "$R/all.txt" ] || { echo "===== $f"; tail -c 20000 "$f"; }
  done > "$OUT/partial-$n.txt" 2>/dev/null
  [ -f "$R/all.txt" ] && cp "$R/all.txt" "$OUT/all-$n.txt"
  # a build made here (gpu_build.sh with PACK): its parts, for bench/gpu_kit.sh on the CPU machine
  cp "$R"/pack/llama-cuda.tar.xz.part-* "$OUT/" 2>/dev/null
  ls "$R"
done
tail -5 /tmp/r.log
