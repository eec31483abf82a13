"""The GGUF reader's fixture: a GGUF file written by gguf-py (the `gguf` package, pinned in
requirements.txt) holding a tensor of every type shimmer reads, and the values gguf-py's own
`gguf.quants.dequantize` gives for each — which shimmer must give bit for bit
(tests/tests/gguf.rs).

    python tests/oracle/make_gguf_fixture.py      # writes tests/fixtures/gguf/

Q8_0, Q4_0 and BF16 are quantised by gguf-py from random values; Q4_K and Q6_K (which gguf-py
only reads) are random blocks with finite half-precision scales — every bit pattern of their
codes, scales and mins is a value ggml defines.
"""
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as T
from safetensors.numpy import save_file

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "gguf"
ROWS, COLS = 3, 512


def random_k_blocks(rng, qtype, n_blocks):
    """Random blocks of a K-quant with their half-precision fields finite and of modest size."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    halves = rng.normal(0, 0.05, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == T.Q4_K:  # d, dmin first
        blocks[:, 0:4] = halves
    else:  # Q6_K: d last
        blocks[:, -2:] = halves[:, 0:2]
    return blocks


def main():
    rng = np.random.default_rng(20261203)
    OUT.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(OUT / "quants.gguf"), arch="qwen3moe")
    w.add_block_count(2)
    w.add_string("shimmer.note", "a GGUF reader fixture — ünïcödé")
    w.add_float32("shimmer.f32", 0.125)
    w.add_bool("shimmer.flag", True)
    w.add_array("shimmer.tokens", ["a", "é", "<|im_end|>", ""])
    w.add_array("shimmer.ids", [3, 1, 4, 1, 5])
    expected = {}
    values = rng.normal(0, 1, size=(ROWS, COLS)).astype(np.float32)
    for name, qtype in [("f32", T.F32), ("f16", T.F16), ("bf16", T.BF16), ("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q4_k", T.Q4_K), ("q6_k", T.Q6_K)]:
        if qtype in (T.Q4_K, T.Q6_K):
            block_values, _ = gguf.GGML_QUANT_SIZES[qtype]
            raw = random_k_blocks(rng, qtype, ROWS * COLS // block_values).reshape(ROWS, -1)
        elif qtype == T.F32:
            raw = values
        elif qtype == T.F16:
            raw = values.astype(np.float16)
        else:
            raw = gguf.quants.quantize(values, qtype)
        w.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=qtype)
        expected[f"blk.0.{name}.weight"] = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(ROWS, COLS))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(expected, str(OUT / "quants.expected.safetensors"))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
