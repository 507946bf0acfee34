#!/usr/bin/env bash
# On the GPU host, in a device call after `setsid nohup bash bench/gpu_session.sh /tmp/w /tmp/r
# STEP... > /tmp/r.log 2>&1 &`: wait up to SECONDS (default 560, inside one call's 600 s)
# for the session to finish, then copy what it has so far into $OUT as ONE file
# (partial.txt; all.txt once done): the device returns only a few files per call.
#   Usage: bash bench/gpu_poll.sh [SECONDS] [RESULTS=/tmp/r]
T=${1:-560}; R=${2:-/tmp/r}; t0=$SECONDS
[ -d "$R" ] || { echo "no $R: the machine is fresh, start gpu_session.sh first"; exit 1; }
while [ $((SECONDS - t0)) -lt "$T" ] && [ ! -f "$R/done" ] && [ ! -f "$R/build.failed" ]; do
  sleep 10
done
for f in "$R"/*.txt "$R"/*.log; do
  [ "$f" = "$R/all.txt" ] || { echo "===== $f"; tail -c 20000 "$f"; }
done > "$OUT/partial.txt" 2>/dev/null
[ -f "$R/all.txt" ] && cp "$R/all.txt" "$OUT/"
# a build made here (gpu_build.sh with PACK): its parts, for bench/gpu_kit.sh on the CPU machine
cp "$R"/pack/llama-cuda.tar.xz.part-* "$OUT/" 2>/dev/null
tail -5 /tmp/r.log; ls "$R"
