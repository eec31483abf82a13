//! GLM-5 (`GlmMoeDsaForCausalLM`, `glm_moe_dsa`): DeepSeek-V3's multi-head latent attention (with
//! interleaved rotary) plus DeepSeek Sparse Attention — a lightning indexer per `full` layer
//! (`indexer_types`; `shared` layers reuse the last full layer's choice) that lets each query
//! attend to its `index_topk` best keys only; `mlp_layer_types` (the first
//! `first_k_dense_replace` dense by default), then sigmoid group-limited routing with shared
//! experts.

use serde_json::Value;

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
        let full = match obj.get("indexer_types") {
            None | Some(Value::Null) => vec![true; n],
            Some(Value::Array(kinds)) => {
                if kinds.len() != n {
                    return Err(FieldError::new("indexer_types", format!("{} entries for {n} layers", kinds.len())));
                }
                kinds
                    .iter()
                    .enumerate()
                    .map(|(l, k)| match k.as_str() {
                        Some("full") => Ok(true),
                        Some("shared") => Ok(false),
                        _ => Err(FieldError::new("indexer_types", format!("entry {l}: expected \"full\" or \"shared\", got {k}"))),
                    })
                    .collect::<FieldResult<Vec<_>>>()?
            }
            Some(v) => return Err(FieldError::new("indexer_types", format!("expected a list, got {v}"))),
        };
        let mla = MlaSpec {
            q_lora_rank: Some(field("q_lora_rank", 2048)?),
            kv_lora_rank: field("kv_lora_rank", 512)?,
            qk_nope_head_dim: field("qk_nope_head_dim", 192)?,
            qk_rope_head_dim: field("qk_rope_head_dim", 64)?,
            v_head_dim: field("v_head_dim", 256)?,
            indexer: Some(IndexerSpec { heads: field("index_n_heads", 32)?, head_dim: field("index_head_dim", 128)?, top_k: field("index_topk", 2048)?, full }),
        };
        let mut scale = (mla.qk_head_dim() as f64).powf(-0.5);
        if let RopeScaling::Yarn { factor, mscale_all_dim: Some(m), .. } = &sz.rope.scaling {
            let ms = if *factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
            scale *= ms * ms;
        }
        let bias = obj.bool_or("attention_bias", false)?;
        let (mut layers, moe) = grouped_moe(obj, n, (2.5, 1, 1, 3))?;
        apply_mlp_layer_types(obj, &mut layers)?;
        Ok(FamilyParts {
            attention: AttentionSpec {
                rotary_dim: mla.qk_rope_head_dim,
                kind: AttentionKind::Mla(mla),
                qk_norm: QkNorm::None,
                clip_qkv: None,
                bias,
                o_bias: bias,
                // GLM-5 rotates interleaved pairs, in attention and indexer alike.
                rope_interleave: true,
                scale: scale as f32,
                sliding_window: vec![None; n],
                sinks: false,
                output_gate: false,
                mixers: vec![Mixer::Attention; n],
                gated_delta: None,
                no_rope: false,
            },
            layers,
            moe,
            expert_names: GROUPED_SIGMOID_NAMES,
            dense_names: DenseNames::LLAMA,
            rms_norm_unit_offset: false,
        })
    })
}
