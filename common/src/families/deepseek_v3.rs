//! DeepSeek-V3 (`DeepseekV3ForCausalLM`; also Kimi K2 and other derivatives): multi-head latent
//! attention (with or without `q_lora_rank`, interleaved rotary by default, YaRN's softmax-scale
//! correction), the first `first_k_dense_replace` layers dense, then sigmoid group-limited routing
//! with `e_score_correction_bias` and shared experts.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "DeepseekV3ForCausalLM", model_types: &["deepseek_v3", "kimi_k2"], parse, spellings: &[] };

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults =
        Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("qk_rope_head_dim"), num_kv_heads: None };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        let mla = MlaSpec {
            q_lora_rank: obj.usize_opt("q_lora_rank")?,
            kv_lora_rank: obj.positive("kv_lora_rank")?,
            qk_nope_head_dim: obj.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: obj.positive("qk_rope_head_dim")?,
            v_head_dim: obj.positive("v_head_dim")?,
            indexer: None,
        };
        if mla.q_lora_rank == Some(0) {
            return Err(FieldError::new("q_lora_rank", "must be greater than zero, or null for a plain q_proj"));
        }
        let (layers, moe) = grouped_moe(obj, sz.num_layers, (2.5, 8, 4, 3))?;
        Ok(FamilyParts {
            attention: mla_attention(obj, sz, mla, obj.bool_or("rope_interleave", true)?)?,
            layers,
            moe,
            expert_names: GROUPED_SIGMOID_NAMES,
            dense_names: DenseNames::LLAMA,
            rms_norm_unit_offset: false,
        })
    })
}
