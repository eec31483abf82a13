//! Inkling 2 (`Inkling2ForCausalLM`, `inkling2_text`; the image-text release
//! `Inkling2ForConditionalGeneration`, `inkling2`, served as its text part): Inkling's
//! relative-position bias and short convolutions, with block attention residuals (each layer's input a learned-query softmax over
//! earlier blocks' outputs and the running state; full layers read one each for q, k and v),
//! per-token attention sinks, L2-clipped queries, keys and relative states, dynamic key/value
//! convolutions on full layers, a sigmoid-gated output projection, softcapped SwiGLU experts
//! behind a sigmoid router with a correction bias, and a final logit softcap; no shared experts,
//! no dense layers.
//!
//! Tensor names are the release's (`model.llm.layers.N.attn.wq_du.weight`, experts' `w13_weight`
//! with gate and up rows interleaved, `model.llm.attn_res.*` queries), which transformers 5.24
//! writes back on save; the unembedding is stored padded to `vocab_size`.

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "Inkling2ForCausalLM", model_types: &["inkling2_text"], parse, spellings: &[] };
/// The image-text release (`Inkling2ForConditionalGeneration`): the text model under
/// `text_config`, its tensors under the same `model.llm.` names; the vision tower is left unread.
pub(super) const IMAGE_TEXT_FAMILY: FamilyDef =
    FamilyDef { architecture: "Inkling2ForConditionalGeneration", model_types: &["inkling2"], parse: parse_image_text, spellings: &[] };

const NAMES: RelativeNames = RelativeNames {
    q: "model.llm.layers.{L}.attn.wq_du.weight",
    k: "model.llm.layers.{L}.attn.wk_dv.weight",
    v: "model.llm.layers.{L}.attn.wv_dv.weight",
    r: "model.llm.layers.{L}.attn.wr_du.weight",
    o: "model.llm.layers.{L}.attn.wo_ud.weight",
    // Inkling 2 clips instead of norming q and k.
    q_norm: "",
    k_norm: "",
    k_conv: "model.llm.layers.{L}.attn.k_sconv.weight",
    v_conv: "model.llm.layers.{L}.attn.v_sconv.weight",
    rel_proj: "model.llm.layers.{L}.attn.rel_logits_proj.proj",
    attn_conv: "model.llm.layers.{L}.attn_sconv.weight",
    mlp_conv: "model.llm.layers.{L}.mlp_sconv.weight",
    mlp_scale: "",
    router_scale: "",
    embed_norm: "model.llm.embed_norm.weight",
};

const NAMES_V2: Inkling2Names = Inkling2Names {
    gate: "model.llm.layers.{L}.attn.gate_attn.weight",
    sink: "model.llm.layers.{L}.attn.attn_sink_proj.weight",
    q_scale: "model.llm.layers.{L}.attn.q_l2_clip.scale",
    rel_scale: "model.llm.layers.{L}.attn.rel_l2_clip.scale",
    k_static: "model.llm.layers.{L}.attn.k_sconv.static_w",
    k_dynamic: "model.llm.layers.{L}.attn.k_sconv.weight_proj",
    v_static: "model.llm.layers.{L}.attn.v_sconv.static_w",
    v_dynamic: "model.llm.layers.{L}.attn.v_sconv.weight_proj",
    q_input_norm: "model.llm.layers.{L}.q_input_norm.weight",
    k_input_norm: "model.llm.layers.{L}.k_input_norm.weight",
    v_input_norm: "model.llm.layers.{L}.v_input_norm.weight",
    attn_query: "model.llm.attn_res.attn_queries.{L}",
    mlp_query: "model.llm.attn_res.mlp_queries.{L}",
    output_query: "model.llm.attn_res.output_query",
};

const DENSE: DenseNames = DenseNames {
    embed: "model.llm.embed.weight",
    final_norm: "model.llm.norm.weight",
    lm_head: "model.llm.unembed.weight",
    // Sliding layers' input norm; full layers norm q, k and v inputs apart (`Inkling2Names`).
    input_norm: "model.llm.layers.{L}.attn_norm.weight",
    post_attention_norm: "model.llm.layers.{L}.mlp_norm.weight",
    q: "model.llm.layers.{L}.attn.wq_du",
    k: "model.llm.layers.{L}.attn.wk_dv",
    v: "model.llm.layers.{L}.attn.wv_dv",
    o: "model.llm.layers.{L}.attn.wo_ud",
    q_norm: "",
    k_norm: "",
    sinks: "model.llm.layers.{L}.attn.attn_sink_proj.weight",
    linear_attn: "model.llm.layers.{L}.attn",
    mlp_gate: "",
    mlp_up: "",
    mlp_down: "",
    mlp_layout: DenseMlpLayout::Separate,
};

const EXPERTS: ExpertNames = ExpertNames {
    router: "model.llm.layers.{L}.mlp.gate.weight",
    router_bias: Some("model.llm.layers.{L}.mlp.gate.bias"),
    router_logit_bias: None,
    shared: None,
    shared_gate: None,
    router_hash: None,
    layout: ExpertLayout::StackedInterleaved,
    gate: "model.llm.layers.{L}.mlp.experts.w13_weight",
    up: "model.llm.layers.{L}.mlp.experts.w13_weight",
    down: "model.llm.layers.{L}.mlp.experts.w2_weight",
};

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    text_model(obj, FAMILY.architecture)
}

fn parse_image_text(obj: &Obj) -> FieldResult<ModelSpec> {
    text_config_part(obj, |text| text_model(text, IMAGE_TEXT_FAMILY.architecture))
}

fn text_model(obj: &Obj, architecture: &'static str) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    match obj.str_opt("scoring_func")? {
        None | Some("sigmoid") => {}
        Some(other) => return Err(FieldError::new("scoring_func", format!("`{other}` is not supported (Inkling 2 routes with sigmoid)"))),
    }
    let defaults = Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(8) };
    let positive_or = |key: &str, default: usize| positive_or(obj, key, default);
    let positive_f = |key: &str, default: f64| -> FieldResult<f32> {
        let v = obj.f64_or(key, default)? as f32;
        if v.is_nan() || v <= 0.0 {
            return Err(FieldError::new(key, "must be positive"));
        }
        Ok(v)
    };
    let expert_i = match obj.usize_opt("moe_intermediate_size")? {
        Some(i) => i,
        None => positive_or("intermediate_size", 2304)?,
    };
    let route_scale = match obj.f64_opt("route_scale")? {
        Some(r) => r,
        None => obj.f64_or("routed_scaling_factor", 8.0)?,
    } as f32;
    let mut spec = build(obj, &defaults, architecture, |sz| {
        let n = sz.num_layers;
        let sliding_layers = match per_layer(obj, "layer_types", n, &[("hybrid_sliding", true), ("hybrid", false)])? {
            Some(kinds) => kinds,
            None => (0..n).map(|l| (l + 1) % 6 != 0).collect(),
        };
        let (full, sliding) = relative_head_shapes(obj, sz.head_dim, [48, 8, 48, 8, 128])?;
        let window = positive_or("sliding_window_size", 1024)?;
        let relative = RelativeSpec {
            full,
            sliding,
            window,
            sliding_layers: sliding_layers.clone(),
            d_rel: positive_or("d_rel", 16)?,
            rel_extent: positive_or("rel_extent", 1024)?,
            log_scaling: Some((positive_or("log_scaling_n_floor", 128_000)? as f32, obj.f64_or("log_scaling_alpha", 0.1)? as f32)),
            conv_kernel: positive_or("conv_kernel_size", 4)?,
            names: NAMES,
            v2: Some(Box::new(Inkling2Spec {
                qk_clip: positive_f("qk_l2_clip_threshold", 22.627416997969522)?,
                rel_clip: positive_f("rel_l2_clip_threshold", 8.0)?,
                layers_per_block: positive_or("n_layers_per_attn_res_block", 6)?,
                names: NAMES_V2,
            })),
        };
        let attention = AttentionSpec {
            kind: AttentionKind::Relative(Box::new(relative)),
            qk_norm: QkNorm::None,
            clip_qkv: None,
            bias: false,
            o_bias: false,
            rotary_dim: 0,
            rope_interleave: false,
            scale: (sz.head_dim as f32).powf(-0.5),
            sliding_window: sliding_layers.iter().map(|s| s.then_some(window)).collect(),
            sinks: false,
            output_gate: false,
            mixers: vec![Mixer::Attention; n],
            gated_delta: None,
            no_rope: true,
        };
        let experts = obj.usize_opt("n_routed_experts")?.unwrap_or(384);
        if experts < 2 {
            return Err(FieldError::new("n_routed_experts", format!("{experts}: a router needs at least 2 experts to choose among")));
        }
        let moe = MoeSpec {
            num_experts: experts,
            top_k: obj.usize_opt("num_experts_per_tok")?.unwrap_or(8),
            expert_intermediate_size: expert_i,
            // One group holding every expert: plain sigmoid top-k on the biased scores.
            scoring: RouterScoring::SigmoidGrouped { n_group: 1, topk_group: 1, norm_topk_prob: true, routed_scaling_factor: route_scale },
            shared_intermediate_size: None,
            activation: ExpertActivation::SoftcappedSwiglu { gate_cap: positive_f("mlp_gate_softcap", 4.0)?, up_cap: positive_f("mlp_up_softcap", 25.0)? },
            expert_bias: false,
        };
        Ok(FamilyParts { attention, layers: vec![LayerMlp::Moe; n], moe, expert_names: EXPERTS, dense_names: DENSE, rms_norm_unit_offset: false })
    })?;
    spec.logit_softcap = Some(positive_f("final_logit_softcapping", 30.0)?);
    unpad_vocab(&mut spec, Some(obj.usize_opt("unpadded_vocab_size")?.unwrap_or(200_058)))?;
    Ok(spec)
}
