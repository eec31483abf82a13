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
