//! Qwen3.5-MoE: the image-text checkpoints Qwen publishes (`Qwen3_5MoeForConditionalGeneration`:
//! the text model's fields under `text_config`, its tensors under `model.language_model.`, a
//! vision tower beside it, which shimmer leaves unread) and text-only ones
//! (`Qwen3_5MoeForCausalLM`, `qwen3_5_moe_text`). The text model is Qwen3-Next's with Gated DeltaNet
//! projections stored separately (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), every
//! layer MoE, and interleaved mRoPE sections that text positions (equal in all three axes) turn
//! into plain partial rotary.

use serde_json::Value;

use super::*;

pub(super) const FAMILY: FamilyDef =
    FamilyDef { architecture: "Qwen3_5MoeForConditionalGeneration", model_types: &["qwen3_5_moe"], parse: parse_image_text, spellings: &[] };
pub(super) const TEXT_FAMILY: FamilyDef =
    FamilyDef { architecture: "Qwen3_5MoeForCausalLM", model_types: &["qwen3_5_moe_text"], parse: parse_text, spellings: &[] };

/// The image-text checkpoint's tensor names: the text model under `model.language_model.`.
const IMAGE_TEXT_NAMES: DenseNames = DenseNames {
    embed: "model.language_model.embed_tokens.weight",
    final_norm: "model.language_model.norm.weight",
    lm_head: "lm_head.weight",
    input_norm: "model.language_model.layers.{L}.input_layernorm.weight",
    post_attention_norm: "model.language_model.layers.{L}.post_attention_layernorm.weight",
    q: "model.language_model.layers.{L}.self_attn.q_proj",
    k: "model.language_model.layers.{L}.self_attn.k_proj",
    v: "model.language_model.layers.{L}.self_attn.v_proj",
    o: "model.language_model.layers.{L}.self_attn.o_proj",
    q_norm: "model.language_model.layers.{L}.self_attn.q_norm.weight",
    k_norm: "model.language_model.layers.{L}.self_attn.k_norm.weight",
    sinks: "model.language_model.layers.{L}.self_attn.sinks",
    linear_attn: "model.language_model.layers.{L}.linear_attn",
    mlp_gate: "model.language_model.layers.{L}.mlp.gate_proj.weight",
    mlp_up: "model.language_model.layers.{L}.mlp.up_proj.weight",
    mlp_down: "model.language_model.layers.{L}.mlp.down_proj.weight",
    mlp_layout: DenseMlpLayout::Separate,
};

const IMAGE_TEXT_EXPERTS: ExpertNames = ExpertNames {
    router: "model.language_model.layers.{L}.mlp.gate.weight",
    router_bias: None,
    router_logit_bias: None,
    shared: Some([
        "model.language_model.layers.{L}.mlp.shared_expert.gate_proj.weight",
        "model.language_model.layers.{L}.mlp.shared_expert.up_proj.weight",
        "model.language_model.layers.{L}.mlp.shared_expert.down_proj.weight",
    ]),
    shared_gate: Some("model.language_model.layers.{L}.mlp.shared_expert_gate.weight"),
    router_hash: None,
    layout: ExpertLayout::Separate,
    gate: "model.language_model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
    up: "model.language_model.layers.{L}.mlp.experts.{E}.up_proj.weight",
    down: "model.language_model.layers.{L}.mlp.experts.{E}.down_proj.weight",
};

fn parse_image_text(obj: &Obj) -> FieldResult<ModelSpec> {
    text_config_part(obj, |text| text_model(text, FAMILY.architecture, IMAGE_TEXT_NAMES, IMAGE_TEXT_EXPERTS))
}

fn parse_text(obj: &Obj) -> FieldResult<ModelSpec> {
    text_model(obj, TEXT_FAMILY.architecture, DenseNames::LLAMA, QWEN_GATED_SHARED_NAMES)
}

fn text_model(obj: &Obj, architecture: &'static str, dense_names: DenseNames, expert_names: ExpertNames) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    // Qwen3_5MoeTextConfig's head_dim is 256 when a config leaves it out.
    if matches!(obj.get("head_dim"), None | Some(Value::Null)) {
        let mut with_default = obj.0.clone();
        with_default.insert("head_dim".into(), 256.into());
        return text_model(&Obj(&with_default), architecture, dense_names, expert_names);
    }
    let defaults = Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(2) };
    build(obj, &defaults, architecture, |sz| {
        let n = sz.num_layers;
        let attention = qwen_hybrid_attention(obj, sz, DeltaProjections::Separate)?;
        // Qwen3.5-MoE renormalises its top-k weights (no `norm_topk_prob` field).
        let mut moe = moe(obj, "num_experts", "moe_intermediate_size", true)?;
        qwen_shared_expert(obj, &mut moe)?;
        Ok(FamilyParts { attention, layers: vec![LayerMlp::Moe; n], moe, expert_names, dense_names, rms_norm_unit_offset: true })
    })
}
