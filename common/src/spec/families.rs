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
        shared_intermediate_size: None,
    })
}

fn check_act(obj: &Obj) -> FieldResult<()> {
    match obj.str_opt("hidden_act")? {
        None | Some("silu") | Some("swish") => Ok(()),
        Some(other) => Err(FieldError::new("hidden_act", format!("unsupported activation `{other}` (expected silu)"))),
    }
}

/// Attention fields every GQA family without partial rotary shares.
fn gqa(sz: &Sizes, qk_norm: QkNorm, clip_qkv: Option<f32>, bias: bool, o_bias: bool, sliding_window: Vec<Option<usize>>) -> AttentionSpec {
    AttentionSpec {
        kind: AttentionKind::Gqa,
        qk_norm,
        clip_qkv,
        bias,
        o_bias,
        rotary_dim: sz.head_dim,
        rope_interleave: false,
        scale: (sz.head_dim as f32).powf(-0.5),
        sliding_window,
    }
}

const GATE_UP_DOWN: ExpertNames = ExpertNames {
    router: "model.layers.{L}.mlp.gate.weight",
    router_bias: None,
    shared: None,
    gate: "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
    up: "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
    down: "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
};

pub(super) fn olmoe(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: None, num_kv_heads: None };
    build(obj, &defaults, Family::Olmoe, "OlmoeForCausalLM", |sz| {
        // transformers sizes k_norm by hidden/heads, so an explicit, different head_dim cannot load there.
        if let Some(hd) = obj.usize_opt("head_dim")? {
            if hd != sz.head_dim {
                return Err(FieldError::new(
                    "head_dim",
                    format!("{hd} differs from hidden_size / num_attention_heads = {}, which OLMoE requires", sz.head_dim),
                ));
            }
        }
        let experts_key = spelling(obj, "num_experts", "num_local_experts")?;
        let clip_qkv = match obj.f64_opt("clip_qkv")? {
            Some(c) if c <= 0.0 => return Err(FieldError::new("clip_qkv", "must be positive")),
            other => other.map(|c| c as f32),
        };
        Ok(FamilyParts {
            attention: {
                let bias = obj.bool_or("attention_bias", false)?;
                gqa(sz, QkNorm::FullProjection, clip_qkv, bias, bias, vec![None; sz.num_layers])
            },
            layers: vec![LayerMlp::Moe; sz.num_layers],
            moe: moe(obj, experts_key, "intermediate_size", obj.bool_or("norm_topk_prob", false)?)?,
            expert_names: GATE_UP_DOWN,
        })
    })
}

pub(super) fn qwen3_moe(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(4) };
    build(obj, &defaults, Family::Qwen3Moe, "Qwen3MoeForCausalLM", |sz| {
        let n = sz.num_layers;
        // transformers 5 writes `num_local_experts` (an alias); hub checkpoints write `num_experts`.
        let experts_key = spelling(obj, "num_experts", "num_local_experts")?;
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
            attention: {
                let bias = obj.bool_or("attention_bias", false)?;
                gqa(sz, QkNorm::PerHead, None, bias, bias, vec![window; n])
            },
            layers,
            moe: moe(obj, experts_key, "moe_intermediate_size", obj.bool_or("norm_topk_prob", false)?)?,
            expert_names: GATE_UP_DOWN,
        })
    })
}

pub(super) fn mixtral(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 1_000_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: None };
    build(obj, &defaults, Family::Mixtral, "MixtralForCausalLM", |sz| {
        let window = obj.usize_opt("sliding_window")?;
        if window == Some(0) {
            return Err(FieldError::new("sliding_window", "must be greater than zero"));
        }
        Ok(FamilyParts {
            attention: gqa(sz, QkNorm::None, None, false, false, vec![window; sz.num_layers]),
            layers: vec![LayerMlp::Moe; sz.num_layers],
            // Mixtral always renormalises its top-k weights.
            moe: moe(obj, "num_local_experts", "intermediate_size", true)?,
            expert_names: ExpertNames {
                router: "model.layers.{L}.block_sparse_moe.gate.weight",
                router_bias: None,
                shared: None,
                gate: "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
                up: "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
                down: "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight",
            },
        })
    })
}

const GROUPED_SIGMOID_NAMES: ExpertNames = ExpertNames {
    router: "model.layers.{L}.mlp.gate.weight",
    router_bias: Some("model.layers.{L}.mlp.gate.e_score_correction_bias"),
    shared: Some([
        "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
        "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        "model.layers.{L}.mlp.shared_experts.down_proj.weight",
    ]),
    gate: "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
    up: "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
    down: "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
};

/// Which of a field's two spellings the config uses (the hub's, else transformers 5's alias); a
/// config with neither is refused naming both.
fn spelling(obj: &Obj, hub: &'static str, alias: &'static str) -> FieldResult<&'static str> {
    match (obj.get(hub).is_some(), obj.get(alias).is_some()) {
        (true, _) => Ok(hub),
        (false, true) => Ok(alias),
        (false, false) => Err(FieldError::new(hub, format!("missing (nor its alias `{alias}`)"))),
    }
}

/// The sigmoid, group-limited, bias-corrected MoE of DeepSeek-V3 and GLM-4.5, with shared
/// experts, after `first_k_dense_replace` dense layers.
fn grouped_moe(obj: &Obj, n: usize, defaults: (f64, usize, usize, usize)) -> FieldResult<(Vec<LayerMlp>, MoeSpec)> {
    let (scaling_default, group_default, topk_group_default, first_dense_default) = defaults;
    let experts_key = spelling(obj, "n_routed_experts", "num_local_experts")?;
    let num_experts = obj.positive(experts_key)?;
    let expert_intermediate_size = obj.positive("moe_intermediate_size")?;
    let first_dense = obj.usize_opt("first_k_dense_replace")?.unwrap_or(first_dense_default);
    let layers = (0..n)
        .map(|l| if l < first_dense { Ok(LayerMlp::Dense { intermediate_size: obj.positive("intermediate_size")? }) } else { Ok(LayerMlp::Moe) })
        .collect::<FieldResult<_>>()?;
    let shared = obj.usize_opt("n_shared_experts")?.unwrap_or(1);
    let scaling = obj.f64_or("routed_scaling_factor", scaling_default)?;
    Ok((
        layers,
        MoeSpec {
            num_experts,
            top_k: obj.positive("num_experts_per_tok")?,
            expert_intermediate_size,
            scoring: RouterScoring::SigmoidGrouped {
                n_group: obj.usize_opt("n_group")?.unwrap_or(group_default),
                topk_group: obj.usize_opt("topk_group")?.unwrap_or(topk_group_default),
                norm_topk_prob: obj.bool_or("norm_topk_prob", true)?,
                routed_scaling_factor: scaling as f32,
            },
            shared_intermediate_size: (shared > 0).then_some(shared * expert_intermediate_size),
        },
    ))
}

pub(super) fn deepseek_v3(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults =
        Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("qk_rope_head_dim"), num_kv_heads: None };
    build(obj, &defaults, Family::DeepseekV3, "DeepseekV3ForCausalLM", |sz| {
        let mla = MlaSpec {
            q_lora_rank: obj.usize_opt("q_lora_rank")?,
            kv_lora_rank: obj.positive("kv_lora_rank")?,
            qk_nope_head_dim: obj.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: obj.positive("qk_rope_head_dim")?,
            v_head_dim: obj.positive("v_head_dim")?,
        };
        if mla.q_lora_rank == Some(0) {
            return Err(FieldError::new("q_lora_rank", "must be greater than zero, or null for a plain q_proj"));
        }
        // transformers' yarn_apply_mscale: the softmax scale grows by mscale(factor, mscale_all_dim)².
        let mut scale = (mla.qk_head_dim() as f64).powf(-0.5);
        if let RopeScaling::Yarn { factor, mscale_all_dim: Some(m), .. } = &sz.rope.scaling {
            let ms = if *factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
            scale *= ms * ms;
        }
        let bias = obj.bool_or("attention_bias", false)?;
        let (layers, moe) = grouped_moe(obj, sz.num_layers, (2.5, 8, 4, 3))?;
        Ok(FamilyParts {
            attention: AttentionSpec {
                rotary_dim: mla.qk_rope_head_dim,
                kind: AttentionKind::Mla(mla),
                qk_norm: QkNorm::None,
                clip_qkv: None,
                bias,
                o_bias: bias,
                rope_interleave: obj.bool_or("rope_interleave", true)?,
                scale: scale as f32,
                sliding_window: vec![None; sz.num_layers],
            },
            layers,
            moe,
            expert_names: GROUPED_SIGMOID_NAMES,
        })
    })
}

pub(super) fn glm4_moe(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(8) };
    build(obj, &defaults, Family::Glm4Moe, "Glm4MoeForCausalLM", |sz| {
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
        Ok(FamilyParts { attention, layers, moe, expert_names: GROUPED_SIGMOID_NAMES })
    })
}
