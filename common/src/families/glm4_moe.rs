//! GLM-4.5 (`Glm4MoeForCausalLM`): GQA with partial rotary (half by default) and an optional
//! per-head QK-norm; DeepSeek-V3's sigmoid group-limited routing with shared experts after
//! `first_k_dense_replace` dense layers.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "Glm4MoeForCausalLM", model_types: &["glm4_moe"], parse, spellings: &[] };

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(8) };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        // Glm4MoeConfig defaults partial_rotary_factor to 0.5.
        let factor = partial_rotary_factor(obj)?.unwrap_or(0.5);
        if !(factor > 0.0 && factor <= 1.0) {
            return Err(FieldError::new("partial_rotary_factor", format!("must be in (0, 1], got {factor}")));
        }
        let rotary_dim = (sz.head_dim as f64 * factor) as usize;
        let qk_norm = if obj.bool_or("use_qk_norm", false)? { QkNorm::PerHead } else { QkNorm::None };
        let mut attention = gqa(sz, qk_norm, None, obj.bool_or("attention_bias", false)?, false, vec![None; sz.num_layers]);
        attention.rotary_dim = rotary_dim;
        let (layers, moe) = grouped_moe(obj, sz.num_layers, (1.0, 1, 1, 1))?;
        Ok(FamilyParts { attention, layers, moe, expert_names: GROUPED_SIGMOID_NAMES, dense_names: DenseNames::LLAMA, rms_norm_unit_offset: false })
    })
}

/// llama.cpp's `glm4moe`: partial rotary as `rope.dimension_count`, the multi-token-prediction
/// layers counted in `block_count` (`nextn_predict_layers` of them, after the model's own; kept
/// under the checkpoint's names though shimmer does not run them).
pub(super) const GGUF: GgufDialect = GgufDialect {
    gguf_architecture: "glm4moe",
    family: FAMILY.architecture,
    accepts: |_| true,
    config: |meta| {
        let mut c = llama_config(meta, FAMILY.architecture, "glm4_moe")?;
        let blocks = meta.count("block_count")?;
        let nextn = meta.count_opt("nextn_predict_layers")?.unwrap_or(0);
        if nextn >= blocks {
            return Err(format!("`glm4moe.nextn_predict_layers` {nextn} leaves no layer of {blocks}"));
        }
        c.insert("num_hidden_layers".into(), (blocks - nextn).into());
        c.insert("num_nextn_predict_layers".into(), nextn.into());
        let head_dim = c.get("head_dim").and_then(|v| v.as_u64()).unwrap_or(1).max(1);
        let rotary = meta.count_opt("rope.dimension_count")?.unwrap_or(head_dim / 2);
        c.insert("partial_rotary_factor".into(), (rotary as f64 / head_dim as f64).into());
        c.insert("use_qk_norm".into(), meta.tensor("blk.0.attn_q_norm.weight").is_some().into());
        c.insert("attention_bias".into(), meta.tensor("blk.0.attn_q.bias").is_some().into());
        grouped_config(meta, &mut c)?;
        Ok(c)
    },
    tensor: |name, meta| {
        if let Some(t) = grouped_tensor(name) {
            return Some(t);
        }
        if let Some((layer, part)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            let at = |rest: &str| Some(GgufTensor::Same(format!("model.layers.{layer}.{rest}")));
            match part {
                // llama.cpp's GLM names the MLP's norm this way, not `ffn_norm`.
                "post_attention_norm.weight" => return at("post_attention_layernorm.weight"),
                "nextn.eh_proj.weight" => return at("eh_proj.weight"),
                "nextn.enorm.weight" => return at("enorm.weight"),
                "nextn.hnorm.weight" => return at("hnorm.weight"),
                "nextn.embed_tokens.weight" => return at("embed_tokens.weight"),
                "nextn.shared_head_norm.weight" => return at("shared_head.norm.weight"),
                "nextn.shared_head_head.weight" => return at("shared_head.head.weight"),
                _ => {}
            }
        }
        llama_tensor(name, meta, &GROUPED_SIGMOID_NAMES, false)
    },
};
