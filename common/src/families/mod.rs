//! The model families shimmer runs: one file each — its config dialect and defaults (those of
//! its transformers configuration class, 5.x, so a field a hub config leaves out means what it
//! means there), its tensor names, router kind and attention kind — registered in `FAMILIES`.
//! Nothing outside these files names a family: the spec they build is data (`ModelSpec`) that the
//! decoder, the store, the cluster and the API read. Adding a family is a file here, a line in
//! `FAMILIES`, and its test fixture (`tests/oracle/make_fixtures.py`).
//!
//! This module holds what several families share: the MoE fields, GQA attention, the name
//! templates, and the two-spellings rule. Structural sizes have no default: a config without them
//! is an error naming the field.

mod deepseek_v3;
mod glm4_moe;
mod gpt_oss;
mod mixtral;
mod olmoe;
mod qwen3_moe;
#[cfg(test)]
mod tests;

use crate::json::{FieldError, FieldResult, Obj};
use crate::spec::*;

/// One model family: how a `config.json` names it and how its dialect is parsed.
pub struct FamilyDef {
    /// The `architectures[0]` name of its checkpoints.
    pub architecture: &'static str,
    /// `model_type` values that may accompany the architecture (derivatives keep the architecture
    /// and rename the type, as Kimi K2 does); the first is the canonical one.
    pub model_types: &'static [&'static str],
    pub(crate) parse: fn(&Obj) -> FieldResult<ModelSpec>,
}

/// Every family shimmer runs.
pub const FAMILIES: &[&FamilyDef] = &[&olmoe::FAMILY, &qwen3_moe::FAMILY, &mixtral::FAMILY, &deepseek_v3::FAMILY, &glm4_moe::FAMILY, &gpt_oss::FAMILY];

/// Every family's MoE layers agree on these; families differ in defaults and names only.
pub(crate) fn moe(obj: &Obj, experts_key: &str, intermediate_key: &str, norm_topk_prob: bool) -> FieldResult<MoeSpec> {
    let num_experts = obj.positive(experts_key)?;
    let top_k = obj.positive("num_experts_per_tok")?;
    Ok(MoeSpec {
        num_experts,
        top_k,
        expert_intermediate_size: obj.positive(intermediate_key)?,
        scoring: RouterScoring::SoftmaxTopK { norm_topk_prob },
        shared_intermediate_size: None,
        activation: ExpertActivation::Silu,
        expert_bias: false,
    })
}

pub(crate) fn check_act(obj: &Obj) -> FieldResult<()> {
    match obj.str_opt("hidden_act")? {
        None | Some("silu") | Some("swish") => Ok(()),
        Some(other) => Err(FieldError::new("hidden_act", format!("unsupported activation `{other}` (expected silu)"))),
    }
}

/// Attention fields every GQA family without partial rotary shares.
pub(crate) fn gqa(sz: &Sizes, qk_norm: QkNorm, clip_qkv: Option<f32>, bias: bool, o_bias: bool, sliding_window: Vec<Option<usize>>) -> AttentionSpec {
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
        sinks: false,
    }
}

/// Experts under `mlp.experts`, a softmax router at `mlp.gate` (OLMoE, Qwen3-MoE).
pub(crate) const GATE_UP_DOWN: ExpertNames = ExpertNames {
    router: "model.layers.{L}.mlp.gate.weight",
    router_bias: None,
    router_logit_bias: None,
    shared: None,
    layout: ExpertLayout::Separate,
    gate: "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
    up: "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
    down: "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
};

/// DeepSeek-V3's layout: a bias-corrected sigmoid router and shared experts (also GLM-4.5).
pub(crate) const GROUPED_SIGMOID_NAMES: ExpertNames = ExpertNames {
    router: "model.layers.{L}.mlp.gate.weight",
    router_bias: Some("model.layers.{L}.mlp.gate.e_score_correction_bias"),
    router_logit_bias: None,
    shared: Some([
        "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
        "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        "model.layers.{L}.mlp.shared_experts.down_proj.weight",
    ]),
    layout: ExpertLayout::Separate,
    gate: "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
    up: "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
    down: "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
};

/// Which of a field's two spellings the config uses (the hub's, else transformers 5's alias); a
/// config with neither is refused naming both.
pub(crate) fn spelling(obj: &Obj, hub: &'static str, alias: &'static str) -> FieldResult<&'static str> {
    match (obj.get(hub).is_some(), obj.get(alias).is_some()) {
        (true, _) => Ok(hub),
        (false, true) => Ok(alias),
        (false, false) => Err(FieldError::new(hub, format!("missing (nor its alias `{alias}`)"))),
    }
}

/// The sigmoid, group-limited, bias-corrected MoE of DeepSeek-V3 and GLM-4.5, with shared
/// experts, after `first_k_dense_replace` dense layers.
pub(crate) fn grouped_moe(obj: &Obj, n: usize, defaults: (f64, usize, usize, usize)) -> FieldResult<(Vec<LayerMlp>, MoeSpec)> {
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
            activation: ExpertActivation::Silu,
            expert_bias: false,
        },
    ))
}
