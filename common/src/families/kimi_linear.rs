//! Kimi Linear (`KimiLinearForCausalLM`, `kimi_linear`): Kimi Delta Attention layers (a Gated
//! DeltaNet with a decay per key channel and a sigmoid-gated output norm) among multi-head
//! latent attention layers that use no positional encoding at all; the first layer dense (or as
//! `mlp_layer_types` says), then DeepSeek-V3's sigmoid group-limited routing with shared experts
//! under `block_sparse_moe`. Configs use the checkpoint's spellings (`model_max_length`,
//! `num_experts_per_token`, …) and, as published, a `linear_attn_config` with 1-based layer lists.

use serde_json::{Map, Value};

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "KimiLinearForCausalLM", model_types: &["kimi_linear"], parse, spellings: SPELLINGS };

/// `KimiLinearConfig.attribute_map`: (the name other families use, Kimi's spelling).
const SPELLINGS: &[(&str, &str)] = &[
    ("max_position_embeddings", "model_max_length"),
    ("norm_topk_prob", "moe_renormalize"),
    ("n_group", "num_expert_group"),
    ("num_local_experts", "num_experts"),
    ("n_routed_experts", "num_experts"),
    ("num_experts_per_tok", "num_experts_per_token"),
    ("n_shared_experts", "num_shared_experts"),
];

const NAMES: DenseNames = DenseNames {
    linear_attn: "model.layers.{L}.self_attn",
    mlp_gate: "model.layers.{L}.block_sparse_moe.gate_proj.weight",
    mlp_up: "model.layers.{L}.block_sparse_moe.up_proj.weight",
    mlp_down: "model.layers.{L}.block_sparse_moe.down_proj.weight",
    mlp_layout: DenseMlpLayout::Separate,
    ..DenseNames::LLAMA
};

const EXPERTS: ExpertNames = ExpertNames {
    router: "model.layers.{L}.block_sparse_moe.gate.weight",
    router_bias: Some("model.layers.{L}.block_sparse_moe.gate.e_score_correction_bias"),
    router_logit_bias: None,
    shared: Some([
        "model.layers.{L}.block_sparse_moe.shared_experts.gate_proj.weight",
        "model.layers.{L}.block_sparse_moe.shared_experts.up_proj.weight",
        "model.layers.{L}.block_sparse_moe.shared_experts.down_proj.weight",
    ]),
    shared_gate: None,
    router_hash: None,
    layout: ExpertLayout::Separate,
    gate: "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
    up: "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
    down: "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight",
};

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    let mut named: Map<String, Value> = obj.0.clone();
    for (ours, theirs) in SPELLINGS {
        if !named.contains_key(*ours) {
            if let Some(v) = obj.get(theirs) {
                named.insert(ours.to_string(), v.clone());
            }
        }
    }
    // Errors name the field as the config spells it.
    parse_named(&Obj(&named)).map_err(|e| match SPELLINGS.iter().find(|(ours, _)| e.field == *ours && obj.get(ours).is_none()) {
        Some((_, theirs)) => FieldError::new(theirs, e.problem),
        None => e,
    })
}

fn parse_named(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults =
        Defaults { rms_norm_eps: 1e-5, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("qk_rope_head_dim"), num_kv_heads: None };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        let n = sz.num_layers;
        let linear = obj.obj_opt("linear_attn_config")?;
        let mixers = layer_kinds(obj, linear.as_ref(), n)?;
        let field = |key: &str, nested: &str, default: usize, max: usize| -> FieldResult<usize> {
            let v = match &linear {
                Some(l) if l.get(nested).is_some() => {
                    l.usize_opt(nested).map_err(|e| FieldError::new(&format!("linear_attn_config.{}", e.field), e.problem))?
                }
                _ => obj.usize_opt(key)?,
            }
            .unwrap_or(default);
            if v == 0 || v > max {
                return Err(FieldError::new(key, format!("{v} must be between 1 and {max}")));
            }
            Ok(v)
        };
        let (heads, head_dim) = (field("linear_num_heads", "num_heads", 32, 1024)?, field("linear_head_dim", "head_dim", 128, 4096)?);
        let gated_delta = GatedDeltaSpec {
            key_heads: heads,
            value_heads: heads,
            key_dim: head_dim,
            value_dim: head_dim,
            conv_kernel: field("linear_conv_kernel_dim", "short_conv_kernel_size", 4, 64)?,
            projections: DeltaProjections::Kimi,
        };
        let mla = MlaSpec {
            q_lora_rank: obj.usize_opt("q_lora_rank")?,
            kv_lora_rank: obj.usize_opt("kv_lora_rank")?.unwrap_or(512),
            qk_nope_head_dim: obj.usize_opt("qk_nope_head_dim")?.unwrap_or(128),
            qk_rope_head_dim: obj.usize_opt("qk_rope_head_dim")?.unwrap_or(64),
            v_head_dim: obj.usize_opt("v_head_dim")?.unwrap_or(128),
            indexer: None,
        };
        if mla.q_lora_rank == Some(0) || mla.kv_lora_rank == 0 || mla.v_head_dim == 0 || mla.qk_nope_head_dim + mla.qk_rope_head_dim == 0 {
            return Err(FieldError::new("kv_lora_rank", "the latent attention's sizes must be positive (q_lora_rank null or positive)"));
        }
        let (mut layers, moe) = grouped_moe(obj, n, (2.446, 1, 1, 1))?;
        apply_mlp_layer_types(obj, &mut layers)?;
        let bias = obj.bool_or("attention_bias", false)?;
        Ok(FamilyParts {
            attention: AttentionSpec {
                rotary_dim: mla.qk_rope_head_dim,
                scale: (mla.qk_head_dim() as f32).powf(-0.5),
                kind: AttentionKind::Mla(mla),
                qk_norm: QkNorm::None,
                clip_qkv: None,
                bias,
                o_bias: bias,
                rope_interleave: false,
                sliding_window: vec![None; n],
                sinks: false,
                output_gate: false,
                mixers,
                gated_delta: Some(gated_delta),
                no_rope: true,
            },
            layers,
            moe,
            expert_names: EXPERTS,
            dense_names: NAMES,
            rms_norm_unit_offset: false,
        })
    })
}

/// `layer_types`; else `linear_attn_config`'s 1-based `full_attn_layers` and `kda_layers`; else
/// every 4th layer after the first full (KimiLinearConfig's default).
fn layer_kinds(obj: &Obj, linear: Option<&Obj>, n: usize) -> FieldResult<Vec<Mixer>> {
    if obj.get("layer_types").is_some_and(|v| !v.is_null()) {
        return hybrid_layer_types(obj, n);
    }
    if let Some(l) = linear.filter(|l| l.get("full_attn_layers").is_some() && l.get("kda_layers").is_some()) {
        let mut kinds = vec![None; n];
        for (key, kind) in [("full_attn_layers", Mixer::Attention), ("kda_layers", Mixer::GatedDeltaNet)] {
            for layer in l.usize_list_or_empty(key).map_err(|e| FieldError::new(&format!("linear_attn_config.{}", e.field), e.problem))? {
                match layer.checked_sub(1).and_then(|i| kinds.get_mut(i)) {
                    Some(slot) => *slot = Some(kind),
                    None => return Err(FieldError::new(&format!("linear_attn_config.{key}"), format!("layer {layer} is not one of 1..={n}"))),
                }
            }
        }
        return kinds
            .into_iter()
            .enumerate()
            .map(|(i, k)| k.ok_or_else(|| FieldError::new("linear_attn_config.kda_layers", format!("layer {} is in neither list", i + 1))))
            .collect();
    }
    Ok((0..n).map(|i| if i > 0 && i % 4 == 0 { Mixer::Attention } else { Mixer::GatedDeltaNet }).collect())
}
