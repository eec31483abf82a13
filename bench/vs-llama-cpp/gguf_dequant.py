"""A GGUF file of a Qwen3-MoE model dequantised back into the Hugging Face checkpoint it came from.

    python gguf_dequant.py MODEL.Q4_0.gguf HF_DIR OUT_DIR

Every tensor is dequantised exactly as ggml defines its type (gguf-py's `dequantize`, from the
same llama.cpp tree the benchmarks build) and written as f32 under the checkpoint's own tensor
names, with the checkpoint's config and tokenizer files, so `shimmer quant-eval --candidate
OUT_DIR` measures llama.cpp's quantisation by the same protocol as shimmer's formats (KL against
the checkpoint as it is, over the same text).

The mapping is checked, not trusted: every tensor of the checkpoint must be produced once with
its shape, unquantised ones (norms, the router) must come back bit for bit, and quantised ones
must stay close to the original (correlation ≥ 0.98) — a transposed or permuted tensor fails.
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from safetensors.torch import load_file  # bf16 checkpoints: numpy has no bf16

PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_names(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    if name in GLOBAL:
        return {GLOBAL[name]: value}
    blk, layer, kind, suffix = name.split(".")
    assert blk == "blk" and suffix == "weight", name
    if kind in PER_LAYER:
        return {f"model.layers.{layer}.{PER_LAYER[kind]}.weight": value}
    if kind in EXPERTS:
        return {f"model.layers.{layer}.mlp.experts.{e}.{EXPERTS[kind]}.weight": value[e] for e in range(value.shape[0])}
    raise SystemExit(f"{name}: no Hugging Face name known for it")


def main() -> None:
    gguf_path, hf_dir, out_dir = (Path(a) for a in sys.argv[1:4])
    source = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        source.update({k: v.float().numpy() for k, v in load_file(f).items()})
    out: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in GGUFReader(gguf_path).tensors:
        value = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        for k, v in hf_names(t.name, value).items():
            if k in out:
                raise SystemExit(f"{k} produced twice")
            out[k] = np.ascontiguousarray(v)
            types[k] = t.tensor_type.name
    if "lm_head.weight" in out and "lm_head.weight" not in source:
        del out["lm_head.weight"]  # tied: the checkpoint has none
    missing = sorted(set(source) - set(out))
    extra = sorted(set(out) - set(source))
    if missing or extra:
        raise SystemExit(f"names differ: missing {missing[:5]}, extra {extra[:5]}")
    worst = {}
    for k, v in out.items():
        want = source[k].astype(np.float32)
        if v.shape != want.shape:
            raise SystemExit(f"{k}: shape {v.shape}, the checkpoint has {want.shape}")
        if types[k] in ("F32", "F16", "BF16"):
            if not np.array_equal(v, want):
                raise SystemExit(f"{k}: an unquantised tensor did not come back exactly")
            continue
        corr = float(np.corrcoef(v.ravel(), want.ravel())[0, 1]) if want.size > 1 else 1.0
        if not corr >= 0.98:
            raise SystemExit(f"{k} ({types[k]}): correlation {corr:.3f} with the checkpoint — mapped wrongly?")
        worst[types[k]] = min(worst.get(types[k], 1.0), corr)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (hf_dir / name).exists():
            shutil.copy(hf_dir / name, out_dir / name)
    print(json.dumps({"tensors": len(out), "types": sorted(set(types.values())), "lowest_correlation": worst}))


if __name__ == "__main__":
    main()
