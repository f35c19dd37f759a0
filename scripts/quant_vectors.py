#!/usr/bin/env python3
"""Writes tests/data/quants/: reference vectors for the quantized GGUF formats, made by the `gguf`
Python package (pip install gguf numpy), which tests/quants.rs decodes and encodes bit for bit.

For every format, <NAME>.blocks holds random blocks (with all-zero blocks, negative-zero, extreme,
infinite and subnormal scales, and the largest sub-block scales and minimums) and <NAME>.values the
little-endian f32 values gguf.quants.dequantize gives for them. For the formats gguf.quants can
quantize, <NAME>.input holds f32 rows and <NAME>.quantized the blocks gguf.quants.quantize makes of them.
Run it from the repository root: python3 scripts/quant_vectors.py
"""

import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

OUT = os.path.join("tests", "data", "quants")

# Byte offsets of the f16 fields each block holds (scale first, then a minimum where it has one), and of
# the packed sub-block scales (offset, length) for the k-quants.
FIELDS = {
    T.Q4_0: dict(f16=[0]),
    T.Q4_1: dict(f16=[0, 2]),
    T.Q5_0: dict(f16=[0]),
    T.Q5_1: dict(f16=[0, 2]),
    T.Q8_0: dict(f16=[0]),
    T.Q2_K: dict(f16=[80, 82], scales=(0, 16)),
    T.Q3_K: dict(f16=[108], scales=(96, 12)),
    T.Q4_K: dict(f16=[0, 2], scales=(4, 12)),
    T.Q5_K: dict(f16=[0, 2], scales=(4, 12)),
    T.Q6_K: dict(f16=[208], scales=(192, 16)),
}

# Scales that test the edges: f16 max, its negative, the smallest subnormal, -0, +inf, -inf, 1.
EXTREME_F16 = [0x7BFF, 0xFBFF, 0x0001, 0x8000, 0x7C00, 0xFC00, 0x3C00]


def f16_bits(rng, n):
    """Random finite f16 bit patterns of moderate magnitude (exponent 1..20), either sign."""
    exp = rng.integers(1, 21, n, dtype=np.uint16)
    mant = rng.integers(0, 1024, n, dtype=np.uint16)
    sign = rng.integers(0, 2, n, dtype=np.uint16)
    return (sign << 15) | (exp << 10) | mant


def blocks_for(qtype, rng, n_blocks):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    fields = FIELDS[qtype]
    out = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for b in range(n_blocks):
        case = b % 8
        block = out[b]
        if case == 0:
            block[:] = 0  # all zero
            continue
        values = f16_bits(rng, len(fields["f16"]))
        if case in (2, 6):
            values[:] = EXTREME_F16[(2 * (b // 8) + case // 6) % len(EXTREME_F16)]
        elif case == 3:
            values[:] = 0x8000  # negative zero scale and minimum
        elif case == 4 and "scales" in fields:
            at, n = fields["scales"]
            block[at : at + n] = 0xFF  # the largest sub-block scales and minimums
        elif case == 5:
            block[:] = 0xFF  # every quant, sub-block scale and minimum at its largest, under the largest f16
            values[:] = 0x7BFF
        for at, v in zip(fields["f16"], values):
            block[at : at + 2] = np.array([v], dtype="<u2").view(np.uint8)
    return out


def encoder_input(rng, block_size, n_blocks):
    rows = rng.standard_normal((n_blocks, block_size)).astype(np.float32)
    rows[0] = 0.0  # all zero
    rows[1] = np.where(rng.random(block_size) < 0.5, np.float32(-0.0), rows[1])  # negative zeros among values
    rows[2] *= np.float32(3e4)  # near the top of f16
    rows[3] *= np.float32(1e-6)  # scales in f16's subnormal range
    rows[4] = np.float32(0.25)  # constant
    rows[5] = np.abs(rows[5]) + 1  # all positive: a minimum above zero
    rows[6] = -np.abs(rows[6]) - 1  # all negative
    rows[7] = np.linspace(-1, 1, block_size, dtype=np.float32)  # values exactly between steps
    return rows.reshape(-1)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261202)
    for qtype in FIELDS:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_blocks = 32 if block_size == 256 else 56
        blocks = blocks_for(qtype, rng, n_blocks)
        with np.errstate(all="ignore"):
            values = quants.dequantize(blocks.reshape(-1), qtype).astype("<f4")
        assert values.size == n_blocks * block_size
        blocks.tofile(os.path.join(OUT, f"{qtype.name}.blocks"))
        values.tofile(os.path.join(OUT, f"{qtype.name}.values"))
        try:
            data = encoder_input(rng, block_size, 16)
            with np.errstate(all="ignore"):
                quantized = quants.quantize(data.reshape(1, -1), qtype)
        except NotImplementedError:
            continue
        data.astype("<f4").tofile(os.path.join(OUT, f"{qtype.name}.input"))
        np.asarray(quantized, dtype=np.uint8).tofile(os.path.join(OUT, f"{qtype.name}.quantized"))
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
