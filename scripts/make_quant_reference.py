#!/usr/bin/env python3
"""Regenerate tests/data/quant/: dequantization (and, for Q5_0/Q5_1, quantization)
reference data for ggml's block types, computed by gguf-py (the `gguf` package,
ggml's own Python port of its reference code), none of it pdcluster code.

Run (from the repository root; any Python with numpy and gguf==0.19.0, e.g. the
venv of scripts/requirements-reference.txt):

    /opt/pdref-venv/bin/python scripts/make_quant_reference.py --out tests/data/quant

For each type T of TYPES it writes
  T.blocks  N raw blocks: random bytes, with the fp16 scale fields replaced by
            random finite values (normal, subnormal, zero, negative), so every
            bit pattern of the quantized fields occurs;
  T.f32     gguf.quants.dequantize() of those blocks, little-endian float32.
For Q5_0 and Q5_1 also
  T.input.f32   random floats (normal rows, a constant row, a row with one spike);
  T.quantized   gguf.quants.quantize() of them (ggml's quantize_row_*_ref).
The output is deterministic (seeded).
"""
import argparse
import os

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
BLOCKS = 24  # per type


def fp16_offsets(name: str) -> list[int]:
    """Byte offsets of the fp16 scale fields within one block."""
    return {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[name]


def random_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Scales as quantizers produce them, plus edge cases."""
    v = (rng.uniform(1e-4, 0.1, n) * rng.choice([-1.0, 1.0], n)).astype(np.float16)
    edges = np.array([0.0, 6e-8, -6e-8, 1e-5, 65504.0 / 1024, -0.5], dtype=np.float16)
    v[: len(edges)] = edges[:n]
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(20261203)
    for name in TYPES:
        qtype = Q[name]
        block_elems, block_bytes = quants.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(BLOCKS, block_bytes), dtype=np.uint8)
        for off in fp16_offsets(name):
            raw[:, off : off + 2] = random_fp16(rng, BLOCKS).view(np.uint8).reshape(BLOCKS, 2)
        values = quants.dequantize(raw.reshape(-1), qtype).astype("<f4").reshape(-1)
        assert values.size == BLOCKS * block_elems and np.all(np.isfinite(values))
        raw.tofile(os.path.join(args.out, f"{name}.blocks"))
        values.tofile(os.path.join(args.out, f"{name}.f32"))
        if name in ("Q5_0", "Q5_1"):
            rows = rng.normal(0.0, 1.0, size=(8, 64)).astype(np.float32)
            rows[1, :] = 0.25  # constant
            rows[2, :] = 0.0
            rows[3, 5] = 40.0  # one spike
            rows[4] *= 1e-6
            quantized = quants.quantize(rows, qtype)
            rows.astype("<f4").tofile(os.path.join(args.out, f"{name}.input.f32"))
            quantized.tofile(os.path.join(args.out, f"{name}.quantized"))
        print(f"{name}: {BLOCKS} blocks of {block_elems} elements")


if __name__ == "__main__":
    main()
