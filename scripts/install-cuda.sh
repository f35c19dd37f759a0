#!/usr/bin/env bash
# Installs the pinned CUDA compiler wheels into .cuda/ (ignored), where build.rs looks last.
# The nvcc wheel's own requirements are unpinned, so every part is named and pinned here.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cuda
if [ -x "$dest/nvidia/cu13/bin/nvcc" ] && [ -f "$dest/nvidia/cu13/nvvm/bin/cicc" ]; then
  exit 0
fi
python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$dest" \
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
  nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
"$dest/nvidia/cu13/bin/nvcc" --version | tail -1
