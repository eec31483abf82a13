//! Inkling (`InklingForCausalLM`, `inkling_text`): attention without rotary — a bias per backward
//! distance mixed from each query's own states — short causal convolutions (with a residual) on
//! keys, values, the attention output and the MLP output, per-layer head shapes for sliding and
//! full layers, per-head q/k RMSNorm with a `1/head_dim` scale, logarithmic query scaling on full
//! layers, a normed embedding, dense MLPs with a global scale, and a sigmoid router over routed
//! and shared experts whose weights are a softmax of `logsigmoid` logits (the shared experts'
//! included) times `route_scale` and a global scale; the head reads the final state divided by
//! the muP multiplier, over a vocabulary possibly padded past the tokenizer's.
//!
//! Two forms: the text model (`InklingForCausalLM`, `inkling_text`) with transformers 5.24's
//! names (`model.layers.N.self_attn.q_proj`, stacked experts `mlp.experts.gate_up_proj`, stacked
//! shared experts); and the image-text release (`InklingForConditionalGeneration`,
//! `inkling_mm_model`), served as its text part: fields under `text_config`, the release's names
//! (`model.llm.layers.N.attn.wq_du.weight`), gate and up rows interleaved in the experts' and the
//! shared bank's `w13` and the dense MLPs' `w13_dn`; the vision and audio towers left unread.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "InklingForCausalLM", model_types: &["inkling_text"], parse, spellings: &[] };
pub(super) const IMAGE_TEXT_FAMILY: FamilyDef =
    FamilyDef { architecture: "InklingForConditionalGeneration", model_types: &["inkling_mm_model"], parse: parse_image_text, spellings: &[] };

/// Where one form keeps its tensors.
struct Names {
    relative: RelativeNames,
    experts: ExpertNames,
    dense: DenseNames,
}

const TEXT_RELATIVE: RelativeNames = RelativeNames {
    q: "model.layers.{L}.self_attn.q_proj.weight",
    k: "model.layers.{L}.self_attn.k_proj.weight",
    v: "model.layers.{L}.self_attn.v_proj.weight",
    r: "model.layers.{L}.self_attn.r_proj.weight",
    o: "model.layers.{L}.self_attn.o_proj.weight",
    q_norm: "model.layers.{L}.self_attn.q_norm.weight",
    k_norm: "model.layers.{L}.self_attn.k_norm.weight",
    k_conv: "model.layers.{L}.self_attn.k_sconv.conv1d.weight",
    v_conv: "model.layers.{L}.self_attn.v_sconv.conv1d.weight",
    rel_proj: "model.layers.{L}.self_attn.rel_logits_proj.proj",
    attn_conv: "model.layers.{L}.attn_sconv.conv1d.weight",
    mlp_conv: "model.layers.{L}.mlp_sconv.conv1d.weight",
    mlp_scale: "model.layers.{L}.mlp.global_scale",
    router_scale: "model.layers.{L}.mlp.gate.global_scale",
    embed_norm: "model.embed_tokens.embed_norm.weight",
};

const TEXT_EXPERTS: ExpertNames = ExpertNames {
    router: "model.layers.{L}.mlp.gate.weight",
    router_bias: Some("model.layers.{L}.mlp.gate.e_score_correction_bias"),
    router_logit_bias: None,
    shared: Some([
        "model.layers.{L}.mlp.shared_experts.gate_proj",
        "model.layers.{L}.mlp.shared_experts.up_proj",
        "model.layers.{L}.mlp.shared_experts.down_proj",
    ]),
    shared_gate: None,
    router_hash: None,
    layout: ExpertLayout::FusedStacked,
    gate: "model.layers.{L}.mlp.experts.gate_up_proj",
    up: "model.layers.{L}.mlp.experts.gate_up_proj",
    down: "model.layers.{L}.mlp.experts.down_proj",
};

const RELEASE_RELATIVE: RelativeNames = RelativeNames {
    q: "model.llm.layers.{L}.attn.wq_du.weight",
    k: "model.llm.layers.{L}.attn.wk_dv.weight",
    v: "model.llm.layers.{L}.attn.wv_dv.weight",
    r: "model.llm.layers.{L}.attn.wr_du.weight",
    o: "model.llm.layers.{L}.attn.wo_ud.weight",
    q_norm: "model.llm.layers.{L}.attn.q_norm.weight",
    k_norm: "model.llm.layers.{L}.attn.k_norm.weight",
    k_conv: "model.llm.layers.{L}.attn.k_sconv.weight",
    v_conv: "model.llm.layers.{L}.attn.v_sconv.weight",
    rel_proj: "model.llm.layers.{L}.attn.rel_logits_proj.proj",
    attn_conv: "model.llm.layers.{L}.attn_sconv.weight",
    mlp_conv: "model.llm.layers.{L}.mlp_sconv.weight",
    mlp_scale: "model.llm.layers.{L}.mlp.global_scale",
    router_scale: "model.llm.layers.{L}.mlp.gate.global_scale",
    embed_norm: "model.llm.embed_norm.weight",
};

const RELEASE_EXPERTS: ExpertNames = ExpertNames {
    router: "model.llm.layers.{L}.mlp.gate.weight",
    router_bias: Some("model.llm.layers.{L}.mlp.gate.bias"),
    router_logit_bias: None,
    shared: Some([
        "model.llm.layers.{L}.mlp.shared_experts.shared_w13_weight",
        "model.llm.layers.{L}.mlp.shared_experts.shared_w13_weight",
        "model.llm.layers.{L}.mlp.shared_experts.shared_w2_weight",
    ]),
    shared_gate: None,
    router_hash: None,
    layout: ExpertLayout::StackedInterleaved,
    gate: "model.llm.layers.{L}.mlp.experts.w13_weight",
    up: "model.llm.layers.{L}.mlp.experts.w13_weight",
    down: "model.llm.layers.{L}.mlp.experts.w2_weight",
};

const RELEASE_DENSE: DenseNames = DenseNames {
    embed: "model.llm.embed.weight",
    final_norm: "model.llm.norm.weight",
    lm_head: "model.llm.unembed.weight",
    input_norm: "model.llm.layers.{L}.attn_norm.weight",
    post_attention_norm: "model.llm.layers.{L}.mlp_norm.weight",
    q: "model.llm.layers.{L}.attn.wq_du",
    k: "model.llm.layers.{L}.attn.wk_dv",
    v: "model.llm.layers.{L}.attn.wv_dv",
    o: "model.llm.layers.{L}.attn.wo_ud",
    q_norm: "model.llm.layers.{L}.attn.q_norm.weight",
    k_norm: "model.llm.layers.{L}.attn.k_norm.weight",
    sinks: "",
    linear_attn: "model.llm.layers.{L}.attn",
    mlp_gate: "model.llm.layers.{L}.mlp.w13_dn.weight",
    mlp_up: "",
    mlp_down: "model.llm.layers.{L}.mlp.w2_md.weight",
    mlp_layout: DenseMlpLayout::InterleavedGateUp,
};

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    text_model(obj, FAMILY.architecture, Names { relative: TEXT_RELATIVE, experts: TEXT_EXPERTS, dense: DenseNames::LLAMA })
}

fn parse_image_text(obj: &Obj) -> FieldResult<ModelSpec> {
    text_config_part(obj, |text| {
        text_model(text, IMAGE_TEXT_FAMILY.architecture, Names { relative: RELEASE_RELATIVE, experts: RELEASE_EXPERTS, dense: RELEASE_DENSE })
    })
}

fn text_model(obj: &Obj, architecture: &'static str, names: Names) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    let defaults = Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(8) };
    let positive_or = |key: &str, default: usize| positive_or(obj, key, default);
    // An older spelling: `dense_intermediate_size` for the dense MLPs, with `intermediate_size`
    // then the experts' width.
    let (dense_i, expert_i) = match obj.usize_opt("dense_intermediate_size")? {
        Some(d) => (d, positive_or("intermediate_size", 24576)?),
        None => (positive_or("intermediate_size", 24576)?, positive_or("moe_intermediate_size", 3072)?),
    };
    let mut spec = build(obj, &defaults, architecture, |sz| {
        let n = sz.num_layers;
        let sliding_layers = match per_layer(obj, "layer_types", n, &[("hybrid_sliding", true), ("hybrid", false)])? {
            Some(kinds) => kinds,
            None => match obj.get("local_layer_ids") {
                Some(serde_json::Value::Array(ids)) => {
                    let ids: Vec<u64> = ids
                        .iter()
                        .map(|v| v.as_u64().ok_or_else(|| FieldError::new("local_layer_ids", format!("{v} is not a layer index"))))
                        .collect::<FieldResult<_>>()?;
                    (0..n).map(|l| ids.contains(&(l as u64))).collect()
                }
                _ => (0..n).map(|l| (l + 1) % 6 != 0).collect(),
            },
        };
        let (full, sliding) = relative_head_shapes(obj, sz.head_dim, [64, 8, 64, 16, 128])?;
        let window = positive_or("sliding_window_size", 512)?;
        let log_scaling = match obj.usize_opt("log_scaling_n_floor")? {
            Some(0) => return Err(FieldError::new("log_scaling_n_floor", "must be greater than zero")),
            Some(f) => Some((f as f32, obj.f64_or("log_scaling_alpha", 0.1)? as f32)),
            None => None,
        };
        let relative = RelativeSpec {
            full,
            sliding,
            window,
            sliding_layers: sliding_layers.clone(),
            d_rel: positive_or("d_rel", 16)?,
            rel_extent: positive_or("rel_extent", 1024)?,
            log_scaling,
            conv_kernel: positive_or("conv_kernel_size", 4)?,
            names: names.relative,
            v2: None,
        };
        let attention = AttentionSpec {
            kind: AttentionKind::Relative(Box::new(relative)),
            qk_norm: QkNorm::PerHead,
            clip_qkv: None,
            bias: false,
            o_bias: false,
            rotary_dim: 0,
            rope_interleave: false,
            scale: 1.0 / sz.head_dim as f32,
            sliding_window: sliding_layers.iter().map(|s| s.then_some(window)).collect(),
            sinks: false,
            output_gate: false,
            mixers: vec![Mixer::Attention; n],
            gated_delta: None,
            no_rope: true,
        };
        let layers = match per_layer(obj, "mlp_layer_types", n, &[("dense", LayerMlp::Dense { intermediate_size: dense_i }), ("sparse", LayerMlp::Moe)])? {
            Some(kinds) => kinds,
            None => {
                let dense = obj.usize_opt("dense_mlp_idx")?.unwrap_or(0);
                (0..n).map(|l| if l < dense { LayerMlp::Dense { intermediate_size: dense_i } } else { LayerMlp::Moe }).collect()
            }
        };
        let shared = obj.usize_opt("n_shared_experts")?.unwrap_or(2);
        if shared == 0 {
            return Err(FieldError::new("n_shared_experts", "Inkling's router scores its shared experts: at least one"));
        }
        let moe = MoeSpec {
            num_experts: obj.usize_opt("n_routed_experts")?.unwrap_or(256),
            top_k: obj.usize_opt("num_experts_per_tok")?.unwrap_or(6),
            expert_intermediate_size: expert_i,
            scoring: RouterScoring::LogSigmoidShared { route_scale: obj.f64_or("route_scale", 8.0)? as f32, shared },
            shared_intermediate_size: Some(expert_i),
            activation: ExpertActivation::Silu,
            expert_bias: false,
        };
        Ok(FamilyParts { attention, layers, moe, expert_names: names.experts, dense_names: names.dense, rms_norm_unit_offset: false })
    })?;
    let divisor = obj.f64_or("logits_mup_width_multiplier", 24.0)? as f32;
    if divisor.is_nan() || divisor <= 0.0 {
        return Err(FieldError::new("logits_mup_width_multiplier", "must be positive"));
    }
    spec.logit_divisor = divisor;
    unpad_vocab(&mut spec, obj.usize_opt("unpadded_vocab_size")?)?;
    Ok(spec)
}
