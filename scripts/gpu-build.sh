#!/usr/bin/env bash
# Builds everything the GPU machine runs (it has nvcc but no Rust toolchain) and packs it into
# .gpu/bundle.tar.xz: the GPU test binaries (tests/gpu_*; the others run in CI), example binaries, the C
# examples, the library, hostembed-server with server/tests/load.py, and models/gguf-f16.gguf (the
# `gguf` package's file; that machine has no package index). Each binary carries the kernels, so the
# bundle keeps under the 64 MiB a call may carry only without the CPU-only test binaries.
# HOSTEMBED_CUDA_ARCHS defaults to 90 here (the lent card) to keep the build short.
# `--patch NAME...` instead packs only the named GPU test binaries, rebuilt, into .gpu/patch.tar.xz,
# which scripts/gpu-run.sh unpacks over the bundle: a minute's build where the bundle takes ten.
set -euo pipefail
cd "$(dirname "$0")/.."
export HOSTEMBED_CUDA_ARCHS="${HOSTEMBED_CUDA_ARCHS:-90}"
scripts/install-cuda.sh >/dev/null
test_binaries() {
  cargo test --release --no-run --message-format=json "$@" 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["example"]:
        print(m["target"]["name"], m["executable"])
 '
}
if [ "${1:-}" = --patch ]; then
  shift
  rm -rf .gpu/patch .gpu/patch.tar.xz && mkdir -p .gpu/patch/bundle/tests
  args=(); for name in "$@"; do args+=(--test "$name"); done
  test_binaries "${args[@]}" | while read -r name exe; do cp "$exe" ".gpu/patch/bundle/tests/$name"; done
  strip .gpu/patch/bundle/tests/*
  # A dictionary wider than one binary packs the kernels every binary carries once.
  XZ_OPT="-T1 --lzma2=preset=1,dict=192MiB" tar -C .gpu/patch -cJf .gpu/patch.tar.xz bundle
  rm -rf .gpu/patch
  ls -la .gpu/patch.tar.xz
  exit 0
fi
# The last bundle stays until this one replaces it; other carried files (llama.cpp.tar.xz) stay.
rm -rf .gpu/bundle .gpu/bundle.tar.xz.new .gpu/patch.tar.xz && mkdir -p .gpu/bundle/tests .gpu/bundle/examples
cargo build --release --lib --examples
test_binaries | while read -r name exe; do
  case "$name" in gpu_*) cp "$exe" ".gpu/bundle/tests/$name" ;; esac
done
for ex in target/release/examples/*; do
  case "$ex" in *.d|*-*) continue ;; esac
  [ -x "$ex" ] && cp "$ex" .gpu/bundle/examples/
done
# The library with its soname link (libhostembed.so.MAJOR), the name the C examples record.
cp -P target/release/libhostembed.so target/release/libhostembed.so.[0-9]* .gpu/bundle/
for c in examples/*.c; do
  out=".gpu/bundle/examples/$(basename "$c" .c)"
  cc -std=c99 -O2 -Wall -Wextra -Werror -pedantic -Iinclude "$c" -L.gpu/bundle -lhostembed \
    -Wl,-rpath,'$ORIGIN/..' -o "$out" -lm
done
# hostembed-server (Zig, when scripts/install-zig.sh can provide it) finding the library one folder up,
# and the load script: scripts/server-load.sh runs both.
mkdir -p .gpu/bundle/server && cp server/tests/load.py .gpu/bundle/server/
if zig_bin=$(scripts/install-zig.sh 2>/dev/null); then
  # A baseline CPU: the binary runs on another machine.
  (cd server && "$zig_bin" build -Doptimize=ReleaseSafe -Dcpu=baseline -Dlib-dir="$PWD/../target/release" \
    -Drpath='$ORIGIN/..' --prefix "$PWD/../target/zig/gpu-server" --cache-dir "$PWD/../target/zig/gpu-server-cache")
  cp target/zig/gpu-server/bin/hostembed-server .gpu/bundle/server/
else
  echo "gpu-build: no zig $(sed -n 's/^ZIG_VERSION=//p' scripts/install-zig.sh); the bundle has no hostembed-server" >&2
fi
cp -r scripts .gpu/bundle/
scripts/write-gguf-f16.sh >/dev/null
mkdir -p .gpu/bundle/models && cp models/gguf-f16.gguf .gpu/bundle/models/
[ -d assets ] && cp -r assets .gpu/bundle/
strip .gpu/bundle/tests/* .gpu/bundle/examples/* .gpu/bundle/server/hostembed-server .gpu/bundle/libhostembed.so 2>/dev/null || true
# Every binary carries the same kernels: a dictionary wider than one binary packs the copies as one.
# The fast match finder (preset 1): 1.4 GB packed in 80 s to 42 MB, where preset 6 took 7-8 minutes for 40.
# Written aside and renamed, so a call carrying the last bundle meanwhile never finds half of one.
XZ_OPT="-T1 --lzma2=preset=1,dict=192MiB" tar -C .gpu -cJf .gpu/bundle.tar.xz.new bundle && mv .gpu/bundle.tar.xz.new .gpu/bundle.tar.xz
rm -rf .gpu/bundle
ls -la .gpu/bundle.tar.xz
