//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Llama's tensor names; GQA with a per-head QK-norm and an
//! optional sliding window; softmax top-k routing; MoE every `decoder_sparse_step` layers except
//! `mlp_only_layers`.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "Qwen3MoeForCausalLM", model_types: &["qwen3_moe"], parse, spellings: &[] };

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(4) };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        let n = sz.num_layers;
        // transformers 5 writes `num_local_experts` (an alias); hub checkpoints write `num_experts`.
        let experts_key = spelling(obj, "num_experts", "num_local_experts")?;
        let (layers, moe) = sparse_layers(obj, n, experts_key, false)?;
        // Qwen3MoeConfig: `sliding_window` only counts when `use_sliding_window`, and then everywhere.
        let window = if obj.bool_or("use_sliding_window", false)? { Some(obj.usize_opt("sliding_window")?.unwrap_or(4096)) } else { None };
        if window == Some(0) {
            return Err(FieldError::new("sliding_window", "must be greater than zero"));
        }
        Ok(FamilyParts {
            attention: {
                let bias = obj.bool_or("attention_bias", false)?;
                gqa(sz, QkNorm::PerHead, None, bias, bias, vec![window; n])
            },
            layers,
            moe,
            expert_names: GATE_UP_DOWN,
            dense_names: DenseNames::LLAMA,
            rms_norm_unit_offset: false,
        })
    })
}

/// llama.cpp's `qwen3moe`: every layer MoE (its graph has no `mlp_only_layers`), top-k weights
/// renormalised (its graph always does, unless the file says otherwise), no sliding window.
pub(super) const GGUF: GgufDialect = GgufDialect {
    gguf_architecture: "qwen3moe",
    family: FAMILY.architecture,
    accepts: |_| true,
    config: |meta| {
        let mut c = llama_config(meta, FAMILY.architecture, "qwen3_moe")?;
        let (experts, used, expert_ffn) = moe_counts(meta)?;
        let expert_ffn = expert_ffn.ok_or("`qwen3moe.expert_feed_forward_length` is missing")?;
        c.insert("num_experts".into(), experts.into());
        c.insert("num_experts_per_tok".into(), used.into());
        c.insert("moe_intermediate_size".into(), expert_ffn.into());
        c.insert("intermediate_size".into(), meta.count_opt("feed_forward_length")?.unwrap_or(expert_ffn).into());
        c.insert(
            "norm_topk_prob".into(),
            meta.arch("expert_weights_norm").and_then(|v| matches!(v, crate::gguf::Value::Bool(false)).then_some(false)).unwrap_or(true).into(),
        );
        c.insert("decoder_sparse_step".into(), 1.into());
        c.insert("mlp_only_layers".into(), serde_json::json!([]));
        c.insert("attention_bias".into(), meta.tensor("blk.0.attn_q.bias").is_some().into());
        c.insert("use_sliding_window".into(), false.into());
        Ok(c)
    },
    tensor: |name, meta| llama_tensor(name, meta, &GATE_UP_DOWN, false),
};
