#!/usr/bin/env python3
"""Writes tests/fixtures/quant_reference.json: random blocks of every ggml type the engine
reads, with their dequantized values from the `gguf` PyPI package (llama.cpp's own Python
reference). The Rust kernel tests compare against it.

Usage: python3 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install gguf numpy
       /tmp/gvenv/bin/python scripts/gen_quant_fixtures.py
"""
import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, dequantize, quantize

rng = np.random.default_rng(20261121)
cases = []
for qtype in [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = 2 if block_size == 256 else 4
    n = block_size * n_blocks if block_size > 1 else 64
    if qtype in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0):
        values = rng.normal(0.0, 1.0, size=(1, n)).astype(np.float32)
        raw = quantize(values, qtype)
    else:
        # K-quants: random bytes are valid blocks once the f16 super-block scales are sane.
        raw = rng.integers(0, 256, size=n_blocks * type_size, dtype=np.uint8)
        blocks = raw.reshape(n_blocks, type_size)
        scale = np.array([0.0123], dtype=np.float16).view(np.uint8)
        smin = np.array([0.0456], dtype=np.float16).view(np.uint8)
        if qtype == T.Q6_K:
            blocks[:, 208:210] = scale
        else:
            blocks[:, 0:2] = scale
            blocks[:, 2:4] = smin
        raw = blocks.reshape(1, -1)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    out = dequantize(raw.reshape(1, -1), qtype).reshape(-1)
    cases.append({"type": qtype.name, "bytes_hex": raw.tobytes().hex(), "values": [float(v) for v in out]})

path = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/quant_reference.json"
path.write_text(json.dumps({"generator": "scripts/gen_quant_fixtures.py (gguf PyPI package)", "cases": cases}) + "\n")
print(f"wrote {path} ({len(cases)} types)")
