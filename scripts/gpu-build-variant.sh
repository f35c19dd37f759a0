#!/usr/bin/env bash
# Builds example (and GPU test) binaries with kernel tuning knobs set (HOSTEMBED_KERNEL_DEFINES) and packs
# them into .gpu/NAME.tar.xz, to be carried beside the bundle and timed against it in the same run:
#   scripts/gpu-build-variant.sh NAME "-DAT_MIN_BLOCKS=3 -DAT_MAX_BATCH=8" bench_decode bench_batch gpu_kernels
# A name with a tests/NAME.rs or tests/NAME/ is that test binary. On the GPU machine:
# tar -C /tmp -xJf .gpu/NAME.tar.xz, then run /tmp/NAME/bench_decode ... Its build folder is
# target/variant-NAME.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: $0 NAME DEFINES EXAMPLE..." >&2; exit 2; }
name=$1 defines=$2
shift 2
export HOSTEMBED_CUDA_ARCHS="${HOSTEMBED_CUDA_ARCHS:-90}"
scripts/install-cuda.sh >/dev/null
examples=() tests=()
for ex in "$@"; do
  if [ -e "tests/$ex.rs" ] || [ -d "tests/$ex" ]; then tests+=(--test "$ex"); else examples+=(--example "$ex"); fi
done
export HOSTEMBED_KERNEL_DEFINES="$defines" CARGO_TARGET_DIR="target/variant-$name"
mkdir -p .gpu && rm -rf ".gpu/$name" && mkdir ".gpu/$name"
if [ ${#examples[@]} -gt 0 ]; then
  cargo build --release "${examples[@]}"
  for ex in "${examples[@]}"; do [ "$ex" = --example ] || cp "target/variant-$name/release/examples/$ex" ".gpu/$name/"; done
fi
if [ ${#tests[@]} -gt 0 ]; then
  cargo test --release --no-run --message-format=json "${tests[@]}" 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' | while read -r test exe; do cp "$exe" ".gpu/$name/$test"; done
fi
echo "$defines" > ".gpu/$name/DEFINES"
strip ".gpu/$name"/* 2>/dev/null || true
# Every binary carries the same kernels: a dictionary wider than one binary packs the copies as one.
XZ_OPT="-T1 --lzma2=preset=1,dict=192MiB" tar -C .gpu -cJf ".gpu/$name.tar.xz" "$name"  # as gpu-build.sh packs
rm -rf ".gpu/$name"
ls -la ".gpu/$name.tar.xz"
