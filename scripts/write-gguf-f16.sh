#!/usr/bin/env bash
# Installs the pinned `gguf` package (and the numpy and PyYAML it imports) into .pyenv/ (ignored by git)
# and writes models/gguf-f16.gguf with scripts/gguf_f16_model.py: a small random Llama laid out as
# llama.cpp's converter writes one in F16. tests/batch_formats.rs decodes it (a SKIP line without it);
# scripts/gpu-build.sh puts it in the GPU bundle for tests/gpu_engine/batches.rs.
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF_VERSION=0.19.0
NUMPY_VERSION=2.2.6
PYYAML_VERSION=6.0.2

have() { PYTHONPATH=.pyenv python3 -c "from importlib.metadata import version; assert version('gguf') == '$GGUF_VERSION'" 2>/dev/null; }
if ! have; then
  rm -rf .pyenv
  # Without its other dependencies (requests, tqdm): writing a file imports only these.
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .pyenv "gguf==$GGUF_VERSION" \
    "numpy==$NUMPY_VERSION" "pyyaml==$PYYAML_VERSION"
fi
mkdir -p models
PYTHONPATH=.pyenv python3 scripts/gguf_f16_model.py models/gguf-f16.gguf
