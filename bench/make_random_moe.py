#!/usr/bin/env python3
"""A random-weight MoE checkpoint of a real family's shape, for streaming benchmarks.

Default: Qwen3-30B-A3B's layer shape (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
768, top-8, per-head QK-norm) at reduced depth, with the demo model's tokenizer (vocab 6,144), in
bf16, one safetensors shard per layer plus an index. Weights are N(0, 0.02) — so routing is close
to uniform, the hard case for an expert cache. Deterministic for a given --seed.

    python3 bench/make_random_moe.py --out /tmp/qwen3-30b-a3b-4l --layers 4
"""
import argparse
import json
import os
import shutil

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def bf16(rng, shape, std):
    x = (rng.standard_normal(shape, dtype=np.float32) * std).view(np.uint32)
    # Round to nearest even on the dropped 16 bits, as torch's bf16 cast does.
    x = x + 0x7FFF + ((x >> 16) & 1)
    return (x >> 16).astype(np.uint16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-intermediate", type=int, default=768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-dir", help="take tokenizer.json and tokenizer_config.json from here "
                    "(default: the demo model's, with its chat template)")
    a = ap.parse_args()
    demo = os.path.join(HERE, "..", "models", "demo")
    os.makedirs(a.out, exist_ok=True)
    tok_dir = a.tokenizer_dir or demo
    names = ["tokenizer.json", "tokenizer_config.json"] + ([] if a.tokenizer_dir else ["chat_template.jinja", "generation_config.json"])
    for name in names:
        shutil.copy(os.path.join(tok_dir, name), os.path.join(a.out, name))
    vocab_tokens = json.load(open(os.path.join(tok_dir, "tokenizer.json")))["model"]["vocab"]
    vocab = max(vocab_tokens.values()) + 1 if a.tokenizer_dir else json.load(open(os.path.join(demo, "config.json")))["vocab_size"]
    eos = vocab - 1 if a.tokenizer_dir else json.load(open(os.path.join(demo, "config.json")))["eos_token_id"]
    h, hd = a.hidden, a.head_dim
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": h, "intermediate_size": 6144, "moe_intermediate_size": a.expert_intermediate,
        "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
        "head_dim": hd, "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
        "bos_token_id": None, "eos_token_id": eos,
    }
    json.dump(config, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    rng = np.random.default_rng(a.seed)
    weight_map = {}

    def shard(name, tensors):
        save_bf16(tensors, os.path.join(a.out, name))
        for k in tensors:
            weight_map[k] = name

    ones = lambda n: np.full((n,), 0x3F80, dtype=np.uint16)  # bf16 1.0
    files = []
    top = {"model.embed_tokens.weight": bf16(rng, (vocab, h), 0.02), "lm_head.weight": bf16(rng, (vocab, h), 0.02),
           "model.norm.weight": ones(h)}
    shard("model-embed.safetensors", top)
    files.append("model-embed.safetensors")
    for l in range(a.layers):
        p = f"model.layers.{l}."
        t = {
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": bf16(rng, (a.heads * hd, h), 0.02),
            p + "self_attn.k_proj.weight": bf16(rng, (a.kv_heads * hd, h), 0.02),
            p + "self_attn.v_proj.weight": bf16(rng, (a.kv_heads * hd, h), 0.02),
            p + "self_attn.o_proj.weight": bf16(rng, (h, a.heads * hd), 0.02),
            p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate.weight": bf16(rng, (a.experts, h), 0.02),
        }
        for e in range(a.experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = bf16(rng, (a.expert_intermediate, h), 0.02)
            t[q + "up_proj.weight"] = bf16(rng, (a.expert_intermediate, h), 0.02)
            t[q + "down_proj.weight"] = bf16(rng, (h, a.expert_intermediate), 0.02)
        name = f"model-layer{l:03d}.safetensors"
        shard(name, t)
        files.append(name)
        print(f"layer {l + 1}/{a.layers} written", flush=True)
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(a.out, "model.safetensors.index.json"), "w"))


def save_bf16(tensors, path):
    """A safetensors file of bf16 tensors given as uint16 bit patterns (numpy has no bfloat16)."""
    header, at = {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text.encode())
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


if __name__ == "__main__":
    main()
