//! DeepSeek-V4 (`DeepseekV4ForCausalLM`, `deepseek_v4`): manifold-constrained hyper-connections
//! (`hc_mult` residual streams, Sinkhorn-projected mixing), shared-KV attention with a sliding
//! window and per-head sinks beside compressed entries — compressed sparse attention (pooled over
//! overlapping windows of `compress_rates.compressed_sparse_attention`, picked by a lightning
//! indexer) and heavily compressed attention (windows of `…heavily_compressed_attention`, all
//! seen) — a grouped low-rank output projection, hash-routed first MoE layers (`tid2eid`), then
//! `sqrtsoftplus` routing with a correction bias, clamped SwiGLU experts and a shared expert.
//!
//! Tensor names are the release's (`layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
//! `embed.weight`, `head.weight`, `hc_head_fn`, …, no `model.` prefix), which transformers reads
//! through its conversion mapping and writes back on save. The config is read in transformers
//! 5.24's spelling and the release's older one (`compress_ratios`, `compress_rate_csa`/`_hca`,
//! `num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling` with `compress_rope_theta`).

use serde_json::{Map, Value};

use super::*;
use crate::spec::parse_rope;

pub(super) const FAMILY: FamilyDef = FamilyDef { architecture: "DeepseekV4ForCausalLM", model_types: &["deepseek_v4"], parse, spellings: &[] };

const NAMES: CompressedNames = CompressedNames {
    q_a: "layers.{L}.attn.wq_a.weight",
    q_a_norm: "layers.{L}.attn.q_norm.weight",
    q_b: "layers.{L}.attn.wq_b.weight",
    kv: "layers.{L}.attn.wkv.weight",
    kv_norm: "layers.{L}.attn.norm.weight",
    o_a: "layers.{L}.attn.wo_a.weight",
    o_b: "layers.{L}.attn.wo_b.weight",
    sinks: "layers.{L}.attn.attn_sink",
    compressor: "layers.{L}.attn.compressor",
    indexer: "layers.{L}.attn.indexer",
};

const DENSE: DenseNames = DenseNames {
    embed: "embed.weight",
    final_norm: "norm.weight",
    lm_head: "head.weight",
    input_norm: "layers.{L}.attn_norm.weight",
    post_attention_norm: "layers.{L}.ffn_norm.weight",
    // The attention's own names are `NAMES`; these name nothing a V4 checkpoint holds.
    q: "layers.{L}.attn.wq_b",
    k: "layers.{L}.attn.wkv",
    v: "layers.{L}.attn.wkv",
    o: "layers.{L}.attn.wo_b",
    q_norm: "layers.{L}.attn.q_norm.weight",
    k_norm: "layers.{L}.attn.norm.weight",
    sinks: "layers.{L}.attn.attn_sink",
    linear_attn: "layers.{L}.attn",
    mlp_gate: "layers.{L}.ffn.shared_experts.w1.weight",
    mlp_up: "layers.{L}.ffn.shared_experts.w3.weight",
    mlp_down: "layers.{L}.ffn.shared_experts.w2.weight",
    mlp_layout: DenseMlpLayout::Separate,
};

const EXPERTS: ExpertNames = ExpertNames {
    router: "layers.{L}.ffn.gate.weight",
    router_bias: Some("layers.{L}.ffn.gate.bias"),
    router_logit_bias: None,
    shared: Some(["layers.{L}.ffn.shared_experts.w1.weight", "layers.{L}.ffn.shared_experts.w3.weight", "layers.{L}.ffn.shared_experts.w2.weight"]),
    shared_gate: None,
    router_hash: Some("layers.{L}.ffn.gate.tid2eid"),
    layout: ExpertLayout::Separate,
    gate: "layers.{L}.ffn.experts.{E}.w1.weight",
    up: "layers.{L}.ffn.experts.{E}.w3.weight",
    down: "layers.{L}.ffn.experts.{E}.w2.weight",
};

const HYPER_NAMES: ([&str; 3], [&str; 3], [&str; 3]) = (
    ["layers.{L}.hc_attn_fn", "layers.{L}.hc_attn_base", "layers.{L}.hc_attn_scale"],
    ["layers.{L}.hc_ffn_fn", "layers.{L}.hc_ffn_base", "layers.{L}.hc_ffn_scale"],
    ["hc_head_fn", "hc_head_base", "hc_head_scale"],
);

fn parse(obj: &Obj) -> FieldResult<ModelSpec> {
    check_act(obj)?;
    match obj.str_opt("scoring_func")? {
        None | Some("sqrtsoftplus") => {}
        Some(other) => return Err(FieldError::new("scoring_func", format!("`{other}` is not supported (DeepSeek-V4 routes with sqrtsoftplus)"))),
    }
    let defaults = Defaults { rms_norm_eps: 1e-6, rope_theta: 10_000.0, tie_word_embeddings: false, head_dim_field: Some("head_dim"), num_kv_heads: Some(1) };
    let positive_or = |key: &str, default: usize| positive_or(obj, key, default);
    let mut spec = build(obj, &defaults, FAMILY.architecture, |sz| {
        let n = sz.num_layers;
        let rates = obj.obj_opt("compress_rates")?;
        let rate = |key: &str, legacy: &str, default: usize| -> FieldResult<usize> {
            let v = match &rates {
                Some(r) => r.usize_opt(key).map_err(|e| FieldError::new(&format!("compress_rates.{}", e.field), e.problem))?,
                None => None,
            };
            match v.or(obj.usize_opt(legacy)?).unwrap_or(default) {
                0 => Err(FieldError::new("compress_rates", format!("`{key}` must be greater than zero"))),
                v => Ok(v),
            }
        };
        let csa_rate = rate("compressed_sparse_attention", "compress_rate_csa", 4)?;
        let hca_rate = rate("heavily_compressed_attention", "compress_rate_hca", 128)?;
        let kinds = layer_kinds(obj, n)?;
        let rope_dim = match (obj.f64_opt("partial_rotary_factor")?, obj.usize_opt("qk_rope_head_dim")?) {
            (Some(f), _) => (sz.head_dim as f64 * f).round() as usize,
            (None, Some(r)) => r,
            (None, None) => sz.head_dim / 8,
        };
        let compressed = CompressedSpec {
            q_lora_rank: positive_or("q_lora_rank", 1024)?,
            rope_dim,
            o_groups: positive_or("o_groups", 8)?,
            o_lora_rank: positive_or("o_lora_rank", 1024)?,
            window: positive_or("sliding_window", 128)?,
            kinds,
            csa_rate,
            hca_rate,
            indexer_heads: positive_or("index_n_heads", 64)?,
            indexer_head_dim: positive_or("index_head_dim", 128)?,
            indexer_top_k: positive_or("index_topk", 512)?,
            compress_rope: compress_rope(obj)?,
            names: NAMES,
        };
        let window = compressed.window;
        let attention = AttentionSpec {
            kind: AttentionKind::Compressed(Box::new(compressed)),
            qk_norm: QkNorm::None,
            clip_qkv: None,
            bias: false,
            o_bias: false,
            rotary_dim: rope_dim,
            rope_interleave: true,
            scale: (sz.head_dim as f32).powf(-0.5),
            sliding_window: vec![Some(window); n],
            sinks: true,
            output_gate: false,
            mixers: vec![Mixer::Attention; n],
            gated_delta: None,
            no_rope: false,
        };
        let expert_i = obj.positive("moe_intermediate_size")?;
        let swiglu_limit = obj.f64_or("swiglu_limit", 10.0)? as f32;
        if swiglu_limit.is_nan() || swiglu_limit <= 0.0 {
            return Err(FieldError::new("swiglu_limit", "must be positive"));
        }
        let shared = obj.usize_opt("n_shared_experts")?.unwrap_or(1);
        let moe = MoeSpec {
            num_experts: obj.usize_opt("n_routed_experts")?.unwrap_or(256),
            top_k: obj.usize_opt("num_experts_per_tok")?.unwrap_or(6),
            expert_intermediate_size: expert_i,
            scoring: RouterScoring::SqrtSoftplus { routed_scaling_factor: obj.f64_or("routed_scaling_factor", 1.5)? as f32 },
            shared_intermediate_size: (shared > 0).then_some(shared * expert_i),
            activation: ExpertActivation::ClampedSilu { limit: swiglu_limit },
            expert_bias: false,
        };
        Ok(FamilyParts { attention, layers: vec![LayerMlp::Moe; n], moe, expert_names: EXPERTS, dense_names: DENSE, rms_norm_unit_offset: false })
    })?;
    let n = spec.num_layers;
    spec.hash_routed = match per_layer(obj, "mlp_layer_types", n, &[("hash_moe", true), ("moe", false)])? {
        Some(kinds) => kinds,
        None => {
            let hashed = obj.usize_opt("num_hash_layers")?.unwrap_or(3);
            (0..n).map(|l| l < hashed).collect()
        }
    };
    let (attn, ffn, head) = HYPER_NAMES;
    spec.hyper = Some(HyperSpec {
        streams: positive_or("hc_mult", 4)?,
        sinkhorn_iters: positive_or("hc_sinkhorn_iters", 20)?,
        eps: obj.f64_or("hc_eps", 1e-6)? as f32,
        attn,
        ffn,
        head,
    });
    spec.rope = main_rope(obj)?;
    Ok(spec)
}

/// `layer_types`, or the release's per-layer `compress_ratios` (0, 4 or 128, as transformers maps
/// them), or transformers' default: two heavy layers, then sparse and heavy in turn.
fn layer_kinds(obj: &Obj, n: usize) -> FieldResult<Vec<CompressKind>> {
    if let Some(kinds) = per_layer(
        obj,
        "layer_types",
        n,
        &[
            ("sliding_attention", CompressKind::Sliding),
            ("compressed_sparse_attention", CompressKind::Sparse),
            ("heavily_compressed_attention", CompressKind::Heavy),
        ],
    )? {
        return Ok(kinds);
    }
    if let Some(Value::Array(ratios)) = obj.get("compress_ratios") {
        return ratios
            .iter()
            .take(n)
            .enumerate()
            .map(|(l, r)| match r.as_u64() {
                Some(0) => Ok(CompressKind::Sliding),
                Some(4) => Ok(CompressKind::Sparse),
                Some(128) => Ok(CompressKind::Heavy),
                _ => Err(FieldError::new("compress_ratios", format!("entry {l}: expected 0, 4 or 128, got {r}"))),
            })
            .collect::<FieldResult<Vec<_>>>()
            .and_then(|k| if k.len() == n { Ok(k) } else { Err(FieldError::new("compress_ratios", format!("{} entries for {n} layers", k.len()))) });
    }
    Ok((0..n).map(|l| if l < 2 || l % 2 == 0 { CompressKind::Heavy } else { CompressKind::Sparse }).collect())
}

/// The sliding layers' rotary: `rope_parameters.main`, or plain `rope_theta` (never scaled).
fn main_rope(obj: &Obj) -> FieldResult<RopeSpec> {
    let main = obj.obj_opt("rope_parameters")?.map(|p| p.obj_opt("main")).transpose()?.flatten();
    let theta = match main {
        Some(m) => m.f64_opt("rope_theta").map_err(|e| FieldError::new(&format!("rope_parameters.main.{}", e.field), e.problem))?,
        None => None,
    };
    let theta = theta.or(obj.f64_opt("rope_theta")?).unwrap_or(10_000.0);
    if theta <= 0.0 {
        return Err(FieldError::new("rope_theta", "must be positive"));
    }
    Ok(RopeSpec { theta, scaling: RopeScaling::None })
}

/// The compressed layers' rotary: `rope_parameters.compress`, or the release's flat
/// `rope_scaling` (or `rope_parameters`) at `compress_rope_theta`; YaRN's attention factor is 1
/// unless given (V4 does not scale cos and sin by YaRN's mscale).
fn compress_rope(obj: &Obj) -> FieldResult<RopeSpec> {
    let nested = obj.obj_opt("rope_parameters")?.map(|p| p.obj_opt("compress")).transpose()?.flatten();
    let (field, mut params) = match nested {
        Some(c) => ("rope_parameters.compress", c.0.clone()),
        None => {
            let flat = match obj.obj_opt("rope_scaling")? {
                Some(p) => Some(("rope_scaling", p)),
                None => obj.obj_opt("rope_parameters")?.map(|p| ("rope_parameters", p)),
            };
            let mut params: Map<String, Value> = flat.as_ref().map(|(_, p)| p.0.clone()).unwrap_or_default();
            params.insert("rope_theta".into(), Value::from(obj.f64_opt("compress_rope_theta")?.unwrap_or(160_000.0)));
            (flat.map_or("rope_scaling", |(f, _)| f), params)
        }
    };
    let kind = params.get("rope_type").or(params.get("type")).and_then(Value::as_str).unwrap_or("default");
    if kind == "yarn" && !params.contains_key("attention_factor") {
        params.insert("attention_factor".into(), Value::from(1.0));
    }
    let mut wrapper = Map::new();
    wrapper.insert("rope_parameters".into(), Value::Object(params));
    if let Some(m) = obj.get("max_position_embeddings") {
        wrapper.insert("max_position_embeddings".into(), m.clone());
    }
    parse_rope(&Obj(&wrapper), 160_000.0).map_err(|e| FieldError::new(&e.field.replacen("rope_parameters", field, 1), e.problem))
}
