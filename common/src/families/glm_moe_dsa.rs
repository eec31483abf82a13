//! GLM-5 (`GlmMoeDsaForCausalLM`, `glm_moe_dsa`): DeepSeek-V3's multi-head latent attention (with
//! interleaved rotary) plus DeepSeek Sparse Attention — a lightning indexer per `full` layer
//! (`indexer_types`; `shared` layers reuse the last full layer's choice) that lets each query
//! attend to its `index_topk` best keys only; `mlp_layer_types` (the first
//! `first_k_dense_replace` dense by default), then sigmoid group-limited routing with shared
//! experts.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "GlmMoeDsaForCausalLM", model_types: &["glm_moe_dsa"], parse, spellings: &[] };

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults =
        Defaults { rms_norm_eps: 1e-5, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("qk_rope_head_dim"), num_kv_heads: None };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        let n = sz.num_layers;
        let field = |key: &str, default: usize| -> FieldResult<usize> {
            match obj.usize_opt(key)?.unwrap_or(default) {
                0 => Err(FieldError::new(key, "must be greater than zero")),
                v => Ok(v),
            }
        };
        let full = per_layer(obj, "indexer_types", n, &[("full", true), ("shared", false)])?.unwrap_or_else(|| vec![true; n]);
        let mla = MlaSpec {
            q_lora_rank: Some(field("q_lora_rank", 2048)?),
            kv_lora_rank: field("kv_lora_rank", 512)?,
            qk_nope_head_dim: field("qk_nope_head_dim", 192)?,
            qk_rope_head_dim: field("qk_rope_head_dim", 64)?,
            v_head_dim: field("v_head_dim", 256)?,
            indexer: Some(IndexerSpec { heads: field("index_n_heads", 32)?, head_dim: field("index_head_dim", 128)?, top_k: field("index_topk", 2048)?, full }),
        };
        let (mut layers, moe) = grouped_moe(obj, n, (2.5, 1, 1, 3))?;
        apply_mlp_layer_types(obj, &mut layers)?;
        Ok(FamilyParts {
            // GLM-5 rotates interleaved pairs, in attention and indexer alike.
            attention: mla_attention(obj, sz, mla, true)?,
            layers,
            moe,
            expert_names: GROUPED_SIGMOID_NAMES,
            dense_names: DenseNames::LLAMA,
            rms_norm_unit_offset: false,
        })
    })
}
