#!/usr/bin/env bash
# Writes tests/data/quants/llama_cpp.input and <NAME>.llama_cpp: f32 rows (normal values, all-zero,
# negative zeros, near f16's top and in its subnormal range, constant, one-signed, evenly spaced,
# heavy-tailed, outliers, mostly zero) and the blocks llama.cpp's reference quantizers
# (quantize_row_*_ref in ggml-quants.c) make of them, for every quantized format. tests/quants.rs
# encodes the rows and wants these blocks bit for bit.
#
# The C comes from the ggml sources the PyPI sdist ggml-python vendors; it is compiled here, for this
# run only, without contraction to fused multiply-adds (-ffp-contract=off), as the reference's plain
# float operations. Needs pip, a C compiler and numpy.
set -euo pipefail
cd "$(dirname "$0")/.."

GGML_PYTHON=0.0.45
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary ggml-python --dest "$work" \
  "ggml-python==$GGML_PYTHON"
tar -xzf "$work/ggml_python-$GGML_PYTHON.tar.gz" -C "$work"
src="$work/ggml_python-$GGML_PYTHON/vendor/ggml/src"
# Only the quantizers: the rest of ggml is never called, so its symbols stay unresolved.
cc -O2 -ffp-contract=off -fPIC -shared -I"$src" -I"$src/../include" -I"$src/ggml-cpu" "$src/ggml-quants.c" \
  -o "$work/libquants.so" -Wl,--unresolved-symbols=ignore-all

python3 - "$work/libquants.so" tests/data/quants <<'PY'
import ctypes, os, sys
import numpy as np

lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_LAZY)
out = sys.argv[2]
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34,
               "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

rng = np.random.default_rng(20261202)
rows = rng.standard_normal((24, 256)).astype(np.float32)
rows[0] = 0.0
rows[1] = np.where(rng.random(256) < 0.5, np.float32(-0.0), rows[1])
rows[2] *= np.float32(3e4)
rows[3] *= np.float32(1e-6)
rows[4] = np.float32(0.25)
rows[5] = np.abs(rows[5]) + 1
rows[6] = -np.abs(rows[6]) - 1
rows[7] = np.linspace(-1, 1, 256, dtype=np.float32)
rows[8] = rng.uniform(-1, 1, 256).astype(np.float32) * np.float32(0.02)
rows[9] = (rng.standard_normal(256) ** 3).astype(np.float32)
rows[10, ::16] = 50.0
rows[11] = np.where(rng.random(256) < 0.9, 0.0, rows[11]).astype(np.float32)
x = np.ascontiguousarray(rows.reshape(-1), dtype="<f4")
x.tofile(os.path.join(out, "llama_cpp.input"))
for name, size in BLOCK_BYTES.items():
    fn = getattr(lib, "quantize_row_" + name.lower().replace("_k", "_K") + "_ref")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    blocks = np.zeros(x.size // (256 if name.endswith("_K") else 32) * size, dtype=np.uint8)
    fn(x.ctypes.data, blocks.ctypes.data, x.size)
    blocks.tofile(os.path.join(out, f"{name}.llama_cpp"))
print(f"wrote {out}/llama_cpp.input and {len(BLOCK_BYTES)} block files", file=sys.stderr)
PY
