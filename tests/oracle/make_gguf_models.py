"""GGUF import fixtures: small random models of the families shimmer imports from GGUF, converted to
GGUF Q8_0 by llama.cpp's own converter, with what transformers computes on the same weights as
gguf-py dequantises them.

    python tests/oracle/make_gguf_models.py LLAMA_CPP_DIR    # writes tests/fixtures/gguf/<family>/

LLAMA_CPP_DIR is llama.cpp's tree (bench/vs-llama-cpp/llama-cpp.sh fetches it inside the pinned
llama-cpp-python source package). For each family:

1. a random model (shapes as the family's fixture, settings llama.cpp's graph has: no dense layer
   among MoE ones, no sliding window, no clip) is saved with the family fixture's tokenizer and
   chat template;
2. `convert_hf_to_gguf.py --outtype q8_0` (through bench/vs-llama-cpp/convert_with_known_pretokenizer.py,
   which tells it the fixture tokenizer splits as GPT-2) writes `model.q8_0.gguf`;
3. gguf-py reads that file and dequantises every tensor; each checkpoint tensor is found in it
   through gguf-py's own name map (stacked experts sliced, llama.cpp's q/k row order undone) and
   checked to lie within Q8_0's rounding of the saved weights;
4. transformers runs those dequantised weights (`oracle.json`, `oracle.safetensors`, as
   make_fixtures.py records them) — what shimmer must reproduce after `shimmer convert --from
   model.q8_0.gguf` (tests/tests/gguf.rs).

Only `model.q8_0.gguf` and the oracle files are kept; the random checkpoint is rebuilt from its
seed when needed.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(HERE))
import make_fixtures as mf  # noqa: E402


def vocab_of(fixture):
    """Every id the fixture's tokenizer can produce (llama.cpp's converter wants them all embedded)."""
    t = json.load(open(FIXTURES / fixture / "tokenizer.json"))
    return 1 + max([*t["model"]["vocab"].values(), *(a["id"] for a in t["added_tokens"])])


def configs():
    olmoe = json.load(open(FIXTURES / "olmoe" / "config.json"))
    qwen = json.load(open(FIXTURES / "qwen3_moe" / "config.json"))
    mixtral = json.load(open(FIXTURES / "mixtral" / "config.json"))
    deepseek = json.load(open(FIXTURES / "deepseek_v3" / "config.json"))
    # llama.cpp's GLM vocabulary reader wants GLM's own specials ([gMASK], <|user|>, …): the
    # GLM-5 fixture's tokenizer and template have them.
    glm = json.load(open(FIXTURES / "glm_moe_dsa" / "config.json"))
    return {
        # OLMoE: MHA, QK-norm over the whole projection, no renormalisation; llama.cpp's olmoe
        # graph has no clip_qkv and its converter writes rms eps 1e-5.
        "olmoe": ("olmoe", OlmoeConfig(
            vocab_size=olmoe["vocab_size"], hidden_size=96, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
            num_experts=12, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=None,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=olmoe["eos_token_id"], pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), torch.bfloat16, 1100),
        # Qwen3-MoE: GQA 4/2 with head_dim 32 ≠ 64/4, per-head QK-norm, renormalised top-4 of 16,
        # tied embeddings, f32.
        "qwen3_moe": ("qwen3_moe", Qwen3MoeConfig(
            vocab_size=qwen["vocab_size"], hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=256, rms_norm_eps=1e-6, num_experts=16, num_experts_per_tok=4,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=qwen["eos_token_id"], pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), torch.float32, 1200),
        # Mixtral: GQA 4/2 (so llama.cpp permutes q and k with different head counts), linear
        # rope scaling, a BOS-adding tokenizer, f16.
        "mixtral": ("mixtral", MixtralConfig(
            vocab_size=mixtral["vocab_size"], hidden_size=96, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            num_local_experts=8, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False,
            bos_token_id=mixtral["bos_token_id"], eos_token_id=mixtral["eos_token_id"], pad_token_id=0,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), torch.float16, 1300),
        # DeepSeek-V3: MLA with q_lora_rank (llama.cpp splits kv_b_proj per head), YaRN with one
        # mscale (llama.cpp keeps only mscale_all_dim), a dense first layer, sigmoid routing over
        # 4 groups (2 chosen) with a random correction bias, a shared expert, renormalised × 2.5.
        "deepseek_v3": ("deepseek_v3", DeepseekV3Config(
            vocab_size=deepseek["vocab_size"], hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_interleave=True, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=deepseek["eos_token_id"], pad_token_id=0,
            attention_bias=False, scoring_func="sigmoid",
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8}), torch.bfloat16, 1400),
        # GLM-4.5: GQA with half rotary, per-head QK-norm, q/k/v biases, a dense first layer,
        # sigmoid routing over 2 groups (1 chosen), a shared expert, × 1.5, one MTP layer counted
        # in llama.cpp's block count.
        "glm4_moe": ("glm_moe_dsa", Glm4MoeConfig(
            vocab_size=vocab_of("glm_moe_dsa"), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=12,
            num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=1.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=glm["eos_token_id"], pad_token_id=0, num_nextn_predict_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), torch.bfloat16, 1500),
    }


# Token texts llama.cpp ends generation on in any vocabulary (its `special_eog_ids` list), which
# `shimmer convert --from` keeps as stop ids: no greedy path may pass one.
LLAMA_CPP_EOG = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                 "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"}

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]


def save_source(tokenizer_from, config, dtype, seed, d):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mf.randomize(model, 0.25, seed)
    model.to(dtype).save_pretrained(d)
    for f in TOKENIZER_FILES:
        if (FIXTURES / tokenizer_from / f).exists():
            shutil.copy(FIXTURES / tokenizer_from / f, d / f)


def convert(llama, src, out):
    subprocess.run([sys.executable, str(ROOT / "bench" / "vs-llama-cpp" / "convert_with_known_pretokenizer.py"), str(llama),
                    str(src), "--outtype", "q8_0", "--outfile", str(out)], check=True, stdout=subprocess.DEVNULL,
                   stderr=None if os.environ.get("FIXTURE_WHY") else subprocess.DEVNULL)


def unpermute(w, n_head):
    """Undoes llama.cpp's `permute` (reshape(n_head, 2, rows/n_head/2, …).swapaxes(1, 2))."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized_checkpoint(gguf_path, src, config):
    """The source checkpoint's tensors as the GGUF holds them (gguf-py's dequantisation), found by
    gguf-py's name map; each checked against the source within Q8_0's rounding."""
    sys.path.insert(0, str(LLAMA / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch_name = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    values = {}
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]
        values[t.name] = (np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape), t.tensor_type)
    n_layers = config.num_hidden_layers
    tmap = gguf.get_tensor_name_map(arch, n_layers)
    source = {}
    for f in sorted(src.glob("*.safetensors")):
        source.update(load_file(f))
    out, used = {}, set()
    for name, w in source.items():
        expert = None
        parts = name.split(".")
        lookup = name
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            expert = int(parts[i + 1])
            lookup = ".".join(parts[:i + 1] + parts[i + 2:])
        # llama.cpp's converter reads the router's bias as `e_score_correction.bias`.
        base, suffix = lookup.replace("e_score_correction_bias", "e_score_correction.bias").rsplit(".", 1)
        candidates = [base]
        if "block_sparse_moe.experts" in base:  # llama.cpp's converter stacks Mixtral's under this name
            candidates.append(base.replace("model.layers", "layers").replace("block_sparse_moe.experts", "feed_forward.experts"))
        gname = next((g for g in (tmap.get_name(c) for c in candidates) if g is not None), None)
        if gname is None:
            raise SystemExit(f"{name}: gguf-py's name map has no GGUF name for it")
        gname = f"{gname}.{suffix}"
        if name == "lm_head.weight" and gname not in values:
            continue
        if name.endswith("kv_b_proj.weight") and gname not in values:
            # llama.cpp's MLA split: per head, the key rows transposed ([heads, rank, nope]) and
            # the value rows ([heads, v, rank]).
            kname, vname = gname.replace("attn_kv_b", "attn_k_b"), gname.replace("attn_kv_b", "attn_v_b")
            (k, kq), (vv, vq) = values[kname], values[vname]
            heads = k.shape[0]
            merged = np.concatenate([k.transpose(0, 2, 1), vv], axis=1).reshape(-1, k.shape[1])
            used.update([kname, vname])
            values[gname] = (merged, gguf.GGMLQuantizationType.Q8_0 if gguf.GGMLQuantizationType.Q8_0 in (kq, vq) else kq)
            assert merged.shape[0] % heads == 0
        v, qtype = values[gname]
        used.add(gname)
        if expert is not None:
            v = v[expert]
        if arch_name == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            v = unpermute(v, heads)
        ref = w.float().numpy()
        assert v.shape == ref.shape, (name, v.shape, ref.shape)
        if qtype == gguf.GGMLQuantizationType.Q8_0:
            # q = round(x / d) with d = amax / 127, read back as q · f16(d): off by half a step
            # plus 127 times f16's rounding of d.
            blocks = np.abs(ref.reshape(-1, 32)).max(axis=1, keepdims=True)
            bound = (blocks / 127 * (0.5 + 127 * 2.0**-11) * 1.01 + 1e-7).repeat(32, axis=1).reshape(ref.shape)
            assert (np.abs(v - ref) <= bound).all(), f"{name}: dequantised values beyond Q8_0 rounding of the source"
        else:
            # Rows Q8_0 cannot hold (not a multiple of 32) and norms stay F32/F16/BF16: the
            # source's values, rounded to that type.
            rounded = torch.from_numpy(ref).to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype.name]).float().numpy()
            assert np.array_equal(v, rounded), f"{name}: a {qtype.name} tensor differs from the source"
        out[name] = torch.from_numpy(np.array(v, dtype=np.float32))
    unused = {n for n in values if n not in used and "attn_kv_b" not in n}
    if unused:
        raise SystemExit(f"GGUF tensors no checkpoint tensor maps to: {sorted(unused)}")
    return out


def main():
    global LLAMA
    LLAMA = Path(sys.argv[1]).resolve()
    only = sys.argv[2:] or None
    for name, (family, config, dtype, seed) in configs().items():
        if only and name not in only:
            continue
        out = FIXTURES / "gguf" / name
        for attempt in range(20):
            with tempfile.TemporaryDirectory() as tmp:
                src, deq = Path(tmp) / "src", Path(tmp) / "deq"
                src.mkdir()
                deq.mkdir()
                save_source(family, config, dtype, seed + attempt, src)
                gguf_path = Path(tmp) / "model.q8_0.gguf"
                convert(LLAMA, src, gguf_path)
                tensors = dequantized_checkpoint(gguf_path, src, config)
                save_file(tensors, str(deq / "model.safetensors"))
                cfg = json.load(open(src / "config.json"))
                cfg["dtype"] = "float32"
                cfg.pop("torch_dtype", None)
                json.dump(cfg, open(deq / "config.json", "w"), indent=2)
                for f in TOKENIZER_FILES:
                    if (src / f).exists():
                        shutil.copy(src / f, deq / f)
                ok, record, logits = mf.oracle(str(deq), mf.PROMPTS)
                vocab = json.load(open(src / "tokenizer.json"))["added_tokens"]
                eog = {t["id"] for t in vocab if t["content"] in LLAMA_CPP_EOG}
                if any(t in eog for p in record["prompts"] for t in p["greedy"]):
                    ok = False
                if not ok:
                    print(f"{name}: seed {seed + attempt} gives EOS or a near-tie; trying the next", file=sys.stderr)
                    continue
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir(parents=True)
                shutil.copy(gguf_path, out / "model.q8_0.gguf")
                record["gguf_seed"] = seed + attempt
                json.dump(record, open(out / "oracle.json", "w"), indent=1, ensure_ascii=False)
                save_file(logits, str(out / "oracle.safetensors"))
                size = sum(f.stat().st_size for f in out.iterdir())
                print(f"{name}: {size / 1e6:.2f} MB, seed {seed + attempt}")
                break
        else:
            raise SystemExit(f"{name}: no seed without EOS/near-ties in 20 tries")


if __name__ == "__main__":
    main()
