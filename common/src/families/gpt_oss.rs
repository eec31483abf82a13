//! gpt-oss (`GptOssForCausalLM`): GQA with q/k/v/o biases and a learned sink logit per head,
//! sliding-window and full layers as `layer_types` says (alternating, sliding first, by default),
//! YaRN rotary; a router with a linear bias whose top-k logits are softmaxed; experts fused per
//! layer (`gate_up_proj`, gate and up interleaved, `experts × in × out`) with biases and the
//! clamped SwiGLU, shipped by OpenAI as MXFP4 blocks and scales.

use serde_json::{json, Map, Value};

use super::*;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "GptOssForCausalLM", model_types: &["gpt_oss"], parse, spellings: &[] };

/// `GptOssConfig`'s rotary default when a config names none.
fn default_rope() -> Value {
    json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096})
}

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    // GptOssConfig's defaults for what shapes the model and is not a plain field default here:
    // its rotary parameters and a head size of 64 (not hidden / heads).
    let missing_rope = obj.get("rope_scaling").is_none() && obj.get("rope_parameters").is_none();
    let missing_head_dim = matches!(obj.get("head_dim"), None | Some(Value::Null));
    if missing_rope || missing_head_dim {
        let mut with_defaults: Map<String, Value> = obj.0.clone();
        if missing_rope {
            let mut rope = default_rope();
            if let Some(theta) = obj.get("rope_theta") {
                rope["rope_theta"] = theta.clone();
            }
            with_defaults.insert("rope_parameters".into(), rope);
        }
        if missing_head_dim {
            with_defaults.insert("head_dim".into(), json!(64));
        }
        return parse_with_defaults(&Obj(&with_defaults));
    }
    parse_with_defaults(obj)
}

fn parse_with_defaults(obj: &Obj) -> FieldResult<ModelSpec> {
    let defaults = Defaults { rms_norm_eps: 1e-5, rope_theta: 150_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(8) };
    build(obj, &defaults, FAMILY.architecture, |sz| {
        let n = sz.num_layers;
        let window = match obj.get("sliding_window") {
            Some(Value::Null) => None,
            _ => Some(obj.usize_opt("sliding_window")?.unwrap_or(128)),
        };
        if window == Some(0) {
            return Err(FieldError::new("sliding_window", "must be greater than zero"));
        }
        let windows = match per_layer(obj, "layer_types", n, &[("sliding_attention", window), ("full_attention", None)])? {
            Some(windows) => windows,
            None => (0..n).map(|l| if l % 2 == 0 { window } else { None }).collect(),
        };
        let bias = obj.bool_or("attention_bias", true)?;
        let mut attention = gqa(sz, QkNorm::None, None, bias, bias, windows);
        attention.sinks = true;
        let experts_key = spelling(obj, "num_local_experts", "num_experts")?;
        let mut moe = moe(obj, experts_key, "intermediate_size", false)?;
        moe.scoring = RouterScoring::TopKSoftmax;
        let (alpha, limit) = (obj.f64_or("swiglu_alpha", 1.702)?, obj.f64_or("swiglu_limit", 7.0)?);
        if !(alpha.is_finite() && (alpha as f32).is_finite()) {
            return Err(FieldError::new("swiglu_alpha", format!("{alpha} must be a finite number")));
        }
        if !(limit > 0.0 && (limit as f32).is_finite()) {
            return Err(FieldError::new("swiglu_limit", format!("{limit} must be a positive finite number")));
        }
        moe.activation = ExpertActivation::ClampedSwiglu { alpha: alpha as f32, limit: limit as f32 };
        moe.expert_bias = true;
        Ok(FamilyParts {
            attention,
            layers: vec![LayerMlp::Moe; n],
            moe,
            expert_names: ExpertNames {
                router: "model.layers.{L}.mlp.router.weight",
                router_bias: None,
                router_logit_bias: Some("model.layers.{L}.mlp.router.bias"),
                shared: None,
                shared_gate: None,
                router_hash: None,
                layout: ExpertLayout::FusedInterleaved,
                gate: "model.layers.{L}.mlp.experts.gate_up_proj",
                up: "model.layers.{L}.mlp.experts.gate_up_proj",
                down: "model.layers.{L}.mlp.experts.down_proj",
            },
            dense_names: DenseNames::LLAMA,
            rms_norm_unit_offset: false,
        })
    })
}
