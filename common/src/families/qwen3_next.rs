//! Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet layers (`linear_attention`, projections
//! grouped per key head) among full-attention layers (`full_attention`, every
//! `full_attention_interval`-th by default) whose `q_proj` also yields an output gate; partial
//! rotary (a quarter of `head_dim` by default), per-head QK-norm, zero-centred RMSNorm weights;
//! softmax top-k routing and a shared expert behind a sigmoid gate; MoE every
//! `decoder_sparse_step` layers except `mlp_only_layers`.

use serde_json::Value;

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "Qwen3NextForCausalLM", model_types: &["qwen3_next"], parse, spellings: &[] };

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    // Qwen3NextConfig's head_dim is 256 when a config leaves it out (not hidden / heads).
    if matches!(obj.get("head_dim"), None | Some(Value::Null)) {
        let mut with_default = obj.0.clone();
        with_default.insert("head_dim".into(), 256.into());
        return parse_with_head_dim(&Obj(&with_default));
    }
    parse_with_head_dim(obj)
}

fn parse_with_head_dim(obj: &Obj) -> FieldResult<ModelSpec> {
    let defaults = Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(2) };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        let n = sz.num_layers;
        let attention = qwen_hybrid_attention(obj, sz, DeltaProjections::Grouped)?;
        let (layers, mut moe) = sparse_layers(obj, n, "num_experts", true)?;
        qwen_shared_expert(obj, &mut moe)?;
        Ok(FamilyParts { attention, layers, moe, expert_names: QWEN_GATED_SHARED_NAMES, dense_names: DenseNames::LLAMA, rms_norm_unit_offset: true })
    })
}
