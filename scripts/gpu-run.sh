#!/usr/bin/env bash
# Runs on the GPU machine from the repo root: unpacks .gpu/bundle.tar.xz and runs the GPU suite,
# then whatever steps are named (default: tests). Logs go to $OUT (or ./gpu-out).
# Steps: info tests tests-parallel targets formats prep tc-blocks tile-halves tile-halves-streams attention-wide targets-f16 targets-kv wgmma local-pool tensor-parallel sanitize profile-decode profile-moe moe-mmv fused-tails tails-moe moe-prefetch moe-cut profile-mmv profile-tile hfref bench-embed bench-decode bench-mmv bench-model bench-prefill bench-prefill-quant
# bench-convert bench-kv torch-prefill server-load llama-cpp-moe moe-file two-chains, or any example's name (HOSTEMBED_MEMCHECK=0 leaves
# local-pool's and tensor-parallel's memcheck out). server-load measures the
# server's targets (scripts/server-load.sh: a 16 GB Llama-3-8B-shaped file written under /tmp, batch.c,
# decode.c and hostembed-server with load.py on it; about 4 minutes, meant for a call of its own). bench-mmv times the decode products alone
# and bench-model the whole 8B model's decode (BF16 and the Q4_K_M mix): as shipped, with the weights
# always streamed through registers (HOSTEMBED_MMV_STAGE=0), and without overlapped launches (HOSTEMBED_PDL=0). bench-kv measures the KV cache types on the Llama-3-8B shape:
# decode at a 64-token, a 16,384-token and a 32,768-token cache in BF16, Q8_0 and FP8_E4M3, and prompts
# of 4,096 and 16,384 tokens in BF16 and Q8_0. targets and targets-kv measure every target BENCHMARKS.md's
# first table lists as not met or not measured (each step a few model builds, meant for a call of its
# own): targets BF16 decode at a 64 and a 16,384-token cache, bench_batch at 1, 8, 16 and 64 streams, the
# decode products alone, and Q4_K_M decode with the rows on the card and in host memory; targets-kv decode
# at a 32,768-token cache in BF16 and Q8_0, with BF16 and with Q4_K_M weights. sanitize runs
# compute-sanitizer's memcheck over a small model's prompt and decode in BF16, Q8_0, Q6_K and the Q4_K_M
# mix (under Nsight Compute the 8B Q4_K_M decode once stopped with a launch failure), then racecheck over
# the Q4_K_M one and memcheck over the kernel tests; each run capped at 150 s.
# cuBLASLt is found where the machine's CUDA libraries are (the products fall back to the library's
# own kernel without it); the prompt tests run a second time with HOSTEMBED_CUBLASLT=0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT" /tmp/he
# Test binaries rebuilt since the bundle (`scripts/gpu-build.sh --patch`), carried beside it or, for the
# steps that run only them, alone.
[ -f .gpu/bundle.tar.xz ] && tar -C /tmp/he -xJf .gpu/bundle.tar.xz
[ -f .gpu/patch.tar.xz ] && tar -C /tmp/he -xJf .gpu/patch.tar.xz
B=/tmp/he/bundle
export HOSTEMBED_TEST_TMP=/tmp/he/tmp && mkdir -p "$HOSTEMBED_TEST_TMP"
# The model files the bundle carries (tests/common's model_file looks there).
export HOSTEMBED_TEST_MODELS=$B/models
steps="${*:-info tests}"
lt=$(find /opt /usr/local /usr/lib -name 'libcublasLt.so.1[23]' 2>/dev/null | head -1)
[ -n "$lt" ] && export LD_LIBRARY_PATH="$(dirname "$lt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "cuBLASLt: ${lt:-none found}" >> "$OUT/summary.txt"
summary="$OUT/summary.txt"
# At most 8 files come back: the summary, and every log packed into one archive, also when the call's
# time limit (or `timeout -s INT`) stops a step, so what the earlier steps wrote still comes back.
pack_logs() {
  (cd "$OUT" && ls *.log >/dev/null 2>&1 && tar -rf logs.tar *.log && rm -f *.log) || true
}
trap 'echo "stopped during a step at $(date +%T)" >> "$summary"; pack_logs; exit 130' INT TERM
# What a stalled process $1 is doing, into $2: its threads' states and CPU time, the card's load, and
# (by cuda-gdb) every host thread's stack and the kernels resident on the card.
dump_stall() {
  {
    echo "stall of pid $1 at $(date +%T)"
    for t in /proc/"$1"/task/*; do
      echo "thread $(basename "$t"): $(cut -d' ' -f3,14,15 "$t/stat" 2>/dev/null) wchan=$(cat "$t/wchan" 2>/dev/null)"
    done
    nvidia-smi --query-gpu=utilization.gpu,memory.used,clocks.sm --format=csv 2>&1
    timeout 120 cuda-gdb -p "$1" -batch -ex 'info threads' -ex 'thread apply all bt 30' -ex 'info cuda kernels' \
      -ex 'info cuda blocks' 2>&1 | head -600
  } > "$2" 2>&1
}
# Runs GPU test binary $1 (its log test-$1$2.log, its summary line labelled $1$3) and returns its status.
# A binary whose log stops growing for HOSTEMBED_STALL_S seconds (default 120) is a stall: its host
# threads' stacks and the kernels on the card go to stall-$1$2.log (cuda-gdb attaches; the machine has no
# gdb), then it is killed, so one hang costs minutes, not the call.
run_test() {
  local log="$OUT/test-$1${2:-}.log"
  "$B/tests/$1" --test-threads=1 --nocapture > "$log" 2>&1 &
  local pid=$! size=-1 still=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    local now; now=$(stat -c %s "$log" 2>/dev/null || echo 0)
    if [ "$now" = "$size" ]; then still=$((still + 5)); else still=0; size=$now; fi
    if [ "$still" -ge "${HOSTEMBED_STALL_S:-120}" ]; then
      dump_stall "$pid" "$OUT/stall-$1${2:-}.log"
      kill -9 "$pid" 2>/dev/null
      break
    fi
  done
  wait "$pid"
  local r=$?
  echo "test $1${3:-}: rc=$r $(grep -E '^test result' "$OUT/test-$1${2:-}.log" | tail -1)" >> "$summary"
  return $r
}
# Runs example $1 with the other arguments, appending its command line and output to $log; a failure
# sets rc and the step goes on.
run_bench() {
  echo "== $*" >> "$log"
  "$B/examples/$1" "${@:2}" >> "$log" 2>&1 || rc=$?
}
# Sets `model` to Qwen3-30B-A3B's shape in the Q4_K_M mix (MOE_DTYPE=q8_0: every matrix Q8_0), writing it
# under .gpu/models (kept while the machine is warm) when it is not there yet; a failure sets rc.
moe_model() {
  model=.gpu/models/qwen3-30b-a3b-${MOE_DTYPE:-q4_k_m}.gguf
  mkdir -p .gpu/models
  [ -f "$model" ] || "$B/examples/write_model" --shape qwen3-30b-a3b --dtype "${MOE_DTYPE:-q4_k_m}" --quick \
    --tokenizer "$B/assets/tokenizer.json" --out "$model" >> "$log" 2>&1 || rc=$?
}
for step in $steps; do
  start=$(date +%s)
  case "$step" in
    info)
      nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > "$OUT/info.log" 2>&1
      "$B/examples/device_info" >> "$OUT/info.log" 2>&1; rc=$? ;;
    tests)
      rc=0
      for t in "$B"/tests/*; do
        name=$(basename "$t")
        # The header test reads the build tree and runs the C compilers: it belongs to the build machine.
        [ "$name" = header ] && continue
        run_test "$name" || rc=$?
      done
      for name in gpu_prefill gpu_model gpu_kv; do
        HOSTEMBED_CUBLASLT=0 run_test "$name" -own " (own kernel)" || rc=$?
      done ;;
    bench-prefill)
      "$B/examples/bench_prefill" > "$OUT/bench-prefill.log" 2>&1; rc=$?
      HOSTEMBED_CUBLASLT=0 "$B/examples/bench_prefill" --quick > "$OUT/bench-prefill-own.log" 2>&1; r=$?
      [ $r -ne 0 ] && rc=$r ;;
    bench-prefill-quant)
      # BF16, Q8_0 and the Q4_K_M mix at 512 and 4,096 tokens (the conversion's share of a prompt).
      "$B/examples/bench_prefill" --lengths 512,4096 --q4-k-m > "$OUT/bench-prefill-quant.log" 2>&1; rc=$? ;;
    bench-convert)
      "$B/examples/bench_convert" > "$OUT/bench-convert.log" 2>&1; rc=$?
      "$B/examples/bench_convert" --all --out f16 >> "$OUT/bench-convert.log" 2>&1; r=$?
      [ $r -ne 0 ] && rc=$r ;;
    two-chains)
      # The half decode products' lo products in a second accumulator chain (kernels/mmv_half.cu built with
      # -DMMV_HALF_TWO_CHAINS=1, carried as .gpu/two-chains.tar.xz by scripts/gpu-build-variant.sh) against
      # the one chain as shipped (the bundle's, or a .gpu/one-chain.tar.xz variant built with =0, which with
      # the other fits a call's carry without the bundle): the variant's decode-product tests (bits against
      # the host, every token count's bits alike), then both builds' F16 and BF16 products alone at 1 to 64
      # tokens and the F16 model's 64 streams.
      rc=0
      log="$OUT/two-chains.log"
      tar -C /tmp -xJf .gpu/two-chains.tar.xz || { echo "two-chains: no .gpu/two-chains.tar.xz" >> "$summary"; rc=1; continue; }
      V=/tmp/two-chains base="$B/examples"
      [ -f .gpu/one-chain.tar.xz ] && tar -C /tmp -xJf .gpu/one-chain.tar.xz && base=/tmp/one-chain
      "$V/gpu_kernels" --test-threads=1 mmv_is_batch mmv_matches > "$OUT/test-two-chains.log" 2>&1 || rc=$?
      grep -h "^test result" "$OUT/test-two-chains.log" >> "$summary"
      for bin in "$base" "$V"; do
        echo "== $bin ($(cat "$bin/DEFINES" 2>/dev/null || echo as shipped))" >> "$log"
        for dt in F16 BF16; do
          "$bin/bench_decode" --kernels-only --no-matvec --mmv-only $dt >> "$log" 2>&1 || rc=$?
        done
        "$bin/bench_batch" --dtype f16 --streams 64 --no-long --no-host-rows --steps 32 >> "$log" 2>&1 || rc=$?
      done
      grep -E "^== |^\| 64 " "$log" >> "$summary" ;;
    llama-cpp-moe)
      # llama.cpp on Qwen3-30B-A3B's shape in the Q4_K_M mix (a 17 GB GGUF with the repo's tokenizer,
      # examples/write_model --quick, written while llama.cpp builds from a carried .gpu/llama.cpp.tar.xz;
      # both kept under .gpu for the moe-file step of the next call): llama-bench's 4,096-token prompt and
      # 128-token decode, and llama-batched-bench's 1, 16 and 64 streams of 512-token prompts and 128 rounds.
      # MOE_DTYPE=q8_0 (either step) takes a file of every matrix in Q8_0 instead (32 GB).
      rc=0
      log="$OUT/llama-cpp-moe.log"
      scripts/llama-cpp.sh build > "$OUT/llama-cpp-build.log" 2>&1 &
      build=$!
      moe_model
      wait "$build" || rc=$?
      bin=$(tail -1 "$OUT/llama-cpp-build.log")
      if [ -x "$bin/llama-bench" ] && [ -f "$model" ]; then
        "$bin/llama-bench" -m "$model" -ngl 99 -fa 1 -p 4096 -n 128 -r 3 >> "$log" 2>&1 || rc=$?
        "$bin/llama-batched-bench" -m "$model" -ngl 99 -fa 1 -c 41984 -npp 512 -ntg 128 -npl 1,16,64 \
          >> "$log" 2>&1 || rc=$?
        grep -E "^\| +(qwen3moe|[ 0-9]+\|)" "$log" >> "$summary"
      else
        echo "llama-cpp-moe: no llama.cpp build or no model (see llama-cpp-build.log)" >> "$summary"; rc=1
      fi ;;
    moe-file)
      # hostembed on the file the llama-cpp-moe step wrote (on this warm machine): one stream's decode
      # after a 64-token prompt, a 4,096-token prompt, and 1, 16 and 64 streams at a 512-token cache.
      rc=0
      log="$OUT/moe-file.log"
      model=.gpu/models/qwen3-30b-a3b-${MOE_DTYPE:-q4_k_m}.gguf
      if [ -f "$model" ]; then
        run_bench bench_decode --model "$model" --no-kernels --no-mmv --prompt 64,4096 --tokens 128 --runs 3 --greedy
        run_bench bench_batch --model "$model" --streams 1,16,64 --no-long --no-host-rows --steps 32
        grep -E "^\| (greedy|1|16|64) " "$log" >> "$summary"
      else
        echo "moe-file: no $model (run llama-cpp-moe first on the same machine)" >> "$summary"; rc=1
      fi ;;
    server-load)
      "$B/scripts/server-load.sh" "$B" "$OUT/server-load" > "$OUT/server-load-run.log" 2>&1; rc=$?
      cat "$OUT/server-load/server-load.txt" >> "$summary" 2>/dev/null
      # Its logs go into the one archive below.
      for f in "$OUT"/server-load/*; do mv "$f" "$OUT/server-load-$(basename "${f%.*}").log"; done
      rmdir "$OUT/server-load" ;;
    torch-prefill)
      PYTHONUNBUFFERED=1 python3 "$B/scripts/torch_prefill.py" > "$OUT/torch-prefill.log" 2>&1; rc=$? ;;
    hfref)
      PYTHONUNBUFFERED=1 python3 "$B/scripts/hf_reference.py" --out "$OUT/hf_reference" > "$OUT/hfref.log" 2>&1; rc=$?
      (cd "$OUT" && tar -cf hf_reference.tar hf_reference && rm -rf hf_reference) ;;
    bench-embed)
      "$B/examples/bench_embed" > "$OUT/bench-embed.log" 2>&1; rc=$? ;;
    bench-decode)
      "$B/examples/bench_decode" > "$OUT/bench-decode.log" 2>&1; rc=$? ;;
    bench-mmv)
      rc=0
      for stage in 1 0; do
        echo "HOSTEMBED_MMV_STAGE=$stage" >> "$OUT/bench-mmv.log"
        HOSTEMBED_MMV_STAGE=$stage "$B/examples/bench_decode" --kernels-only --no-matvec >> "$OUT/bench-mmv.log" 2>&1 || rc=$?
      done ;;
    bench-model)
      rc=0
      for mode in "HOSTEMBED_MMV_STAGE=1" "HOSTEMBED_MMV_STAGE=0" "HOSTEMBED_PDL=0"; do
        for dtype in q4_k_m bf16; do
          echo "$mode --dtype $dtype" >> "$OUT/bench-model.log"
          env "$mode" "$B/examples/bench_decode" --no-kernels --no-mmv --dtype "$dtype" >> "$OUT/bench-model.log" 2>&1 || rc=$?
        done
      done ;;
    bench-kv)
      rc=0
      for kv in bf16 q8_0 fp8_e4m3; do
        "$B/examples/bench_decode" --no-kernels --no-mmv --prompt 64,16384,32768 --tokens 128 --runs 3 --greedy \
          --kv "$kv" >> "$OUT/bench-kv-decode.log" 2>&1 || rc=$?
      done
      for kv in bf16 q8_0; do
        "$B/examples/bench_prefill" --quick --lengths 4096,16384 --kv "$kv" >> "$OUT/bench-kv-prefill.log" 2>&1 || rc=$?
      done ;;
    targets)
      rc=0
      log="$OUT/targets.log"
      run_bench bench_decode --no-kernels --no-mmv --prompt 64,16384 --tokens 128 --runs 3 --greedy
      run_bench bench_batch --streams 1,8,16,64 --no-long --no-host-rows --steps 32
      run_bench bench_decode --kernels-only --no-matvec
      run_bench bench_decode --no-kernels --no-mmv --dtype q4_k_m --prompt 64 --tokens 128 --runs 3 --greedy --host-rows ;;
    formats)
      # Issue 31's tables: every format's decode product at 1 to 64 tokens, then many streams (512-token
      # caches) for the files people use and the other formats the products read.
      rc=0
      log="$OUT/formats.log"
      run_bench bench_decode --kernels-only --no-matvec
      for dtype in ${HOSTEMBED_FORMATS:-f16 q4_k_m bf16 q8_0}; do
        run_bench bench_batch --dtype "$dtype" --streams 1,8,16,64 --no-long --no-host-rows --steps 32
      done ;;
    prep)
      # The half kernels past 8 tokens converting their activations once a product, against converting them
      # in every block (HOSTEMBED_MMV_PREP=0): the products alone, then the F16 and BF16 models' streams.
      rc=0
      log="$OUT/prep.log"
      for p in 1 0; do
        export HOSTEMBED_MMV_PREP=$p
        echo "HOSTEMBED_MMV_PREP=$p" >> "$log"
        run_bench bench_decode --kernels-only --no-matvec --mmv-only F16
        run_bench bench_decode --kernels-only --no-matvec --mmv-only BF16
        for dtype in f16 bf16; do
          run_bench bench_batch --dtype "$dtype" --streams 1,8,16,64 --no-long --no-host-rows --steps 32
        done
      done
      unset HOSTEMBED_MMV_PREP ;;
    tc-blocks)
      # The block formats' decode products past 8 tokens on the tile kernel (the default) against the
      # streamed integer kernel (HOSTEMBED_MMV_TC_BLOCKS=0): the kernel tests with it off first (every
      # product test through the integer kernel; the tile kernel's own tests set the option themselves),
      # then the products alone and the Q4_K_M and Q8_0 models' streams, each way.
      rc=0
      log="$OUT/tc-blocks.log"
      HOSTEMBED_MMV_TC_BLOCKS=0 run_test gpu_kernels -tc " (integer kernel)" || rc=$?
      for v in 1 0; do
        export HOSTEMBED_MMV_TC_BLOCKS=$v
        echo "HOSTEMBED_MMV_TC_BLOCKS=$v" >> "$log"
        for dtype in Q4_K Q6_K Q8_0 Q4_0 Q5_K; do
          run_bench bench_decode --kernels-only --no-matvec --mmv-only "$dtype"
        done
        for dtype in q4_k_m q8_0; do
          run_bench bench_batch --dtype "$dtype" --streams 1,8,16,64 --no-long --no-host-rows --steps 32
        done
      done
      unset HOSTEMBED_MMV_TC_BLOCKS ;;
    tile-halves)
      # The tile kernel with two warps a row set (HOSTEMBED_MMV_TC_BLOCKS=2: 4 warps a scheduler, at most 128
      # registers) against one (=1, the default): the block formats' products alone each way;
      # tile-halves-streams the Q4_K_M and Q8_0 models' 16 and 64 streams each way. Both need a bundle
      # built with the tuning kernels: HOSTEMBED_KERNEL_DEFINES=-DMMV_TUNING_KERNELS=1 scripts/gpu-build.sh.
      rc=0
      log="$OUT/tile-halves.log"
      for v in 1 2; do
        echo "== HOSTEMBED_MMV_TC_BLOCKS=$v" >> "$log"
        for dtype in Q4_K Q6_K Q8_0; do
          HOSTEMBED_MMV_TC_BLOCKS=$v run_bench bench_decode --kernels-only --no-matvec --mmv-only "$dtype"
        done
      done
      grep -E "^(== HOSTEMBED|\| mmv)" "$log" >> "$summary" ;;
    tile-halves-streams)
      rc=0
      log="$OUT/tile-halves-streams.log"
      for dtype in q4_k_m q8_0; do
        for v in 1 2; do
          echo "== HOSTEMBED_MMV_TC_BLOCKS=$v" >> "$log"
          HOSTEMBED_MMV_TC_BLOCKS=$v run_bench bench_batch --dtype "$dtype" --streams 16,64 --no-long --no-host-rows --steps 16
          grep -E "^\| (16|64) " "$log" | tail -2 | sed "s/^/$dtype $v /" >> "$summary"
        done
      done ;;
    attention-wide)
      # Decode attention's two builds (HOSTEMBED_ATTENTION_WIDE: 0 more loads in flight a thread, 1 twice
      # the blocks a multiprocessor) against the default's choice: F16 streams at 512-token caches, then
      # one stream at a 16,384-token cache.
      rc=0
      log="$OUT/attention-wide.log"
      for w in default 0 1; do
        if [ "$w" = default ]; then unset HOSTEMBED_ATTENTION_WIDE; else export HOSTEMBED_ATTENTION_WIDE=$w; fi
        echo "HOSTEMBED_ATTENTION_WIDE=$w" >> "$log"
        run_bench bench_batch --dtype f16 --streams 1,8,16,64 --no-long --no-host-rows --steps 32
        run_bench bench_decode --no-kernels --no-mmv --dtype f16 --prompt 16384 --tokens 64 --runs 2 --greedy
      done
      unset HOSTEMBED_ATTENTION_WIDE ;;
    local-pool)
      # Gemma 3's sliding-window layers in a pool of their own: the pool test against one pool, the
      # Gemma 3 suite (again with head size 256 on the split kernel), and the pool test under
      # compute-sanitizer's memcheck (a released page is never read).
      rc=0
      run_test gpu_gemma3_pool || rc=$?
      run_test gpu_gemma3 || rc=$?
      HOSTEMBED_FLASH_HEAD_256=0 run_test gpu_gemma3 -split256 || rc=$?
      grep -h "^test result" "$OUT"/test-gpu_gemma3*.log >> "$summary"
      if [ "${HOSTEMBED_MEMCHECK:-1}" != 0 ]; then
        timeout 300 compute-sanitizer --error-exitcode 99 "$B/tests/gpu_gemma3_pool" --test-threads=1 \
          > "$OUT/memcheck-local-pool.log" 2>&1 || rc=$?
        tail -3 "$OUT/memcheck-local-pool.log" >> "$summary"
      fi ;;
    tensor-parallel)
      # Models split over 2 and 4 ranks sharing this card against each whole, and the engine over 2 ranks
      # against one device's (gpu_tensor_parallel), then
      # the split under compute-sanitizer's memcheck.
      rc=0
      run_test gpu_tensor_parallel || rc=$?
      grep -h "^test result" "$OUT"/test-gpu_tensor_parallel.log >> "$summary"
      if [ "${HOSTEMBED_MEMCHECK:-1}" != 0 ]; then
        timeout 300 compute-sanitizer --error-exitcode 99 "$B/tests/gpu_tensor_parallel" --test-threads=1 llama_and \
          > "$OUT/memcheck-tensor-parallel.log" 2>&1 || rc=$?
        tail -3 "$OUT/memcheck-tensor-parallel.log" >> "$summary"
      fi ;;
    wgmma)
      # The half products past 8 tokens on the warpgroup products (HOSTEMBED_MMV_WGMMA=1, 2: pipelined)
      # against mma.sync (0): the decode products' kernel tests, the F16 and BF16 products alone, then the
      # F16 model's streams.
      rc=0
      log="$OUT/wgmma.log"
      HOSTEMBED_MMV_WGMMA=1 "$B/tests/gpu_kernels" --test-threads=1 --nocapture mmv_warpgroup mmv_is_batch mmv_matches \
        > "$OUT/test-wgmma1.log" 2>&1 || rc=$?
      HOSTEMBED_MMV_WGMMA=2 "$B/tests/gpu_kernels" --test-threads=1 --nocapture mmv_warpgroup mmv_is_batch \
        > "$OUT/test-wgmma2.log" 2>&1 || rc=$?
      grep -h "^test result" "$OUT"/test-wgmma*.log >> "$summary"
      for wg in 1 2 0; do
        export HOSTEMBED_MMV_WGMMA=$wg
        echo "HOSTEMBED_MMV_WGMMA=$wg" >> "$log"
        run_bench bench_decode --kernels-only --no-matvec --mmv-only F16
        run_bench bench_decode --kernels-only --no-matvec --mmv-only BF16
      done
      for wg in 1 2 0; do
        export HOSTEMBED_MMV_WGMMA=$wg
        echo "HOSTEMBED_MMV_WGMMA=$wg" >> "$log"
        run_bench bench_batch --dtype f16 --streams 64 --no-long --no-host-rows --steps 32
      done
      unset HOSTEMBED_MMV_WGMMA ;;
    targets-f16)
      # Issue 31's one-stream F16 rows (decode at a 64 and a 16,384-token cache, a 4,096-token prompt), the
      # streams table's largest count with the rows in host memory, and Q4_K_M decode with them there.
      rc=0
      log="$OUT/targets-f16.log"
      run_bench bench_decode --no-kernels --no-mmv --dtype f16 --prompt 64,16384 --tokens 128 --runs 3 --greedy
      run_bench bench_prefill --quick --dtype f16 --lengths 4096
      run_bench bench_batch --dtype f16 --streams 64 --no-long --steps 32
      run_bench bench_decode --no-kernels --no-mmv --dtype q4_k_m --prompt 64 --tokens 128 --runs 3 --greedy --host-rows ;;
    targets-kv)
      rc=0
      log="$OUT/targets-kv.log"
      for dtype in bf16 q4_k_m; do
        for kv in bf16 q8_0; do
          run_bench bench_decode --no-kernels --no-mmv --dtype "$dtype" --prompt 32768 --tokens 128 --runs 3 --greedy --kv "$kv"
        done
      done ;;
    sanitize)
      rc=0
      log="$OUT/sanitize.log"
      small=(--layers 2 --hidden 1024 --heads 8 --kv-heads 2 --head-dim 128 --inter 2816 --vocab 4096
             --no-kernels --no-mmv --prompt 64,600 --tokens 8 --runs 1 --greedy)
      check() {
        echo "== $*" >> "$log"
        timeout 150 compute-sanitizer --error-exitcode 99 "$@" >> "$log" 2>&1 || { r=$?; echo "rc=$r" >> "$log"; rc=$r; }
      }
      for dtype in bf16 q8_0 q6_k q4_k_m; do
        check --tool memcheck "$B/examples/bench_decode" "${small[@]}" --dtype "$dtype"
      done
      check --tool racecheck "$B/examples/bench_decode" "${small[@]}" --dtype q4_k_m
      check --tool memcheck "$B/tests/gpu_kernels" --test-threads=1 ;;
    profile-decode)
      # Nsight Compute's time for each kernel of a few batch-1 decode steps (every kernel alone, caches
      # kept; the first prompt's launches skipped): where a token's time goes, kernel by kernel.
      rc=0
      for dtype in q4_k_m bf16; do
        ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
          --launch-skip 400 --launch-count 900 "$B/examples/bench_decode" --no-kernels --no-mmv --dtype "$dtype" \
          --prompt 64 --tokens 8 --runs 1 > "$OUT/profile-decode-$dtype.log" 2>&1 || rc=$?
      done ;;
    moe-mmv)
      # Qwen3-30B-A3B's layers (12 of its 48, the Q4_K_M mix): one stream's decode and 1, 16 and 64 streams,
      # the decode rows' experts on the integer decode product, then on the warp-a-row kernels.
      rc=0
      log="$OUT/moe-mmv.log"
      for v in 1 0; do
        echo "== HOSTEMBED_MOE_MMV=$v" >> "$log"
        HOSTEMBED_MOE_MMV=$v run_bench bench_decode --qwen3-30b-a3b --layers 12 --dtype q4_k_m --no-kernels --no-mmv \
          --prompt 64 --tokens 64 --runs 3 --greedy
        HOSTEMBED_MOE_MMV=$v run_bench bench_batch --qwen3-30b-a3b --layers 12 --dtype q4_k_m --streams 1,16,64 \
          --no-long --no-host-rows --steps 16
      done
      grep -E "^(== HOSTEMBED|\| (greedy|1|16|64) )" "$log" >> "$summary" ;;
    fused-tails)
      # The fused tails (the attention parts' combine, the experts' route and weighted sum in the kernel
      # before each) on, then off, in one build: one stream's decode of Qwen3-30B-A3B's layers (12 of 48, the
      # Q4_K_M mix) and of the Llama-3-8B shape in the Q4_K_M mix and in BF16 at a 64-token and a
      # 16,384-token cache, and 64 BF16 streams.
      rc=0
      log="$OUT/fused-tails.log"
      for v in 1 0; do
        echo "== HOSTEMBED_FUSED_TAILS=$v" >> "$log"
        HOSTEMBED_FUSED_TAILS=$v run_bench bench_decode --qwen3-30b-a3b --layers 12 --dtype q4_k_m --no-kernels --no-mmv \
          --prompt 64 --tokens 64 --runs 3 --greedy
        HOSTEMBED_FUSED_TAILS=$v run_bench bench_decode --no-kernels --no-mmv --dtype q4_k_m --prompt 64 --tokens 128 \
          --runs 3 --greedy
        HOSTEMBED_FUSED_TAILS=$v run_bench bench_decode --no-kernels --no-mmv --dtype bf16 --prompt 64,16384 \
          --tokens 128 --runs 3 --greedy
        HOSTEMBED_FUSED_TAILS=$v run_bench bench_batch --dtype bf16 --streams 64 --no-long --no-host-rows --steps 32
      done
      grep -E "^(== HOSTEMBED|\| (greedy|64) )" "$log" >> "$summary" ;;
    tails-moe)
      # Which fused tail costs Mixture-of-Experts batches: Qwen3-30B-A3B's shape in the Q4_K_M mix (the
      # llama-cpp-moe step's file, written here when absent), 1, 16 and 64 streams at 512-token caches with
      # every tail, none, and each alone.
      rc=0
      log="$OUT/tails-moe.log"
      moe_model
      for v in 1 0 route sums attention; do
        echo "== HOSTEMBED_FUSED_TAILS=$v" >> "$log"
        HOSTEMBED_FUSED_TAILS=$v run_bench bench_batch --model "$model" --streams 1,16,64 --no-long --no-host-rows --steps 32
      done
      grep -E "^(== HOSTEMBED|\| (1|16|64) )" "$log" >> "$summary" ;;
    moe-prefetch)
      # The down product's prefetch of its experts' rows (HOSTEMBED_MOE_PREFETCH=1) against none, on
      # Qwen3-30B-A3B's shape in the Q4_K_M mix (the llama-cpp-moe step's file, written here when absent):
      # one stream after a 64-token prompt, then 1, 16 and 64 streams at 512-token caches.
      rc=0
      log="$OUT/moe-prefetch.log"
      moe_model
      for v in 1 0; do
        echo "== HOSTEMBED_MOE_PREFETCH=$v" >> "$log"
        HOSTEMBED_MOE_PREFETCH=$v run_bench bench_decode --model "$model" --no-kernels --no-mmv --prompt 64 --tokens 128 \
          --runs 3 --greedy
        HOSTEMBED_MOE_PREFETCH=$v run_bench bench_batch --model "$model" --streams 1,16,64 --no-long --no-host-rows --steps 32
      done
      grep -E "^(== HOSTEMBED|\| (greedy|1|16|64) )" "$log" >> "$summary" ;;
    moe-cut)
      # The experts' decode products with each cut of an expert's columns (HOSTEMBED_MOE_MMV_CUT: fill, 288
      # gate and up blocks for one token; waves, the default, 192; one, 96), on Qwen3-30B-A3B's shape in the
      # Q4_K_M mix (the llama-cpp-moe step's file, written here when absent): one stream after a 64-token
      # prompt, then 16 and 64 streams at 512-token caches.
      rc=0
      log="$OUT/moe-cut.log"
      moe_model
      for v in fill waves one; do
        echo "== HOSTEMBED_MOE_MMV_CUT=$v" >> "$log"
        HOSTEMBED_MOE_MMV_CUT=$v run_bench bench_decode --model "$model" --no-kernels --no-mmv --prompt 64 --tokens 128 \
          --runs 3 --greedy
        HOSTEMBED_MOE_MMV_CUT=$v run_bench bench_batch --model "$model" --streams 16,64 --no-long --no-host-rows --steps 16
      done
      grep -E "^(== HOSTEMBED|\| (greedy|16|64) )" "$log" >> "$summary" ;;
    profile-moe)
      # Nsight Compute's time for each kernel of a few one-stream decode steps of Qwen3-30B-A3B's layers
      # (four of its 48, the Q4_K_M mix): where a Mixture-of-Experts token's time goes.
      rc=0
      ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
        --launch-skip 300 --launch-count 600 "$B/examples/bench_decode" --qwen3-30b-a3b --layers 4 \
        --dtype q4_k_m --no-kernels --no-mmv --prompt 64 --tokens 24 --runs 1 > "$OUT/profile-moe.log" 2>&1 || rc=$? ;;
    profile-tile)
      # Nsight Compute's full set over one launch of the tile kernel (block formats past 8 tokens), its
      # details page and its per-instruction counters (SASS with stall reasons, as CSV): TILE_DTYPE
      # (default Q8_0) at TILE_TOKENS (16: the first launch of 9 to 16 tokens, 4096 x 14336; 64 for the
      # 64-token one).
      rc=0
      nt4=$(( (${TILE_TOKENS:-16} + 3) / 4 )); [ "$nt4" -gt 4 ] && nt4=$(( nt4 > 8 ? 16 : 8 ))
      d=${TILE_DTYPE:-Q8_0}
      ncu --kernel-name-base mangled --kernel-name regex:"mmvt_kernelINS_$(( ${#d} + 1 ))Q${d}ELi${nt4}ELb0E" --launch-count 1 \
        --set full -o "$OUT/profile-tile" "$B/examples/bench_decode" --kernels-only --no-matvec --mmv-only "$d" \
        > "$OUT/profile-tile-run.log" 2>&1 || rc=$?
      ncu -i "$OUT/profile-tile.ncu-rep" --page details > "$OUT/profile-tile-details.log" 2>&1 || rc=$?
      ncu -i "$OUT/profile-tile.ncu-rep" --page source --csv --print-source sass > "$OUT/profile-tile-sass.log" 2>&1 || rc=$?
      rm -f "$OUT/profile-tile.ncu-rep" ;;
    profile-mmv)
      # Nsight Compute's full set over one launch of the F16 decode product at 64 tokens (4096 x 14336,
      # activations converted once), then its per-instruction counters (SASS with stall reasons, as CSV).
      rc=0
      ncu --kernel-name-base mangled --kernel-name regex:'mmv_kernelINS_6MmaF16ELi8ELb0ELb0ELb1' --launch-skip 2 --launch-count 1 --set full \
        --import-source yes -o "$OUT/profile-mmv" "$B/examples/bench_decode" --kernels-only --no-matvec --mmv-only F16 \
        > "$OUT/profile-mmv-run.log" 2>&1 || rc=$?
      ncu -i "$OUT/profile-mmv.ncu-rep" --page details > "$OUT/profile-mmv-details.log" 2>&1 || rc=$?
      ncu -i "$OUT/profile-mmv.ncu-rep" --page source --csv --print-source sass > "$OUT/profile-mmv-sass.log" 2>&1 || rc=$?
      rm -f "$OUT/profile-mmv.ncu-rep" ;;
    tests-parallel)
      # The GPU suites at once on the one card (each binary still runs its tests one at a time).
      rc=0
      pids=()
      # gpu_placement measures the card's free memory, so it runs alone, after the others.
      for t in "$B"/tests/*; do
        name=$(basename "$t")
        case "$name" in header|gpu_placement) continue ;; esac
        run_test "$name" &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
      if [ -x "$B/tests/gpu_placement" ]; then run_test gpu_placement || rc=$?; fi ;;
    *)
      if [ -x "$B/examples/$step" ]; then "$B/examples/$step" > "$OUT/$step.log" 2>&1; rc=$?
      else echo "unknown step $step"; rc=2; fi ;;
  esac
  echo "step $step: rc=$rc in $(( $(date +%s) - start ))s" >> "$summary"
done
pack_logs
cat "$summary"
