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
mod deepseek_v4;
mod gguf;
mod glm4_moe;
mod glm_moe_dsa;
mod gpt_oss;
mod inkling;
mod inkling2;
mod kimi_linear;
mod mixtral;
mod olmoe;
mod qwen3_5_moe;
mod qwen3_moe;
mod qwen3_next;
#[cfg(test)]
mod tests;

pub(crate) use gguf::{common_config, grouped_config, grouped_tensor, llama_config, llama_tensor, moe_counts};
pub use gguf::{gguf_dialect, GgufDialect, GgufTensor, GGUF_DIALECTS};

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
    /// Fields the family's configs spell their own way: (the name shimmer's spec checks use, the
    /// config's), so that an error names the field as the config spells it.
    pub(crate) spellings: &'static [(&'static str, &'static str)],
}

/// Every family shimmer runs.
pub const FAMILIES: &[&FamilyDef] = &[
    &olmoe::FAMILY,
    &qwen3_moe::FAMILY,
    &mixtral::FAMILY,
    &deepseek_v3::FAMILY,
    &glm4_moe::FAMILY,
    &gpt_oss::FAMILY,
    &qwen3_next::FAMILY,
    &qwen3_5_moe::FAMILY,
    &qwen3_5_moe::TEXT_FAMILY,
    &glm_moe_dsa::FAMILY,
    &kimi_linear::FAMILY,
    &deepseek_v4::FAMILY,
    &inkling::FAMILY,
    &inkling::IMAGE_TEXT_FAMILY,
    &inkling2::FAMILY,
    &inkling2::IMAGE_TEXT_FAMILY,
];

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

/// The text model of an image-text checkpoint (`…ForConditionalGeneration`): its fields under
/// `text_config`, with what only the outer config says (its dtype, say) filling in, parsed by
/// `parse`; errors name the field where the text model keeps it. The towers' configs are left
/// unread, as their tensors are.
pub(crate) fn text_config_part(obj: &Obj, parse: impl Fn(&Obj) -> FieldResult<ModelSpec>) -> FieldResult<ModelSpec> {
    let text = obj.obj_opt("text_config")?.ok_or_else(|| FieldError::new("text_config", "missing (the text model's configuration)"))?;
    let mut merged: serde_json::Map<String, serde_json::Value> =
        obj.0.iter().filter(|(k, _)| !k.ends_with("_config") && *k != "architectures").map(|(k, v)| (k.clone(), v.clone())).collect();
    for (k, v) in text.0 {
        if k != "model_type" {
            merged.insert(k.clone(), v.clone());
        }
    }
    parse(&Obj(&merged)).map_err(|e| {
        if text.get(&e.field).is_some() || obj.get(&e.field).is_none() {
            FieldError::new(&format!("text_config.{}", e.field), e.problem)
        } else {
            e
        }
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
        sinks: false,
        output_gate: false,
        mixers: vec![Mixer::Attention; sliding_window.len()],
        gated_delta: None,
        no_rope: false,
        sliding_window,
    }
}

/// Experts under `mlp.experts`, a softmax router at `mlp.gate` (OLMoE, Qwen3-MoE).
pub(crate) const GATE_UP_DOWN: ExpertNames = ExpertNames {
    router: "model.layers.{L}.mlp.gate.weight",
    router_bias: None,
    router_logit_bias: None,
    shared: None,
    shared_gate: None,
    router_hash: None,
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
    shared_gate: None,
    router_hash: None,
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

/// A per-layer list of kinds (`layer_types`, `indexer_types`, …): each entry one of `names`,
/// mapped to its value; `None` when the config has no such list.
pub(crate) fn per_layer<T: Copy>(obj: &Obj, key: &str, n: usize, names: &[(&str, T)]) -> FieldResult<Option<Vec<T>>> {
    match obj.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Array(kinds)) => {
            if kinds.len() != n {
                return Err(FieldError::new(key, format!("{} entries for {n} layers", kinds.len())));
            }
            let expected = names.iter().map(|(name, _)| format!("\"{name}\"")).collect::<Vec<_>>().join(" or ");
            kinds
                .iter()
                .enumerate()
                .map(|(l, k)| {
                    let found = names.iter().find(|(name, _)| k.as_str() == Some(name));
                    found.map(|(_, v)| *v).ok_or_else(|| FieldError::new(key, format!("entry {l}: expected {expected}, got {k}")))
                })
                .collect::<FieldResult<Vec<_>>>()
                .map(Some)
        }
        Some(v) => Err(FieldError::new(key, format!("expected a list, got {v}"))),
    }
}

/// `layer_types` of a hybrid model (`linear_attention` / `full_attention`), or, without it, every
/// `full_attention_interval`-th layer (4 by default) full and the rest linear.
pub(crate) fn hybrid_layer_types(obj: &Obj, n: usize) -> FieldResult<Vec<Mixer>> {
    if let Some(kinds) = per_layer(obj, "layer_types", n, &[("linear_attention", Mixer::GatedDeltaNet), ("full_attention", Mixer::Attention)])? {
        return Ok(kinds);
    }
    let interval = obj.usize_opt("full_attention_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(FieldError::new("full_attention_interval", "must be greater than zero"));
    }
    Ok((0..n).map(|l| if (l + 1) % interval == 0 { Mixer::Attention } else { Mixer::GatedDeltaNet }).collect())
}

/// The Gated DeltaNet shape from the `linear_*` fields (Qwen3-Next's defaults when absent).
pub(crate) fn gated_delta(obj: &Obj, projections: DeltaProjections) -> FieldResult<GatedDeltaSpec> {
    let field = |key: &str, default: usize| -> FieldResult<usize> {
        match obj.usize_opt(key)?.unwrap_or(default) {
            0 => Err(FieldError::new(key, "must be greater than zero")),
            v => Ok(v),
        }
    };
    Ok(GatedDeltaSpec {
        key_heads: field("linear_num_key_heads", 16)?,
        value_heads: field("linear_num_value_heads", 32)?,
        key_dim: field("linear_key_head_dim", 128)?,
        value_dim: field("linear_value_head_dim", 128)?,
        conv_kernel: field("linear_conv_kernel_dim", 4)?,
        projections,
    })
}

/// The rotary part of each head: `partial_rotary_factor` (or the family's default) of it.
pub(crate) fn partial_rotary_dim(obj: &Obj, head_dim: usize, default_factor: f64) -> FieldResult<usize> {
    let factor = crate::spec::partial_rotary_factor(obj)?.unwrap_or(default_factor);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(FieldError::new("partial_rotary_factor", format!("must be in (0, 1], got {factor}")));
    }
    Ok((head_dim as f64 * factor) as usize)
}

/// Qwen-style MoE placement: MoE every `decoder_sparse_step` layers except `mlp_only_layers` (and
/// none when the expert count is 0), softmax top-k routing.
pub(crate) fn sparse_layers(obj: &Obj, n: usize, experts_key: &str, norm_default: bool) -> FieldResult<(Vec<LayerMlp>, MoeSpec)> {
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
    Ok((layers, moe(obj, experts_key, "moe_intermediate_size", obj.bool_or("norm_topk_prob", norm_default)?)?))
}

/// `mlp_layer_types` (`dense` / `sparse` per layer), when the config has it, over the pattern
/// `layers` holds.
pub(crate) fn apply_mlp_layer_types(obj: &Obj, layers: &mut [LayerMlp]) -> FieldResult<()> {
    let Some(sparse) = per_layer(obj, "mlp_layer_types", layers.len(), &[("dense", false), ("sparse", true)])? else { return Ok(()) };
    for (layer, sparse) in layers.iter_mut().zip(sparse) {
        *layer = if sparse { LayerMlp::Moe } else { LayerMlp::Dense { intermediate_size: obj.positive("intermediate_size")? } };
    }
    Ok(())
}

/// MLA's softmax scale: `qk_head_dim^-0.5`, grown by YaRN's `mscale(factor, mscale_all_dim)²` as
/// transformers' `yarn_apply_mscale` does.
pub(crate) fn mla_scale(mla: &MlaSpec, rope: &RopeSpec) -> f32 {
    let mut scale = (mla.qk_head_dim() as f64).powf(-0.5);
    if let RopeScaling::Yarn { factor, mscale_all_dim: Some(m), .. } = &rope.scaling {
        let ms = if *factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
        scale *= ms * ms;
    }
    scale as f32
}

/// The Qwen3-Next / Qwen3.5 hybrid attention: per-head QK-norm, partial rotary (a quarter by
/// default), an output gate, Gated DeltaNet layers as `layer_types` says.
pub(crate) fn qwen_hybrid_attention(obj: &Obj, sz: &Sizes, projections: DeltaProjections) -> FieldResult<AttentionSpec> {
    let bias = obj.bool_or("attention_bias", false)?;
    let mut attention = gqa(sz, QkNorm::PerHead, None, bias, bias, vec![None; sz.num_layers]);
    attention.rotary_dim = partial_rotary_dim(obj, sz.head_dim, 0.25)?;
    attention.output_gate = true;
    attention.mixers = hybrid_layer_types(obj, sz.num_layers)?;
    attention.gated_delta = Some(gated_delta(obj, projections)?);
    Ok(attention)
}

/// The shared expert's size (`shared_expert_intermediate_size`, 512 by default; 0: none).
pub(crate) fn qwen_shared_expert(obj: &Obj, moe: &mut MoeSpec) -> FieldResult<()> {
    let shared = obj.usize_opt("shared_expert_intermediate_size")?.unwrap_or(512);
    moe.shared_intermediate_size = (shared > 0).then_some(shared);
    Ok(())
}

/// Multi-head latent attention in every layer (DeepSeek-V3, GLM-5): no QK-norm or clip, the
/// `attention_bias` on the low-rank projections and `o_proj`, YaRN's softmax scale.
pub(crate) fn mla_attention(obj: &Obj, sz: &Sizes, mla: MlaSpec, rope_interleave: bool) -> FieldResult<AttentionSpec> {
    let bias = obj.bool_or("attention_bias", false)?;
    let n = sz.num_layers;
    Ok(AttentionSpec {
        rotary_dim: mla.qk_rope_head_dim,
        scale: mla_scale(&mla, sz.rope),
        kind: AttentionKind::Mla(mla),
        qk_norm: QkNorm::None,
        clip_qkv: None,
        bias,
        o_bias: bias,
        rope_interleave,
        sliding_window: vec![None; n],
        sinks: false,
        output_gate: false,
        mixers: vec![Mixer::Attention; n],
        gated_delta: None,
        no_rope: false,
    })
}

/// Qwen3-Next's and Qwen3.5's experts (`mlp.experts.{E}`, `mlp.gate`) with a gated shared expert.
pub(crate) const QWEN_GATED_SHARED_NAMES: ExpertNames = ExpertNames {
    shared: Some([
        "model.layers.{L}.mlp.shared_expert.gate_proj.weight",
        "model.layers.{L}.mlp.shared_expert.up_proj.weight",
        "model.layers.{L}.mlp.shared_expert.down_proj.weight",
    ]),
    shared_gate: Some("model.layers.{L}.mlp.shared_expert_gate.weight"),
    router_hash: None,
    ..GATE_UP_DOWN
};

/// A size the config may leave out (then `default`), which must not be zero.
pub(crate) fn positive_or(obj: &Obj, key: &str, default: usize) -> FieldResult<usize> {
    match obj.usize_opt(key)?.unwrap_or(default) {
        0 => Err(FieldError::new(key, "must be greater than zero")),
        v => Ok(v),
    }
}

/// Inkling's two head shapes: full layers' (`num_attention_heads`, `num_key_value_heads`, the
/// head size) and sliding layers' (`swa_*`), with the family's defaults
/// `[heads, kv_heads, swa_heads, swa_kv_heads, swa_head_dim]`.
pub(crate) fn relative_head_shapes(obj: &Obj, head_dim: usize, defaults: [usize; 5]) -> FieldResult<(HeadShape, HeadShape)> {
    let [heads, kv, swa_heads, swa_kv, swa_d] = defaults;
    let full = HeadShape { heads: positive_or(obj, "num_attention_heads", heads)?, kv_heads: positive_or(obj, "num_key_value_heads", kv)?, head_dim };
    let sliding = HeadShape {
        heads: positive_or(obj, "swa_num_attention_heads", swa_heads)?,
        kv_heads: positive_or(obj, "swa_num_key_value_heads", swa_kv)?,
        head_dim: positive_or(obj, "swa_head_dim", swa_d)?,
    };
    Ok((full, sliding))
}

/// `unpadded_vocab_size`: the logits and tokens span it; the embedding and head keep the padded
/// `vocab_size` rows.
pub(crate) fn unpad_vocab(spec: &mut ModelSpec, unpadded: Option<usize>) -> FieldResult<()> {
    let Some(unpadded) = unpadded else { return Ok(()) };
    if unpadded == 0 || unpadded > spec.vocab_size {
        return Err(FieldError::new("unpadded_vocab_size", format!("{unpadded} must be positive and at most vocab_size = {}", spec.vocab_size)));
    }
    if unpadded < spec.vocab_size {
        spec.padded_vocab = Some(spec.vocab_size);
        spec.vocab_size = unpadded;
    }
    Ok(())
}
