#!/usr/bin/env bash
# On the offline GPU host: build (bench/gpu_build.sh), then run the benchmarks one after
# another, each into its own file under RESULTS. Meant to run detached (setsid nohup) so
# it outlives one device call; each call copies RESULTS into $OUT.
#   Usage: bench/gpu_session.sh WORKDIR RESULTS [STEP...]
#   Steps: engine compare stall repro stall-cpumoe (default: all, in that order); also
#   stall-cpumoe-ours (two more experts-in-RAM stalls, ours only),
#   quick variants, hybrid (issue 6: planner under a VRAM budget vs --n-cpu-moe),
#   hybrid-planned (the planned layout only, 3 repeats), hybrid-threads (the planned layout,
#   our server at HYBRID_THREADS threads), compare-1r (every N, one repeat), compare-n1
#   (1 and 4 users, greedy and typical, 2 repeats),
#   hybrid-levers (the planned layout with all 16 threads, telemetry off, --no-mmap) and
#   tap-cost (router telemetry on/off, engine only), kv-pressure (issue 19: bench.kv_pressure
#   and bench.swap_cost), multiturn (issue 20: bench.multiturn, all-GPU and --cpu-moe),
#   structured (issue 21: bench.mask_time, bench.constrained all-GPU), native (engine alone, greedy and
#   typical, 1/8/32 sequences: the native decode-and-sample step), deploy-run (deploy/run.sh end
#   to end: dry run, serve, a request), stall24 (both stalls, ours at 250 ms), multiturn-cpumoe
#   (the chat with experts in RAM, our default target), issue32 (the experts-in-RAM stall,
#   multiturn all-GPU and experts in RAM, each bounded), side (bench.side_prefill),
#   side-serve (the served side context: the experts-in-RAM stall and chat), side-stall
#   (the stall alone, our slow steps logged; side-stall-peer: llama-server reading the
#   model, as ours does there by default), typical (the sampled throughput
#   rows), ubatch-ab (experts in RAM: physical
#   batches of 512 and 2048 rows), cache-cuda and cache-curve (the routed-expert cache on
#   the GPU: its tests, then bench.routing_curve; with .gpu-pre/ from
#   bench/gpu_crossbuild.sh nothing is built here), reference (issue 45: the reference model's
#   width, a 7-layer slice: load, expert-cache A/B, cost model; reference-ab without the load),
#   zero-copy (issue 46: bench/zero_copy.cu, host memory read in place by the GPU).
#   At the end every result file is concatenated into
#   RESULTS/all.txt: the device returns only a few files.
set -uo pipefail
W=${1:?WORKDIR}; R=${2:?RESULTS}; shift 2
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(engine compare stall repro stall-cpumoe)
mkdir -p "$R"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -m1 "Model name"; nproc; } > "$R/machine.txt"
CURVE_MODEL="$W/moe12.gguf"  # cache-curve's and the serve check's: 12 layers of the 30B-A3B shape (4 GiB)
KIT=.gpu-pre; [ -f .gpu-pre/llama-cuda.tar.xz ] || KIT=.gpu
if [ ! -f "$W/env.sh" ]; then
  if [ $KIT = .gpu-pre ]; then  # built on the CPU machine: bench/gpu_crossbuild.sh
    bash bench/gpu_prebuilt.sh "$W" > "$R/build.txt" 2>&1 || { echo failed > "$R/build.failed"; exit 1; }
  else  # built here (~5 min on 16 cores), and packed into RESULTS/pack for the next calls
    # (the 30B-A3B model only if a step measures it: the reference slice needs the disk)
    need30=1; for s in "${steps[@]}"; do [[ $s == reference* || $s == zero-copy ]] && need30=0; done
    SYNTH30=$need30 PACK="$R/pack" bash bench/gpu_build.sh "$W" > "$R/build.txt" 2>&1 \
      || { echo failed > "$R/build.failed"; exit 1; }
  fi
fi
synth() {  # OUT LAYERS: the Qwen3-30B-A3B shape (as gpu_build.sh writes it), atomically
  [ -f "$1" ] && return 0
  PYTHONPATH="$W/site" python3 -m bench.synth_moe "$1.tmp" --arch qwen3moe \
    --layers "$2" --embd 2048 --heads 32 --kv-heads 4 --head-dim 128 --ff 6144 \
    --experts 128 --used 8 --ff-exp 768 --vocab 151936 > "$1.log" 2>&1 && mv "$1.tmp" "$1"
}
only_ref=1; for s in "${steps[@]}"; do [[ $s == reference* || $s == zero-copy ]] || only_ref=0; done
if [ $only_ref = 0 ]; then  # (the reference steps check the kit on a narrow model of their own)
  synth "$CURVE_MODEL" 12 || { echo "no $CURVE_MODEL" > "$R/build.failed"; exit 1; }
fi
for s in "${steps[@]}"; do  # the other steps' model, written while the first steps run
  if [[ $s != cache-cuda && $s != cache-e2e && $s != cache-curve && $s != reference* \
    && $s != zero-copy ]] \
    && [ ! -f "$W/moe30.gguf" ]; then
    synth "$W/moe30.gguf" 48 &
    synth30=$!
    break
  fi
done
# shellcheck disable=SC1091
source "$W/env.sh"
run() {  # name, command...
  local name=$1; shift
  echo "$ $*" > "$R/$name.txt"
  local t0=$SECONDS
  "$@" >> "$R/$name.txt" 2> "$R/$name.log"
  echo "rc=$? seconds=$((SECONDS - t0))" >> "$R/$name.txt"
}
stall16k() {  # name, seconds (0: no limit), bench.stall options...: the experts-in-RAM stall
  local name=$1 limit=$2; shift 2
  run "$name" timeout "$limit" python3 -m bench.stall --gpu --model "$MODEL" \
    --prompt-tokens 16384 --decoders 4 --cpu-moe "$@"
}
step_log() {  # [NAME]: our server's planned steps and side prefills, from the last stall's log
  d=$(ls -dt /tmp/onegpu-stall-* | head -1)
  grep -E "planned step|side prefill" "$d/ours.log" | cut -c1-260 > "$R/${1:-side}-steps.txt"
}
# the kit must serve before anything is measured: our server on the synthetic model, with
# the routed-expert cache, answers one request (else the run stops here, saying why)
if [ -f "$CURVE_MODEL" ]; then
  run serve-check timeout 300 python3 -m bench.gpu_serve_check --model "$CURVE_MODEL" -- \
    --cpu-moe --expert-cache-slots 16
  grep -q "^served:" "$R/serve-check.txt" || { cp "$R/serve-check.txt" "$R/build.failed"; exit 1; }
fi
for s in "${steps[@]}"; do
  if [ -n "${synth30:-}" ] && [[ $s != cache-cuda && $s != cache-e2e && $s != cache-curve \
    && $s != reference* ]]; then
    wait "$synth30" || { echo "no moe30.gguf" > "$R/$s.txt"; }
    synth30=
  fi
  case $s in
    engine) run engine python3 -m bench.engine_step --model "$MODEL" --concurrency 1 4 8 16 32 ;;
    compare) run compare python3 -m bench.compare --gpu --peer-bin "$PEER_BIN" --model "$MODEL" \
      --concurrency 1 4 8 16 32 --isl 128 --osl 128 --waves 2 --lockstep-waves 2 --repeats 2 ;;
    stall) run stall python3 -m bench.stall --gpu --peer-bin "$PEER_BIN" --model "$MODEL" \
      --prompt-tokens 65000 --decoders 4 ;;
    stall-cpumoe) stall16k stall-cpumoe 0 --peer-bin "$PEER_BIN" ;;
    native) run engine python3 -m bench.engine_step --model "$MODEL" --concurrency 1 8 32 \
      --modes host-greedy typical --steps 200 ;;
    engine-quick) run engine python3 -m bench.engine_step --model "$MODEL" --concurrency 8 32 \
      --modes host-greedy device-greedy --steps 32 ;;
    compare-quick) run compare python3 -m bench.compare --gpu --peer-bin "$PEER_BIN" \
      --model "$MODEL" --concurrency 8 32 --isl 128 --osl 128 --waves 2 --lockstep-waves 2 \
      --repeats 1 ;;
    repro-quick) run repro python3 -m bench.repro --model "$MODEL" --trials 20 --duration 4 ;;
    stall-cpumoe-ours)  # the experts-in-RAM stall, ours only, CPUMOE_REPEATS (2) times more,
      # each step traced (--log-level debug; the server logs stay under /tmp/onegpu-stall-*)
      for i in $(seq 2 $((1 + ${CPUMOE_REPEATS:-2}))); do
        stall16k "stall-cpumoe-$i" 0 --no-peer --ours-args="--log-level debug"
      done ;;
    stall-ours) run stall python3 -m bench.stall --gpu --model "$MODEL" --prompt-tokens 65000 \
      --decoders 4 --no-peer ;;
    repro) run repro python3 -m bench.repro --model "$MODEL" --trials 20 --duration 10 ;;
    hybrid) run hybrid python3 -m bench.hybrid --model "$MODEL" --peer-bin "$PEER_BIN" \
      --vram-budget "${HYBRID_BUDGET:-half-experts}" --concurrency 1 4 8 --repeats 2 ;;
    hybrid-planned)  # issue 6 item 3 alone: the planned layout and its two peers, 3 repeats
      run hybrid-planned python3 -m bench.hybrid --model "$MODEL" --peer-bin "$PEER_BIN" \
        --vram-budget "${HYBRID_BUDGET:-half-experts}" --concurrency 1 4 8 --layouts planned \
        --repeats "${HYBRID_REPEATS:-3}" ;;
    hybrid-threads)  # the planned layout with our server at HYBRID_THREADS (8 12) threads
      for t in ${HYBRID_THREADS:-8 12}; do
        run "hybrid-t$t" python3 -m bench.hybrid --model "$MODEL" --peer-bin "$PEER_BIN" \
          --vram-budget half-experts --concurrency 1 4 8 --layouts planned --repeats 1 \
          --ours-args="--threads $t"
      done ;;
    compare-n1)  # one and four users, greedy and typical, 4 waves, 2 repeats: the first
      # requests after a start (issue 47's one-user output rate)
      run compare-n1 python3 -m bench.compare --gpu --peer-bin "$PEER_BIN" --model "$MODEL" \
        --sampling greedy typical --concurrency 1 4 --isl 128 --osl 128 --waves 4 \
        --lockstep-waves 1 --repeats 2 ;;
    compare-1r) run compare python3 -m bench.compare --gpu --peer-bin "$PEER_BIN" \
      --model "$MODEL" --concurrency 1 4 8 16 32 --isl 128 --osl 128 --waves 2 \
      --lockstep-waves 2 --repeats 1 ;;
    hybrid-levers)  # the planned layout with one lever each: all 16 cores; no telemetry; read
      run hybrid-t16 python3 -m bench.hybrid --model "$MODEL" --peer-bin "$PEER_BIN" \
        --vram-budget half-experts --concurrency 1 4 8 --layouts planned --repeats 2 \
        --ours-args="--threads 16"
      run hybrid-notap python3 -m bench.hybrid --model "$MODEL" --peer-bin "$PEER_BIN" \
        --vram-budget half-experts --concurrency 1 4 8 --layouts planned \
        --ours-args="--expert-sample-rate 0"
      # read, not mapped: RAM experts repacked for the CPU kernels (llama.cpp's advice)
      run hybrid-nommap python3 -m bench.hybrid --model "$MODEL" --peer-bin "$PEER_BIN" \
        --vram-budget half-experts --concurrency 1 4 8 --layouts planned \
        --ours-args="--no-mmap" --peer-args="-lm none" ;;
    kv-pressure)  # issue 19: KV pressure against llama-server (-kvu, same pool), then swap cost
      run kv-pressure python3 -m bench.kv_pressure --gpu --peer-bin "$PEER_BIN" --model "$MODEL" \
        --scenario mixed ten two-big --n-ctx 16384 --clients 12 --min-prompt 3000 \
        --max-prompt 14000 --osl 96 --repeats "${KV_REPEATS:-2}" --json "$R/kv-pressure.json"
      run swap-cost python3 -m bench.swap_cost --model "$MODEL" --tokens 4096 12288 --repeats 3 ;;
    multiturn)  # issue 20: prefix cache vs llama-server's, all on the GPU then experts in RAM;
      # the pool holds the burst's 32 prompts without sharing (what llama-server needs)
      # (llama-server with -np 32 gives each slot 139264/32 tokens; --cache-ram 0: its host-RAM
      # prompt cache made a 32 x 4K burst take minutes; a scenario past 150 s is given up)
      run multiturn python3 -m bench.multiturn --gpu --peer-bin "$PEER_BIN" --model "$MODEL" \
        --n-ctx 139264 --repeats "${MT_REPEATS:-1}" --peer-args "--cache-ram 0" \
        --scenario-timeout 150 --json "$R/multiturn.json"
      run multiturn-cpumoe python3 -m bench.multiturn --gpu --cpu-moe --peer-bin "$PEER_BIN" \
        --model "$MODEL" --n-ctx 139264 --peer-args "--cache-ram 0" --scenario-timeout 240 \
        --json "$R/multiturn-cpumoe.json" ;;
    structured)  # issue 21: mask time on the model's vocabulary, constrained users beside free
      run mask-time python3 -m bench.mask_time --model "$MODEL"
      run constrained python3 -m bench.constrained --gpu --model "$MODEL" ;;
    deploy-run)  # issue 22: deploy/run.sh end to end on the synthetic model: dry-run, serve,
      # a request, the binding it reported (one-gpu on PATH runs api.server.cli from this checkout)
      mkdir -p "$W/bin" && printf '#!/bin/sh\nexec python3 -m api.server.cli "$@"\n' > "$W/bin/one-gpu"
      chmod +x "$W/bin/one-gpu"
      PATH="$W/bin:$PATH" run deploy-dry bash deploy/run.sh --dry-run --model "$MODEL" \
        --n-ctx 32768
      PATH="$W/bin:$PATH" bash deploy/run.sh --model "$MODEL" --n-ctx 32768 --port 8091 \
        > "$R/deploy-serve.log" 2>&1 &
      srv=$!
      run deploy-request python3 -m bench.deploy_smoke --port 8091 --log "$R/deploy-serve.log"
      kill "$srv" 2>/dev/null; wait "$srv" ;;
    stall24)  # issue 24: the stall policy, each with llama-server in the same run
      run stall python3 -m bench.stall --gpu --peer-bin "$PEER_BIN" --model "$MODEL" \
        --prompt-tokens 65000 --decoders 4
      stall16k stall-cpumoe 0 --peer-bin "$PEER_BIN" ;;
    issue32)  # issue 32 on the model whose tokens use every expert: the experts-in-RAM 16K
      # stall, the chat and burst all on the GPU, then with the experts in RAM (bounded:
      # each of llama-server's 512-row batches copies every expert, ~16 GB)
      stall16k stall-cpumoe 420 --peer-bin "$PEER_BIN"
      run multiturn timeout 300 python3 -m bench.multiturn --gpu --peer-bin "$PEER_BIN" \
        --model "$MODEL" --n-ctx 139264 --peer-args "--cache-ram 0" --scenario-timeout 120 \
        --json "$R/multiturn.json"
      run multiturn-cpumoe timeout 560 python3 -m bench.multiturn --gpu --cpu-moe \
        --peer-bin "$PEER_BIN" --model "$MODEL" --n-ctx 139264 --peer-args "--cache-ram 0" \
        --scenario-timeout 180 --json "$R/multiturn-cpumoe.json" ;;
    side-serve)  # issue 32: the served side context (auto with --cpu-moe on a GPU): the
      # experts-in-RAM 16K stall, then the experts-in-RAM chat and burst
      stall16k stall-cpumoe 420 --peer-bin "$PEER_BIN"
      run multiturn-cpumoe timeout 560 python3 -m bench.multiturn --gpu --cpu-moe \
        --peer-bin "$PEER_BIN" --model "$MODEL" --n-ctx 139264 --peer-args "--cache-ram 0" \
        --scenario-timeout 180 --json "$R/multiturn-cpumoe.json" ;;
    side-stall)  # issue 32: the experts-in-RAM 16K stall, ours logging its slow steps
      stall16k stall-cpumoe 420 --peer-bin "$PEER_BIN" \
        --ours-args "--repro-slots 0 --log-level debug"
      step_log ;;
    side-stall-ours)  # side-stall, ours only (when little device time is left)
      stall16k stall-cpumoe-ours 200 --no-peer --ours-args "--repro-slots 0 --log-level debug"
      step_log ;;
    side-stall-peer)  # side-stall, llama-server given -lm none (read, as ours by default)
      stall16k stall-cpumoe-peer 300 --peer-bin "$PEER_BIN" \
        --ours-args "--repro-slots 0 --log-level debug" --peer-args="-lm none"
      step_log ;;
    side)  # issue 32: a second context prefills the 16K prompt beside the decoders (engine
      # alone), experts in RAM, then all on the GPU
      run side-cpumoe timeout 300 python3 -m bench.side_prefill --model "$MODEL" --cpu-moe --ubatch 2048 \
        --prompt-tokens 16384
      run side-gpu timeout 200 python3 -m bench.side_prefill --model "$MODEL" \
        --prompt-tokens 16384 ;;
    typical)  # issue 34: the sampled rows, both servers given the same sampling values
      run compare-typical timeout 420 python3 -m bench.compare --gpu --peer-bin "$PEER_BIN" \
        --model "$MODEL" --sampling typical --concurrency 1 4 8 16 32 --isl 128 --osl 128 \
        --waves 2 --lockstep-waves 2 --repeats 1 ;;
    multiturn-cpumoe)  # issue 20 with the default stall target: experts in RAM, chat only
      run multiturn-cpumoe python3 -m bench.multiturn --gpu --cpu-moe --peer-bin "$PEER_BIN" \
        --model "$MODEL" --n-ctx 139264 --peer-args "--cache-ram 0" --scenario chat \
        --scenario-timeout 240 --json "$R/multiturn-cpumoe.json" ;;
    ubatch-ab)  # experts in RAM: ours with 512-row physical batches (the old default), then
      # both servers with 2048-row ones (llama-server given the batches ours chooses)
      run multiturn-cpumoe-ub512 python3 -m bench.multiturn --gpu --cpu-moe --model "$MODEL" \
        --n-ctx 139264 --scenario chat --no-peer --ours-args="--repro-slots 0 --n-ubatch 512"
      run multiturn-cpumoe-ub2048 python3 -m bench.multiturn --gpu --cpu-moe \
        --peer-bin "$PEER_BIN" --model "$MODEL" --n-ctx 139264 --scenario chat \
        --peer-args "--cache-ram 0 -ub 2048" --scenario-timeout 240 ;;
    cache-cuda)  # issue 23: patch 0002's tests with the bank on the GPU, then the served e2e
      ONEGPU_CACHE_TEST_DEVICE=CUDA0 run cache-cuda timeout 180 python3 -m pytest -q -s \
        -p no:cacheprovider -W default tests/test_moe_cache.py
      if ! grep -q "rc=0 " "$R/cache-cuda.txt"; then  # which of CUDA's shortcuts matters
        GGML_CUDA_DISABLE_GRAPHS=1 GGML_CUDA_DISABLE_FUSION=1 ONEGPU_CACHE_TEST_DEVICE=CUDA0 \
          run cache-cuda-plain timeout 180 python3 -m pytest -q -s -p no:cacheprovider \
          -W default tests/test_moe_cache.py -k equal
      fi
      run cache-e2e timeout 180 python3 -m pytest -q -p no:cacheprovider -W default \
        tests/test_expert_cache_e2e.py ;;
    cache-repro)  # issue 31: the reproducible lane bit-identical under load, cache on
      run cache-repro timeout 300 python3 -m bench.repro --model "$MODEL" --trials 20 \
        --duration 2 --ours-args="--cpu-moe --expert-cache-slots 32" ;;
    cache-ab)  # issue 31: the cache vs llama-server's best --n-cpu-moe at equal VRAM
      run cache-ab python3 -m bench.expert_cache_ab --model "$MODEL" --peer-bin "$PEER_BIN" \
        --layers ${AB_LAYERS:-15 27} --routings ${AB_ROUTINGS:-skewed uniform} \
        --admission "${AB_ADMISSION:-3}" --references --users ${AB_USERS:-1 4 8} \
        --work "$W/ab" --json "$R/cache-ab.json" \
        ${AB_MISSES_GPU:+--misses-gpu} ${AB_EXTRA:-}  # (issue 46: each cached row again, misses on the GPU)
      cp "$R/cache-ab.json" "$R/cache-ab-json.txt" 2>/dev/null ;;
    cache-curve)  # issue 23: hit rate and output rate by cache size, skewed routing, 4 users
      run cache-curve timeout 240 python3 -m bench.routing_curve --model "$CURVE_MODEL" --slots 0,32,64 \
        --routings skewed --uploads 1 --rounds 1 --out 128
      # the peer with every expert in RAM (its cost does not depend on the routing)
      run cache-curve-peer timeout 90 "$PEER_BIN/llama-batched-bench" -m "$CURVE_MODEL" -ngl 99 --cpu-moe \
        -c 8192 -b 2048 -ub 512 -npp 64 -ntg 128 -npl 1,4 -fa on ;;
    reference|reference-ab)  # issue 45: a slice of the reference model at its true width,
      # 1 dense + 6 MoE layers (~38 GB; the disk holds one copy, so routings are switched in
      # place): a narrow deepseek2 served first (the kit's check of the architecture), the
      # expert-cache A/B at 38% of the slice's expert bytes under the measured, skewed and
      # as-written routings with the cost model fitted to its rows, then the load (read and
      # page-locked, mapped, pinning refused)
      [ -f "$W/ref-narrow.gguf" ] || PYTHONPATH="$W/site" python3 -m bench.synth_moe \
        "$W/ref-narrow.gguf" --shape reference-narrow > /dev/null 2>&1
      run ref-narrow timeout 120 python3 -m bench.gpu_serve_check --model "$W/ref-narrow.gguf" \
        -- --cpu-moe --expert-cache-slots 4
      grep -q "^served:" "$R/ref-narrow.txt" || { cp "$R/ref-narrow.txt" "$R/build.failed"; exit 1; }
      if [ ! -f "$W/ref7.gguf" ]; then
        t0=$SECONDS
        PYTHONPATH="$W/site" python3 -m bench.synth_moe "$W/ref7.tmp" --shape reference \
          --layers 7 --dense 1 > "$R/ref-synth.txt" 2>&1 && mv "$W/ref7.tmp" "$W/ref7.gguf"
        echo "written in $((SECONDS - t0)) s" >> "$R/ref-synth.txt"
      fi
      run ref-ab timeout "${REF_AB_LIMIT:-1500}" python3 -m bench.expert_cache_ab \
        --model "$W/ref7.gguf" --peer-bin "$PEER_BIN" --vram-share 0.38 \
        --routings ${REF_ROUTINGS:-measured skewed uniform} --admission 3 --osl 64 \
        --references "${REF_REFERENCES:-all}" --users ${REF_USERS:-1 4 8} \
        --work /tmp/w/refab --json "$R/ref-ab.json" ${REF_MISSES_GPU:+--misses-gpu} ${REF_EXTRA:-}
      cp "$R/ref-ab.json" "$R/ref-ab-json.txt" 2>/dev/null  # (all.txt takes .txt files)
      run ref-model python3 -m bench.hybrid_model --fit "$R/ref-ab.json" \
        --model "$W/ref7.gguf" --out "$R/ref-constants.json" --reference
      if [ "$s" = reference ]; then
        run ref-load timeout 600 python3 -m bench.load_time --model "$W/ref7.gguf" \
          --work /tmp/w/load -- --cpu-moe --expert-cache-slots 32
      fi ;;
    zero-copy)  # issue 46: a GPU kernel reading page-locked host memory in place, beside
      # the copy engine and VRAM (what a missed expert costs computed on the GPU from RAM)
      nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
      run zero-copy bash -c "$nvcc -O2 -arch=sm_90 -o /tmp/zero_copy bench/zero_copy.cu && /tmp/zero_copy" ;;
    tap-cost)  # paired, step by step (bench/tap_cost.py), then as a throughput difference
      run tapcost python3 -m bench.tap_cost --model "$MODEL" --concurrency 1 8 32 --steps 400
      run tapcost-throughput python3 -m bench.engine_step --model "$MODEL" --concurrency 1 8 32 \
        --modes host-greedy --expert-sample-rates 0 0.01 --repeats 3 --steps 400 --n-ctx 24576 ;;
  esac
done
cp -r .bench/runs "$R/bench-runs" 2>/dev/null
# llama.cpp's own account of its buffers in our server's logs (what the plan's reserves model)
grep -h "buffer size\|GPU: weights" "$R"/bench-runs/*/ours*.log 2>/dev/null \
  | sed 's/^[-0-9]* [0-9:,.]* //' | sort | uniq -c > "$R/buffers.txt"
for f in "$R"/machine.txt "$R"/*.txt "$R"/*.log; do
  [ "$f" = "$R/all.txt" ] || { echo "===== $(basename "$f")"; cat "$f"; }
done > "$R/all.txt" 2>/dev/null
date -u > "$R/done"
