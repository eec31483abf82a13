//! One parser per family's `config.json` dialect. Defaults are those of the family's transformers
//! configuration class (5.x) so a field a hub config leaves out means what it means there.
//! Structural sizes have no default: a config without them is an error naming the field.

use super::*;

/// Every family's MoE layers agree on these; families differ in defaults and names only.
fn moe(obj: &Obj, experts_key: &str, intermediate_key: &str, norm_topk_prob: bool) -> FieldResult<MoeSpec> {
    let num_experts = obj.positive(experts_key)?;
    let top_k = obj.positive("num_experts_per_tok")?;
    Ok(MoeSpec {
        num_experts,
        top_k,
        expert_intermediate_size: obj.positive(intermediate_key)?,
        scoring: RouterScoring::SoftmaxTopK { norm_topk_prob },
    })
}

fn check_act(obj: &Obj) -> FieldResult<()> {
    match obj.str_opt("hidden_act")? {
        None | Some("silu") | Some("swish") => Ok(()),
        Some(other) => Err(FieldError::new("hidden_act", format!("unsupported activation `{other}` (expected silu)"))),
    }
}

const GATE_UP_DOWN: ExpertNames = ExpertNames {
    router: "model.layers.{L}.mlp.gate.weight",
    gate: "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
    up: "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
    down: "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
};

pub(super) fn olmoe(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 10_000.0, tie_word_embeddings: false, explicit_head_dim: false, num_kv_heads: None };
    build(obj, &defaults, Family::Olmoe, "OlmoeForCausalLM", |sz| {
        // transformers sizes k_norm by hidden/heads, so an explicit, different head_dim cannot load there.
        if let Some(hd) = obj.usize_opt("head_dim")? {
            if hd != sz.head_dim {
                return Err(FieldError::new("head_dim", format!("{hd} differs from hidden_size / num_attention_heads = {}, which OLMoE requires", sz.head_dim)));
            }
        }
        let experts_key = if obj.get("num_experts").is_some() { "num_experts" } else { "num_local_experts" };
        let clip_qkv = match obj.f64_opt("clip_qkv")? {
            Some(c) if c <= 0.0 => return Err(FieldError::new("clip_qkv", "must be positive")),
            other => other.map(|c| c as f32),
        };
        Ok(FamilyParts {
            attention: AttentionSpec {
                qk_norm: QkNorm::FullProjection,
                clip_qkv,
                bias: obj.bool_or("attention_bias", false)?,
                sliding_window: vec![None; sz.num_layers],
            },
            layers: vec![LayerMlp::Moe; sz.num_layers],
            moe: moe(obj, experts_key, "intermediate_size", obj.bool_or("norm_topk_prob", false)?)?,
            expert_names: GATE_UP_DOWN,
        })
    })
}

pub(super) fn qwen3_moe(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, explicit_head_dim: true, num_kv_heads: Some(4) };
    build(obj, &defaults, Family::Qwen3Moe, "Qwen3MoeForCausalLM", |sz| {
        let n = sz.num_layers;
        // transformers 5 writes `num_local_experts` (an alias); hub checkpoints write `num_experts`.
        let experts_key = if obj.get("num_experts").is_some() { "num_experts" } else { "num_local_experts" };
        let step = obj.usize_opt("decoder_sparse_step")?.unwrap_or(1);
        if step == 0 {
            return Err(FieldError::new("decoder_sparse_step", "must be greater than zero"));
        }
        let mlp_only = obj.usize_list_or_empty("mlp_only_layers")?;
        if let Some(bad) = mlp_only.iter().find(|l| **l >= n) {
            return Err(FieldError::new("mlp_only_layers", format!("layer {bad} does not exist (num_hidden_layers = {n})")));
        }
        let layers = (0..n)
            .map(|l| {
                if !mlp_only.contains(&l) && (l + 1) % step == 0 {
                    Ok(LayerMlp::Moe)
                } else {
                    Ok(LayerMlp::Dense { intermediate_size: obj.positive("intermediate_size")? })
                }
            })
            .collect::<FieldResult<_>>()?;
        // Qwen3MoeConfig: `sliding_window` only counts when `use_sliding_window`, and then everywhere.
        let window = if obj.bool_or("use_sliding_window", false)? { Some(obj.usize_opt("sliding_window")?.unwrap_or(4096)) } else { None };
        if window == Some(0) {
            return Err(FieldError::new("sliding_window", "must be greater than zero"));
        }
        Ok(FamilyParts {
            attention: AttentionSpec {
                qk_norm: QkNorm::PerHead,
                clip_qkv: None,
                bias: obj.bool_or("attention_bias", false)?,
                sliding_window: vec![window; n],
            },
            layers,
            moe: moe(obj, experts_key, "moe_intermediate_size", obj.bool_or("norm_topk_prob", false)?)?,
            expert_names: GATE_UP_DOWN,
        })
    })
}

pub(super) fn mixtral(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 1_000_000.0, tie_word_embeddings: false, explicit_head_dim: true, num_kv_heads: None };
    build(obj, &defaults, Family::Mixtral, "MixtralForCausalLM", |sz| {
        let window = obj.usize_opt("sliding_window")?;
        if window == Some(0) {
            return Err(FieldError::new("sliding_window", "must be greater than zero"));
        }
        Ok(FamilyParts {
            attention: AttentionSpec { qk_norm: QkNorm::None, clip_qkv: None, bias: false, sliding_window: vec![window; sz.num_layers] },
            layers: vec![LayerMlp::Moe; sz.num_layers],
            // Mixtral always renormalises its top-k weights.
            moe: moe(obj, "num_local_experts", "intermediate_size", true)?,
            expert_names: ExpertNames {
                router: "model.layers.{L}.block_sparse_moe.gate.weight",
                gate: "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
                up: "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
                down: "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight",
            },
        })
    })
}
